#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <random>
#include <algorithm>
// T=1 Q4_1 loop variants: which part of the decode bounds ~4 cycles per block
template <int V>
__attribute__((noinline)) void run(const uint8_t* codes, const uint16_t* sc, const uint16_t* mn, const float* sf, const float* mf, const float* x, float* y, int N, int K) {
  const int nb = K / 32;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) static float bs[64 * 64], bm[64 * 64];
  for (int n = 0; n < N; ++n) {
    if (V == 10 && n % 64 == 0) {
      const int rows = std::min(64, N - n);
      const uint16_t* s0 = sc + size_t(n) * nb; const uint16_t* m0 = mn + size_t(n) * nb;
      int total = rows * nb, i = 0;
      for (; i + 16 <= total; i += 16) {
        _mm512_store_ps(bs + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s0 + i))));
        _mm512_store_ps(bm + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(m0 + i))));
      }
      for (; i < total; ++i) { bs[i] = _cvtsh_ss(s0[i]); bm[i] = _cvtsh_ss(m0[i]); }
    }
    __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps(), lo2 = lo, hi2 = lo;
    const uint8_t* c = codes + size_t(n) * K / 2; const uint16_t* s = sc + size_t(n) * nb; const uint16_t* m = mn + size_t(n) * nb;
    __m512 D, MM; __m512i bi;
    alignas(64) float rs[64], rm[64];
    if (V == 9) {
      for (int b = 0; b < nb; b += 16) {
        _mm512_store_ps(rs + b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + b))));
        _mm512_store_ps(rm + b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(m + b))));
      }
    }
    for (int b = 0; b < nb; ++b) {
      __m512 d, mm;
      if (V == 1) { d = _mm512_set1_ps(0.01f); mm = _mm512_set1_ps(-0.05f); }
      else if (V == 5) { d = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(s[b]))); mm = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(m[b]))); }
      else if (V == 6) { if (b % 16 == 0) { D = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + b))); MM = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(m + b))); bi = _mm512_setzero_si512(); }
                         d = _mm512_permutexvar_ps(bi, D); mm = _mm512_permutexvar_ps(bi, MM); bi = _mm512_add_epi32(bi, _mm512_set1_epi32(1)); }
      else if (V == 10) { d = _mm512_set1_ps(bs[(n % 64) * nb + b]); mm = _mm512_set1_ps(bm[(n % 64) * nb + b]); }
      else if (V == 9) { d = _mm512_set1_ps(rs[b]); mm = _mm512_set1_ps(rm[b]); }
      else if (V == 8) { d = _mm512_set1_ps(sf[size_t(n) * nb + b]); mm = _mm512_set1_ps(mf[size_t(n) * nb + b]); }
      else { d = _mm512_cvtph_ps(_mm256_set1_epi16(short(s[b]))); mm = _mm512_cvtph_ps(_mm256_set1_epi16(short(m[b]))); }
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + b * 16)));
      const __m512 table = _mm512_fmadd_ps(iota, d, mm);
      __m512 w0, w1;
      if (V == 2) { w0 = _mm512_add_ps(table, _mm512_castsi512_ps(q)); w1 = table; }
      else if (V == 3) { w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), d, mm); w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, mm); }
      else { w0 = _mm512_permutexvar_ps(q, table); w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table); }
      if (V == 4 && (b & 1)) {
        lo2 = _mm512_fmadd_ps(w0, _mm512_load_ps(x + b * 32), lo2);
        hi2 = _mm512_fmadd_ps(w1, _mm512_load_ps(x + b * 32 + 16), hi2);
      } else {
        lo = _mm512_fmadd_ps(w0, _mm512_load_ps(x + b * 32), lo);
        hi = _mm512_fmadd_ps(w1, _mm512_load_ps(x + b * 32 + 16), hi);
      }
    }
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(lo, hi), _mm512_add_ps(lo2, hi2)));
  }
}
int main() {
  const int N = 1536, K = 576;
  std::mt19937 g(0);
  std::vector<uint8_t> c(N * K / 2); for (auto& b : c) b = g();
  std::vector<uint16_t> s(N * K / 32, 0x2c00), m(N * K / 32, 0xac00);
  float* x = (float*)aligned_alloc(64, K * 4); for (int i = 0; i < K; ++i) x[i] = 0.1f;
  std::vector<float> y(N), sf(N * K / 32, 0.01f), mf(N * K / 32, -0.05f);
  auto time = [&](const char* name, auto fn) {
    std::vector<double> ts;
    for (int r = 0; r < 41; ++r) { auto t0 = std::chrono::steady_clock::now(); for (int k = 0; k < 10; ++k) fn(); ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 10); }
    std::sort(ts.begin(), ts.end());
    printf("%-40s %.2f cycles/block\n", name, ts[20] * 4.2e9 / (N * K / 32.0));
  };
  for (int rep = 0; rep < 2; ++rep) {
    time("V0 current", [&] { run<0>(c.data(), s.data(), m.data(), sf.data(), mf.data(), x, y.data(), N, K); });
    time("V1 constant d, m", [&] { run<1>(c.data(), s.data(), m.data(), sf.data(), mf.data(), x, y.data(), N, K); });
    time("V2 no permutes", [&] { run<2>(c.data(), s.data(), m.data(), sf.data(), mf.data(), x, y.data(), N, K); });
    time("V3 cvt + fma decode", [&] { run<3>(c.data(), s.data(), m.data(), sf.data(), mf.data(), x, y.data(), N, K); });
    time("V4 current, 4 accumulators", [&] { run<4>(c.data(), s.data(), m.data(), sf.data(), mf.data(), x, y.data(), N, K); });
    time("V5 128-bit cvt + broadcast", [&] { run<5>(c.data(), s.data(), m.data(), sf.data(), mf.data(), x, y.data(), N, K); });
    time("V6 16 at a time + vpermps", [&] { run<6>(c.data(), s.data(), m.data(), sf.data(), mf.data(), x, y.data(), N, K); });
    time("V9 row's scales to stack first", [&] { run<9>(c.data(), s.data(), m.data(), sf.data(), mf.data(), x, y.data(), N, K); });
    time("V10 64 rows' scales converted first", [&] { run<10>(c.data(), s.data(), m.data(), sf.data(), mf.data(), x, y.data(), N, K); });
    time("V8 f32 scales, broadcast loads", [&] { run<8>(c.data(), s.data(), m.data(), sf.data(), mf.data(), x, y.data(), N, K); });
  }
}
