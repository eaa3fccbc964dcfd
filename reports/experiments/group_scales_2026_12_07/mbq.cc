#include KERNEL  // -DKERNEL='"path/to/dflash_jax/quant/cpu_matmul.cc"'
#include <chrono>
#include <cstdio>
#include <random>
// 30 layers x (qkv, o, gate/up, down), Q4_1 weights: float path vs Q8 path, M rows, threaded like BlockMatmulImpl
struct W { int64_t N, K; std::vector<uint8_t> c; std::vector<uint16_t> s, m; };
int main(int argc, char** argv) {
  std::mt19937 g(0);
  auto mk = [&](int64_t N, int64_t K) { W w{N, K, std::vector<uint8_t>(N*K/2), std::vector<uint16_t>(N*K/32, 0x2c00), std::vector<uint16_t>(N*K/32, 0xac00)}; for (auto& b : w.c) b = g(); return w; };
  std::vector<std::vector<W>> calls;
  for (int l = 0; l < 30; ++l) {
    std::vector<W> qkv; qkv.push_back(mk(576,576)); qkv.push_back(mk(192,576)); qkv.push_back(mk(192,576)); calls.push_back(std::move(qkv));
    std::vector<W> o; o.push_back(mk(576,576)); calls.push_back(std::move(o));
    std::vector<W> gu; gu.push_back(mk(1536,576)); gu.push_back(mk(1536,576)); calls.push_back(std::move(gu));
    std::vector<W> d; d.push_back(mk(576,1536)); calls.push_back(std::move(d));
  }
  std::vector<int> Ms = {1, 2, 4, 8};
  for (int rep = 0; rep < 3; ++rep) for (int M : Ms) for (int fmt : {2, 5}) {
    std::vector<float> y(1536 * 2 * M); struct AV { float* d; size_t n; float* data() { return d; } float* begin() { return d; } float* end() { return d + n; } } x{(float*)aligned_alloc(64, 1536 * M * 4), size_t(1536 * M)};
    for (auto& v : x) v = (g() % 1000) / 1000.f - 0.5f;
    ActQ8 xq;
    auto one = [&](std::vector<W>& ws0) {
      std::vector<Weight> ws; int64_t total = 0;
      for (auto& w : ws0) { ws.push_back(Weight{Format(fmt), w.c.data(), w.s.data(), w.m.data(), w.N, w.K, 1.f}); total += w.N; }
      if (fmt == 5) quantize_rows_q8(x.data(), M, ws0[0].K, xq);
      const int64_t wanted = Workers::get().threads();
      const int64_t chunk = std::max<int64_t>(16, (total + wanted - 1) / wanted);
      struct Piece { int32_t weight; int64_t n0, n1; };
      std::vector<Piece> pieces;
      for (size_t i = 0; i < ws.size(); ++i) for (int64_t n0 = 0; n0 < ws[i].N; n0 += chunk) pieces.push_back({int32_t(i), n0, std::min(ws[i].N, n0 + chunk)});
      auto body = [&](int64_t p) { rows(ws[pieces[p].weight], x.data(), xq, y.data(), M, pieces[p].n0, pieces[p].n1); };
      Workers::get().run(int64_t(pieces.size()), body);
    };
    std::vector<double> ts;
    for (int i = 0; i < 40; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      for (auto& c : calls) one(c);
      ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    printf("%s M=%d: median %.3f ms min %.3f\n", fmt == 2 ? "f32" : "q8 ", M, ts[20]*1e3, ts[0]*1e3);
  }
}
