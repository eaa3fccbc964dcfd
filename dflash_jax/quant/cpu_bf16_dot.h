// dflash-jax CPU matmul kernel: GGML weights times x with both rounded to bfloat16 (AVX512-BF16's dot product).
// Included by cpu_matmul.cc inside its anonymous namespace, after the build's vector header (Vec, vzero, vadd, vsum,
// vload, vstore, decode_block), GroupScales and prefetch_ahead.
//
// Formats kQ4_1_BF16 and kQ8_0_BF16: each dequantized weight (d * q + m, as the float path decodes it) and each
// element of x rounded to bfloat16 (round to nearest even, float32 subnormals read as zero), and every product
// summed as `vdpbf16ps` sums them: lane j of a 16-lane accumulator takes a 32-wide block's pair (2j, 2j + 1), the odd
// element's exact product first, then the even one's, each sum rounded once to float32 (subnormal results flushed to
// zero). Why: the float path spends two 16-lane FMAs per 32 weights and row of x, so past a few rows a verify is
// bound by the FMA pipes (0.43 ms a row for SmolLM2's MLP on a 2-core Zen 5: docs/cpu-step.md); here a block's
// weights are rounded once for all rows, and each row's 32 products are one instruction. Measured on that Zen 5
// (30 layers of SmolLM2 inside one program): a decode 3.96 vs 4.02 ms, a verify of 4 rows 6.04 vs 6.83, of 8 rows
// 9.64 vs 11.10. It is another function of x and of the weights than the float path (a relative error of up to
// 2^-9 per element on both sides), which is why it is a format of its own, asked for by name
// (`GenerationOptions.bf16_products`).
//
// Exactness, as for the float path: a row's x is rounded alone, and each output is one fixed chain (even blocks in
// one accumulator and odd ones in another, both in block order; lanes summed by the build's fixed reduction), so a
// row's result depends on nothing but that row. CPUs with AVX512-BF16 (Zen 4 and 5, Sapphire Rapids) run the
// instruction; every other build computes the same operations in plain C++ (`dot_pairs`), value for value (measured
// against the instruction on a Zen 5: 3.2 million lanes, normal and subnormal operands, no difference), slower than
// the float path there: on such a CPU the float path is the one to run.

// x as bfloat16: [M, K] in element order (the layout `vdpbf16ps` reads a block's 32 values in).
struct ActBF16 {
  std::vector<uint16_t> v;
};

inline float bf16_value(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float32 -> bfloat16 as `vcvtne2ps2bf16` rounds: a subnormal reads as (signed) zero, a NaN stays a quiet NaN,
// everything else to nearest even.
inline uint16_t bf16_round(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x40);
  if ((b & 0x7f800000u) == 0) b &= 0x80000000u;
  return uint16_t((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

inline float flush_subnormal(float f) { return std::fabs(f) < 1.17549435e-38f ? std::copysign(0.f, f) : f; }

// acc[j] of one 32-wide block's pairs, as `vdpbf16ps` computes it (the build without the instruction).
inline void dot_pairs(float* acc, const uint16_t* w, const uint16_t* x) {
  for (int j = 0; j < 16; ++j) {
    float s = flush_subnormal(acc[j]);
    s = flush_subnormal(std::fma(bf16_value(w[2 * j + 1]), bf16_value(x[2 * j + 1]), s));
    acc[j] = flush_subnormal(std::fma(bf16_value(w[2 * j]), bf16_value(x[2 * j]), s));
  }
}

inline void round_rows_bf16(const float* x, int64_t M, int64_t K, ActBF16& out) {
  out.v.resize(size_t(M * K));
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 32 <= M * K; i += 32) {
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(out.v.data() + i, reinterpret_cast<const __m512i&>(h));
  }
#endif
  for (; i < M * K; ++i) out.v[size_t(i)] = bf16_round(x[i]);
}

// One pass over weight rows [n0, n1) for T rows of x (F: the weight's GGML format, whose blocks decode_block reads).
template <Format F, int T>
void tile_bf16(const Weight& w, const ActBF16& xb, float* y, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t K = w.K, nb = K / kBlock, N = w.N;
  const uint16_t* xt = xb.v.data() + m0 * K;
  GroupScales<F> scales(w, n1);
  for (int64_t n = n0; n < n1; ++n) {
    const RowBytes r = scales.row(n);
#if defined(__AVX512BF16__)
    // blocks 2c into lo and 2c + 1 into hi, two blocks a pass
    Vec lo[T], hi[T];
    for (int i = 0; i < T; ++i) lo[i] = hi[i] = vzero();
    const __m512i* xv = reinterpret_cast<const __m512i*>(xt);  // one 32-value block of x per vector
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
      if constexpr (T > 4) prefetch_ahead<F>(r, b);
      Vec w0, w1, v0, v1;
      decode_block<F>(r, b, w0, w1);
      decode_block<F>(r, b + 1, v0, v1);
      const __m512bh wb = _mm512_cvtne2ps_pbh(w1, w0), vb = _mm512_cvtne2ps_pbh(v1, v0);
      for (int i = 0; i < T; ++i) {
        const __m512i x0 = _mm512_loadu_si512(xv + i * nb + b), x1 = _mm512_loadu_si512(xv + i * nb + b + 1);
        lo[i] = _mm512_dpbf16_ps(lo[i], wb, reinterpret_cast<const __m512bh&>(x0));
        hi[i] = _mm512_dpbf16_ps(hi[i], vb, reinterpret_cast<const __m512bh&>(x1));
      }
    }
    if (b < nb) {
      Vec w0, w1;
      decode_block<F>(r, b, w0, w1);
      const __m512bh wb = _mm512_cvtne2ps_pbh(w1, w0);
      for (int i = 0; i < T; ++i) {
        const __m512i x0 = _mm512_loadu_si512(xv + i * nb + b);
        lo[i] = _mm512_dpbf16_ps(lo[i], wb, reinterpret_cast<const __m512bh&>(x0));
      }
    }
    for (int i = 0; i < T; ++i) y[(m0 + i) * N + n] = vsum(vadd(lo[i], hi[i])) * w.tensor_scale;
#else
    float acc[2][T][16] = {};
    for (int64_t b = 0; b < nb; ++b) {
      Vec w0, w1;
      decode_block<F>(r, b, w0, w1);
      float f[32];
      uint16_t wb[32];
      vstore(f, w0);
      vstore(f + 16, w1);
      for (int e = 0; e < 32; ++e) wb[e] = bf16_round(f[e]);
      for (int i = 0; i < T; ++i) dot_pairs(acc[b & 1][i], wb, xt + i * K + b * kBlock);
    }
    for (int i = 0; i < T; ++i)
      y[(m0 + i) * N + n] = vsum(vadd(vload(acc[0][i], 16), vload(acc[1][i], 16))) * w.tensor_scale;
#endif
  }
}

template <Format F>
void rows_bf16_of(const Weight& w, const ActBF16& xb, float* y, int64_t M, int64_t n0, int64_t n1) {
  for_each_tile<kTile>(M, [&](auto T, int64_t m0) { tile_bf16<F, decltype(T)::value>(w, xb, y, m0, n0, n1); });
}
