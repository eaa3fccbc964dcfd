#include KERNEL
#include <chrono>
#include <cstdio>
#include <random>
int main(int argc, char** argv) {
  const int64_t N = 1536, K = atoi(argv[1]);
  std::mt19937 g(0);
  std::vector<uint8_t> c(N * K / 2); for (auto& b : c) b = g();
  std::vector<uint16_t> s(N * K / 32), m(N * K / 32);
  for (auto& v : s) v = 0x2c00 + g() % 512; for (auto& v : m) v = 0xac00 + g() % 512;
  Weight w{kQ4_1, c.data(), s.data(), m.data(), N, K, 1.f};
  float* x = (float*)aligned_alloc(64, 8 * K * 4); for (int i = 0; i < 8 * K; ++i) x[i] = (g() % 1000) / 1000.f - 0.5f;
  std::vector<float> y(8 * N);
  auto time = [&](int T, auto fn) {
    std::vector<double> ts;
    for (int r = 0; r < 31; ++r) { auto t0 = std::chrono::steady_clock::now(); for (int k = 0; k < 10; ++k) fn(); ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 10); }
    std::sort(ts.begin(), ts.end());
    printf("T=%d: %.2f cycles/weight block  ", T, ts[15] * 4.2e9 / (N * K / 32.0));
  };
  time(1, [&] { tile<kQ4_1, 1>(w, x, y.data(), 0, 0, N); });
  time(2, [&] { tile<kQ4_1, 2>(w, x, y.data(), 0, 0, N); });
  time(4, [&] { tile<kQ4_1, 4>(w, x, y.data(), 0, 0, N); });
  time(8, [&] { tile<kQ4_1, 8>(w, x, y.data(), 0, 0, N); });
  double h = 0; for (int i = 0; i < 8 * N; ++i) h = h * 1.0000001 + y[i];
  printf(" hash %.9g\n", h);
}
