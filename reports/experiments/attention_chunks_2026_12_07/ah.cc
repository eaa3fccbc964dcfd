// row attention alone: B 1, nKV 3, G 3, hd 64, L visible cached keys, T fresh rows; 30 distinct caches (cold-ish)
#include KERNEL
#include <chrono>
#include <cstdio>
#include <random>
int main(int argc, char** argv) {
  const int64_t B = 1, S = 1152, nKV = 3, G = 3, hd = 64;
  const int64_t T = argc > 1 ? atoi(argv[1]) : 1, L = argc > 2 ? atoi(argv[2]) : 1024;
  const int layers = argc > 3 ? atoi(argv[3]) : 30;
  std::mt19937 rng(0); std::normal_distribution<float> nd;
  std::vector<float> q(B*T*nKV*G*hd), fk(B*T*nKV*hd), fv(B*T*nKV*hd);
  std::vector<std::vector<float>> ck(layers), cv(layers);
  for (int i = 0; i < layers; ++i) { ck[i].resize(B*S*nKV*hd); cv[i].resize(B*S*nKV*hd); for (auto& x : ck[i]) x = nd(rng); for (auto& x : cv[i]) x = nd(rng); }
  for (auto* v : {&q, &fk, &fv}) for (auto& x : *v) x = nd(rng);
  std::vector<uint8_t> visc(B*T*S), visf(B*T*T);
  for (int t = 0; t < T; ++t) { for (int c = 0; c < S; ++c) visc[t*S+c] = c < L; for (int c = 0; c < T; ++c) visf[t*T+c] = c <= t; }
  std::vector<float> l(B*nKV*G*T), o(B*nKV*G*T*hd);
  std::vector<double> all; double chk = 0;
  for (int rep = 0; rep < 60; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < layers; ++i) {
      const KeySource src[2] = {{ck[i].data(), cv[i].data(), visc.data(), S, nKV * S * hd, hd, S * hd},
                                {fk.data(), fv.data(), visf.data(), T, T * nKV * hd, nKV * hd, hd}};
      attention_rows(q.data(), src, 0.125f, B, T, nKV, G, hd, l.data(), o.data());
    }
    auto t1 = std::chrono::steady_clock::now();
    all.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    chk += o[0] + l[0];
  }
  std::sort(all.begin(), all.end());
  printf("T %ld L %ld: %.1f us per %d calls (median), %.2f ns per row-key per call  chk %.6g\n", T, L, all[all.size()/2], layers,
         all[all.size()/2] * 1e3 / layers / (nKV*G*T*(L+T)), chk);
}
