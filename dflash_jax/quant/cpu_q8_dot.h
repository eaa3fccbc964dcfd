// dflash-jax CPU matmul kernel: GGML weights times x as Q8 blocks (llama.cpp's integer dot product).
// Included by cpu_matmul.cc inside its anonymous namespace, after Weight, half_to_float and kBlock.
//
// Formats kQ4_1_Q8 and kQ8_0_Q8 compute y = x . W^T as llama.cpp's CPU backend does: each 32-wide block of a row of x
// is rounded to int8 with one float scale (Q8), and a block's product with a Q4_1 / Q8_0 weight block is an exact
// integer sum, scaled once. The float path (`tile` in cpu_matmul.cc) converts every weight to float and spends ~3
// vector operations per 8 weights; the integer one multiplies 32 weights by 32 activations in two (vpmaddubsw,
// vpmaddwd): on an AVX2 CPU it is compute, not memory, that bounds a decode step, so this is ~2x fewer cycles per
// weight. It is another function of x (the rounding of x to 8 bits: a relative error of ~0.4% of a block's largest
// element per element), which is why it is a format of its own, asked for by name (`GenerationOptions.q8_activations`).
//
// Exactness, as for the float path: x's rounding reads only that row's block, the integer sums are exact, and the
// float part is one fixed chain per output (8 lanes over blocks in block order, then one fixed reduction, plus
// Q4_1's min term as one scalar chain): a row's result depends on nothing but that row, in every build (AVX-512 and
// AVX2 CPUs run the AVX2 code below, an AVX-512 CPU with VNNI summing each lane's 4 products in one instruction and
// 8 rows a pass instead of 4; the portable build computes the same lanes in plain C++).

// A weight block's float16 scale (exact either way; F16C's conversion is one instruction, the portable one a dozen).
inline float scale_of(uint16_t h) {
#if defined(DFLASH_X86_AVX2)
  return _cvtsh_ss(h);
#else
  return half_to_float(h);
#endif
}

// x as Q8 blocks: per row and block, 32 int8 values q, the scale d (q * d ~ x) and s = d * sum(q) (Q4_1's min term).
struct ActQ8 {
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> d;  // [M, K / 32]
  std::vector<float> s;  // [K / 32, M]: block-major, so a tile's rows' min terms of one block sit side by side
  int64_t M = 0;
};

#if defined(DFLASH_X86_AVX2)
// One block of quantize_rows_q8 in vector registers, the same values: max|x| is exact in any order, x * (1 / d) is the
// same single rounding, and vcvtps2dq rounds half to even as nearbyint does (the default rounding mode). False if
// the block holds a NaN or an infinity (then nothing is written). The quantization runs on the calling thread before
// the workers start, once per row and call: moving it from scalar code to this made decoding under Q8 ~8% faster and
// a chain of 3's steps ~15% (`docs/cpu-step.md`).
inline bool quantize_block_q8(const float* xb, int8_t* q, float& d_out, int& sum_out) {
  const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(INFINITY);
  __m256 v[4], amax = _mm256_setzero_ps();
  int finite = 0xff;
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 mag = _mm256_andnot_ps(sign, v[i]);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(mag, inf, _CMP_LT_OQ));  // false for NaN and for +-inf
    amax = _mm256_max_ps(amax, mag);
  }
  if (finite != 0xff) return false;
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float m = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1)));
  const float d = m / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  __m256i qi[4], total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    qi[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(v[i], vid))));
    total = _mm256_add_epi32(total, qi[i]);
  }
  // int32 -> int8 (no value saturates: |q| <= 127); the packs interleave 128-bit lanes, the permute puts them back
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  d_out = d;
  sum_out = _mm_cvtsi128_si32(t);
  return true;
}
#endif

