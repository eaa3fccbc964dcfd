#include KERNEL
#include <chrono>
#include <cstdio>
#include <random>
template <int NS, int PART>
__attribute__((noinline)) void variant(const float* qr, const float* const* keys, const float* const* vals, int64_t count, float scale,
                float* s, float* p, float* m_out, float* l, float* o) {
  F16 q[NS];
  for (int j = 0; j < NS; ++j) q[j] = f16_load(qr + 16 * j);
  if (PART & 1) for (int64_t k0 = 0; k0 < count; k0 += 16) {
    const int64_t n = std::min<int64_t>(16, count - k0);
    F16 a[16];
    for (int m = 0; m < 16; ++m) {
      const int key = ((m & 1) << 3) | ((m & 2) << 1) | ((m & 4) >> 1) | ((m & 8) >> 3);
      const float* kp = keys[k0 + std::min<int64_t>(key, n - 1)];
      F16 acc = q[0] * f16_load(kp);
      for (int j = 1; j < NS; ++j) acc = f16_fma(q[j], f16_load(kp + 16 * j), acc);
      a[m] = acc;
    }
#if HSUM
    F16 r; for (int m = 0; m < 16; ++m) r[m] = f16_sum(a[m]);
    f16_store(s + k0, r * f16_splat(scale));
#else
    f16_store(s + k0, sums16(a) * f16_splat(scale));
#endif
  }
  const int64_t padded = (count + 15) / 16 * 16;
  float m = 0;
  F16 lsum = f16_splat(0.f);
  if (PART & 2) {
  F16 mv = f16_splat(-INFINITY);
  for (int64_t i = 0; i < padded; i += 16) mv = f16_max(mv, f16_load(s + i));
  m = -INFINITY;
  for (int j = 0; j < 16; ++j) m = std::max(m, mv[j]);
  for (int64_t i = 0; i < padded; i += 16) {
    const F16 e = f16_exp(f16_load(s + i) - f16_splat(m));
    f16_store(p + i, e);
    lsum = lsum + e;
  }
  }
  F16 even[NS], odd[NS];
  for (int j = 0; j < NS; ++j) even[j] = odd[j] = f16_splat(0.f);
  if (PART & 4) {
  int64_t i = 0;
  for (; i + 2 <= count; i += 2) {
    const F16 w0 = f16_splat(p[i]), w1 = f16_splat(p[i + 1]);
    for (int j = 0; j < NS; ++j) {
      even[j] = f16_fma(w0, f16_load(vals[i] + 16 * j), even[j]);
      odd[j] = f16_fma(w1, f16_load(vals[i + 1] + 16 * j), odd[j]);
    }
  }
  }
  *m_out = m;
  *l = f16_sum(lsum);
  for (int j = 0; j < NS; ++j) f16_store(o + 16 * j, even[j] + odd[j]);
}
int main(int argc, char** argv) {
  const int n = argc > 1 ? atoi(argv[1]) : 64, reps = 200000;
  std::mt19937 rng(0); std::normal_distribution<float> nd;
  std::vector<float> K(n * 64), V(n * 64), q(64);
  for (auto& x : K) x = nd(rng); for (auto& x : V) x = nd(rng); for (auto& x : q) x = nd(rng);
  std::vector<const float*> keys(n), vals(n);
  for (int i = 0; i < n; ++i) { keys[i] = K.data() + 64 * i; vals[i] = V.data() + 64 * i; }
  std::vector<float> s(n + 16), p(n + 16), o(64); float m, l; double chk = 0;
  auto run = [&](auto f, const char* name) {
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) { f(q.data(), keys.data(), vals.data(), n, 0.125f, s.data(), p.data(), &m, &l, o.data()); chk += o[1] + s[3]; q[0] += 1e-9f; }
    auto t1 = std::chrono::steady_clock::now();
    double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / reps;
    printf("%-12s n %d: %.1f ns per row, %.1f cycles per row-key\n", name, n, ns, ns / n * 4.4);
  };
  run(variant<4, 1>, "scores"); run(variant<4, 3>, "scores+exp"); run(variant<4, 4>, "values"); run(variant<4, 7>, "all");
  printf("%g\n", chk);
}
