#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <vector>
int main() {
  float* xa = (float*)aligned_alloc(64, 8 * 1536 * 4 + 64); int off = getenv("OFF") ? atoi(getenv("OFF")) : 0; for (int i = 0; i < 8 * 1536 + 16; ++i) xa[i] = 0.5f; struct { float* d; float* data() { return d; } } x{xa + off};
  const long reps = 2000000;
  for (int variant = 0; variant < 3; ++variant) {
    __m512 a[16]; for (auto& v : a) v = _mm512_setzero_ps();
    __m512 w = _mm512_set1_ps(1e-3f), w2 = _mm512_set1_ps(2e-3f);
    auto t0 = std::chrono::steady_clock::now();
    for (long r = 0; r < reps; ++r) for (int k = 0; k < 64; k += 16) {
      asm volatile("" : "+v"(w), "+v"(w2));
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        if (variant == 0) a[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x.data() + (k + i) * 16), a[i]);
        else if (variant == 1) a[i] = _mm512_fmadd_ps(w, w2, a[i]);
        else a[i] = _mm512_mul_ps(w, _mm512_loadu_ps(x.data() + (k + i) * 16));
      }
    }
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    float s = 0; for (auto& v : a) s += _mm512_reduce_add_ps(v);
    printf("%s: %.2f G/s (%g)\n", variant == 0 ? "fma+load" : variant == 1 ? "fma regs" : "mul+load", reps * 64.0 / t / 1e9, s);
  }
}
