#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <chrono>
#include <cstdio>
#include <random>
namespace ffi { struct Error; }
struct Workers { static Workers& get() { static Workers w; return w; }
  template <class F> void run(int64_t n, const F& f) { for (int64_t i = 0; i < n; ++i) f(i); } };
#define DFLASH_NO_FFI 1
#include "attn.h"
int main(int argc, char** argv) {
  const int64_t B = 1, S = 328, nKV = 3, G = 3, hd = 64; int64_t T = argc > 1 ? atoi(argv[1]) : 1;
  std::mt19937 rng(0); std::normal_distribution<float> nd;
  std::vector<float> q(B*T*nKV*G*hd), ck(B*S*nKV*hd), cv(B*S*nKV*hd), fk(B*T*nKV*hd), fv(B*T*nKV*hd);
  for (auto* v : {&q, &ck, &cv, &fk, &fv}) for (auto& x : *v) x = nd(rng);
  std::vector<uint8_t> visc(B*T*S), visf(B*T*T);
  for (int t = 0; t < T; ++t) { for (int c = 0; c < S; ++c) visc[t*S+c] = c < 256; for (int c = 0; c < T; ++c) visf[t*T+c] = c <= t; }
  KeySource src[2] = {{ck.data(), cv.data(), visc.data(), S}, {fk.data(), fv.data(), visf.data(), T}};
  std::vector<float> l(B*nKV*G*T), o(B*nKV*G*T*hd);
  const bool cold = argc > 2; std::vector<float> junk(cold ? 64 << 20 >> 2 : 0);
  std::vector<double> all; double best = 1e9; double chk = 0;
  for (int rep = 0; rep < (cold ? 200 : 2000); ++rep) {
    if (cold) { for (size_t i = 0; i < junk.size(); i += 16) junk[i] += 1.f; }
    auto t0 = std::chrono::steady_clock::now();
    attention_rows(q.data(), src, 0.125f, B, T, nKV, G, hd, l.data(), o.data());
    auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::micro>(t1 - t0).count()); all.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    chk += o[0];
  }
  std::sort(all.begin(), all.end()); printf("median %.2f us; ", all[all.size()/2]);
  printf("T %ld: %.2f us per call (single thread), %.1f ns per row-key  chk %g\n", T, best, best * 1e3 / (nKV*G*T*(256+T)), chk);
}
