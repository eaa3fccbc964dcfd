#include <immintrin.h>
#include <chrono>
#include <cstdio>
int main() {
  __m512 a[12]; for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(1.0f + i * 1e-3f);
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  const long N = 200000000;
  auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < N / 12; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], m, c);
  }
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float s = 0; for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_ps(a[i]);
  printf("zmm FMA: %.2f G/s (%f)\n", N / t / 1e9, s);
  __m256 b[12]; for (int i = 0; i < 12; ++i) b[i] = _mm256_set1_ps(1.0f + i * 1e-3f);
  const __m256 m2 = _mm256_set1_ps(0.999999f), c2 = _mm256_set1_ps(1e-7f);
  t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < N / 12; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) b[i] = _mm256_fmadd_ps(b[i], m2, c2);
  }
  t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  s = 0; for (int i = 0; i < 12; ++i) { float f[8]; _mm256_storeu_ps(f, b[i]); s += f[0]; }
  printf("ymm FMA: %.2f G/s (%f)\n", N / t / 1e9, s);
}
