#include "/work/main/dflash_jax/quant/cpu_matmul.cc"
#include <chrono>
#include <cstdio>
#include <random>
// 30 layers x (qkv fused, o, gate/up fused, down) through Workers with BlockMatmulImpl's chunking, M = 1 (or argv[2])
struct W { int64_t N, K; std::vector<uint8_t> c; std::vector<uint16_t> s, m; };
int main(int argc, char** argv) {
  std::mt19937 g(0);
  const int M = argc > 2 ? atoi(argv[2]) : 1;
  auto mk = [&](int64_t N, int64_t K) { W w{N, K, std::vector<uint8_t>(N*K/2), std::vector<uint16_t>(N*K/32, 0x2c00), std::vector<uint16_t>(N*K/32, 0xac00)}; for (auto& b : w.c) b = g(); return w; };
  std::vector<std::vector<W>> calls;  // each call: weights sharing x
  for (int l = 0; l < 30; ++l) {
    std::vector<W> qkv; qkv.push_back(mk(576,576)); qkv.push_back(mk(192,576)); qkv.push_back(mk(192,576)); calls.push_back(std::move(qkv));
    std::vector<W> o; o.push_back(mk(576,576)); calls.push_back(std::move(o));
    std::vector<W> gu; gu.push_back(mk(1536,576)); gu.push_back(mk(1536,576)); calls.push_back(std::move(gu));
    std::vector<W> d; d.push_back(mk(576,1536)); calls.push_back(std::move(d));
  }
  std::vector<float> x(1536 * M), y(1536 * 2 * M);
  for (auto& v : x) v = (g() % 1000) / 1000.f;
  ActQ8 xq;
  auto one = [&](std::vector<W>& ws0, bool threaded) {
    std::vector<Weight> ws; int64_t total = 0;
    for (auto& w : ws0) { ws.push_back(Weight{kQ4_1, w.c.data(), w.s.data(), w.m.data(), w.N, w.K, 1.f}); total += w.N; }
    const int64_t wanted = 4 * Workers::get().threads();
    const int64_t chunk = std::max<int64_t>(16, (total + wanted - 1) / wanted);
    struct Piece { int32_t weight; int64_t n0, n1; };
    std::vector<Piece> pieces;
    for (size_t i = 0; i < ws.size(); ++i) for (int64_t n0 = 0; n0 < ws[i].N; n0 += chunk) pieces.push_back({int32_t(i), n0, std::min(ws[i].N, n0 + chunk)});
    auto body = [&](int64_t p) { rows(ws[pieces[p].weight], x.data(), xq, y.data(), M, pieces[p].n0, pieces[p].n1); };
    if (threaded) Workers::get().run(int64_t(pieces.size()), body);
    else for (size_t p = 0; p < pieces.size(); ++p) body(p);
  };
  for (int rep = 0; rep < 3; ++rep) for (int threaded : {0, 1}) for (int v : {0, 8}) { g_variant = v;
    std::vector<double> ts;
    for (int i = 0; i < 30; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      for (auto& c : calls) one(c, threaded);
      ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    printf("v%d M=%d threaded=%d: median %.3f ms min %.3f\n", v, M, threaded, ts[15]*1e3, ts[0]*1e3);
  }
}