// Rounds each 32-wide block of x [M, K] to int8 with d = max|x| / 127, q = round-half-even(x * (1 / d)), as
// llama.cpp's quantize_row_q8_1 (whose vector code rounds half to even too). A block holding a NaN or an infinity
// gets d = NaN, so the outputs it reaches are NaN, as the float path's would be. (`quantize_block_q8` above is the
// same in vector registers.)
inline void quantize_rows_q8(const float* x, int64_t M, int64_t K, ActQ8& a) {
  const int64_t nb = K / kBlock;
  a.q.resize(size_t(M * K));
  a.d.resize(size_t(M * nb));
  a.s.resize(size_t(M * nb));
  a.M = M;
  for (int64_t r = 0; r < M * nb; ++r) {
    const float* xb = x + r * kBlock;
#if defined(DFLASH_X86_AVX2)
    float dv;
    int sv;
    if (quantize_block_q8(xb, a.q.data() + r * kBlock, dv, sv)) {
      a.d[size_t(r)] = dv;
      a.s[size_t((r % nb) * M + r / nb)] = dv * float(sv);
      continue;
    }
#endif
    float amax = 0.f;
    bool finite = true;
    for (int j = 0; j < kBlock; ++j) {
      finite = finite && std::isfinite(xb[j]);
      amax = std::max(amax, std::fabs(xb[j]));
    }
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int q = finite ? int(std::nearbyint(std::min(127.f, std::max(-127.f, xb[j] * id)))) : 0;
      a.q[size_t(r * kBlock + j)] = int8_t(q);
      sum += q;
    }
    a.d[size_t(r)] = finite ? d : NAN;
    a.s[size_t((r % nb) * M + r / nb)] = a.d[size_t(r)] * float(sum);
  }
}

// The 8 lanes of one block's integer product: lane l = sum over j in [4l, 4l + 4) of w_j * q_j (w: Q4_1 codes 0..15,
// or Q8_0 values), exact; then acc[l] = fma(dw * dx, float(lane l), acc[l]).
#if defined(DFLASH_X86_AVX2)
struct Acc8 { __m256 v; };
inline Acc8 acc8_zero() { return {_mm256_setzero_ps()}; }
// A weight block decoded once for all rows of a pass: Q4_1 as 32 unsigned codes; Q8_0 as |w| and w (for the signs).
struct WBlock { __m256i u, w; };
inline WBlock q4_1_block(const uint8_t* c) {  // byte j: code j (low nibble), code j + 16 (high nibble)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)), m4 = _mm_set1_epi8(15);
  return {_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), m4), _mm_and_si128(bytes, m4)), _mm256_setzero_si256()};
}
inline WBlock q8_0_block(const int8_t* c) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  return {_mm256_abs_epi8(w), w};
}
// vpmaddubsw pairs |w| (unsigned) with x carrying w's sign: |products| <= 128 * 127, pair sums below 2^15, exact
template <bool kSigned>
inline void acc8_block(const WBlock& wb, const int8_t* xq, float scale, Acc8& acc) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  if constexpr (kSigned) x = _mm256_sign_epi8(x, wb.w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // VNNI's vpdpbusd sums the same 4 exact products per lane in one instruction (no pair sum can saturate: see above)
  const __m256i lanes = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wb.u, x);
#else
  const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(wb.u, x), _mm256_set1_epi16(1));
#endif
  acc.v = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(lanes), acc.v);
}
inline float acc8_sum(const Acc8& a) {  // (l + l+4), then (+2), then (+1)
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
}
#else
struct Acc8 { float v[8]; };
inline Acc8 acc8_zero() { Acc8 a; for (float& f : a.v) f = 0.f; return a; }
struct WBlock { int w[32]; };
inline WBlock q4_1_block(const uint8_t* c) {
  WBlock b;
  for (int j = 0; j < 16; ++j) { b.w[j] = c[j] & 15; b.w[j + 16] = c[j] >> 4; }
  return b;
}
inline WBlock q8_0_block(const int8_t* c) { WBlock b; for (int j = 0; j < 32; ++j) b.w[j] = c[j]; return b; }
template <bool kSigned>
inline void acc8_block(const WBlock& wb, const int8_t* xq, float scale, Acc8& acc) {
  for (int l = 0; l < 8; ++l) {
    int lane = 0;
    for (int j = 4 * l; j < 4 * l + 4; ++j) lane += wb.w[j] * int(xq[j]);
    acc.v[l] = std::fma(scale, float(lane), acc.v[l]);
  }
}
inline float acc8_sum(const Acc8& a) {
  float s4[4], s2[2];
  for (int l = 0; l < 4; ++l) s4[l] = a.v[l] + a.v[l + 4];
  for (int l = 0; l < 2; ++l) s2[l] = s4[l] + s4[l + 2];
  return s2[0] + s2[1];
}
#endif

// out[b] = (weight block b's scale) * dx[b] for b < nb: the scale products of one weight row and one row of x, 8 at a
// time (each the same single rounding as the scalar product), so the inner loop broadcasts them from memory instead
// of spending a multiply and a broadcast per block and row on the vector pipes.
inline void scale_products(const uint16_t* dw, const float* dx, int64_t nb, float* out) {
  int64_t b = 0;
#if defined(DFLASH_X86_AVX2)
  for (; b + 8 <= nb; b += 8) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dw + b)));
    _mm256_storeu_ps(out + b, _mm256_mul_ps(d, _mm256_loadu_ps(dx + b)));
  }
#endif
  for (; b < nb; ++b) out[b] = scale_of(dw[b]) * dx[b];
}

// Q4_1's min terms of T rows, accm[i] = fma(m_b, s[i, b], accm[i]) over blocks b in order (one scalar chain per row);
// four rows as the lanes of one vector where the build has them (the same fma per lane).
template <int T>
struct MinTerms {
  float v[T] = {};
  void add(float m, const float* s) { for (int i = 0; i < T; ++i) v[i] = std::fma(m, s[i], v[i]); }
  float operator[](int i) const { return v[i]; }
};
#if defined(DFLASH_X86_AVX2)
template <>
struct MinTerms<4> {
  __m128 v = _mm_setzero_ps();
  void add(float m, const float* s) { v = _mm_fmadd_ps(_mm_set1_ps(m), _mm_loadu_ps(s), v); }
  float operator[](int i) const { alignas(16) float f[4]; _mm_store_ps(f, v); return f[i]; }
};
#if defined(__AVX512VL__)
template <>
struct MinTerms<8> {
  __m256 v = _mm256_setzero_ps();
  void add(float m, const float* s) { v = _mm256_fmadd_ps(_mm256_set1_ps(m), _mm256_loadu_ps(s), v); }
  float operator[](int i) const { alignas(32) float f[8]; _mm256_store_ps(f, v); return f[i]; }
};
#endif
#endif

// One pass over weight rows [n0, n1) for T rows of x (as Q8 blocks); F is kQ4_1_Q8 or kQ8_0_Q8.
template <Format F, int T>
void tile_q8(const Weight& w, const ActQ8& a, float* y, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t K = w.K, nb = K / kBlock;
  const uint16_t* dw = reinterpret_cast<const uint16_t*>(w.scale);
  const uint16_t* mw = reinterpret_cast<const uint16_t*>(w.mins);
  thread_local std::vector<float> scales;  // [T, nb]: this weight row's block scales times each row's d
  scales.resize(size_t(T * nb));
  for (int64_t n = n0; n < n1; ++n) {
    for (int i = 0; i < T; ++i) scale_products(dw + n * nb, a.d.data() + (m0 + i) * nb, nb, scales.data() + i * nb);
    Acc8 acc[T];
    MinTerms<T> accm;
    for (int i = 0; i < T; ++i) acc[i] = acc8_zero();
    for (int64_t b = 0; b < nb; ++b) {
      if constexpr (F == kQ4_1_Q8) {
        const WBlock wb = q4_1_block(w.codes + n * (K / 2) + b * 16);
        for (int i = 0; i < T; ++i)
          acc8_block<false>(wb, a.q.data() + ((m0 + i) * nb + b) * kBlock, scales[size_t(i * nb + b)], acc[i]);
        accm.add(scale_of(mw[n * nb + b]), a.s.data() + b * a.M + m0);
      } else {
        const WBlock wb = q8_0_block(reinterpret_cast<const int8_t*>(w.codes) + n * K + b * kBlock);
        for (int i = 0; i < T; ++i)
          acc8_block<true>(wb, a.q.data() + ((m0 + i) * nb + b) * kBlock, scales[size_t(i * nb + b)], acc[i]);
      }
    }
    for (int i = 0; i < T; ++i) {
      const float minterm = F == kQ4_1_Q8 ? accm[i] : 0.f;
      y[(m0 + i) * w.N + n] = (acc8_sum(acc[i]) + minterm) * w.tensor_scale;
    }
  }
}

// Rows of x per pass over the weights: 8 where AVX-512's 32 vector registers hold their accumulators, else 4 (the AVX2
// build's 16 registers).
#if defined(__AVX512VL__)
constexpr int kTileQ8 = 8;
#else
constexpr int kTileQ8 = 4;
#endif

template <Format F>
void rows_q8_of(const Weight& w, const ActQ8& a, float* y, int64_t M, int64_t n0, int64_t n1) {
  for_each_tile<kTileQ8>(M, [&](auto T, int64_t m0) { tile_q8<F, decltype(T)::value>(w, a, y, m0, n0, n1); });
}
