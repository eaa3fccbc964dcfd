// dflash-jax CPU matmul kernel: the AVX2 + FMA + F16C build (x86 without AVX-512).
// Included by cpu_matmul.cc inside its anonymous namespace, after Weight, the E4M3 / E2M1 tables, half_to_float and
// kBlock, RowBytes; defines Vec (16 float lanes), vzero / vfma / vadd / vsum / vload, decode_half<F, H> and, for
// whole blocks from a row's own pointers, decode_half_block<F, H> (cpu_matmul.cc makes decode / decode_block of them).

// AVX2 (x86 CPUs without AVX-512: Zen 1-3, most Intel client chips): a 16-lane vector as two 8-lane halves, so every
// chain, and the horizontal reduction, is the AVX-512 build's, value for value.

struct Vec { __m256 a, b; };  // lanes 0..7, 8..15
inline Vec vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec vfma(const Vec& x, const Vec& y, const Vec& c) { return {_mm256_fmadd_ps(x.a, y.a, c.a), _mm256_fmadd_ps(x.b, y.b, c.b)}; }
inline Vec vadd(const Vec& x, const Vec& y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
// the tree of _mm512_reduce_add_ps: lanes l + (l + 8), then + 4, + 2, + 1
inline float vsum(const Vec& v) {
  const __m256 s8 = _mm256_add_ps(v.b, v.a);
  const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
}
inline __m256i lanes_below(int valid) {  // lane l set where l < valid
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
// x elements [k, k + 16) of one row, zero past `valid` (a dense weight's ragged last block)
inline Vec vload(const float* p, int valid) {
  if (valid >= 16) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  return {_mm256_maskload_ps(p, lanes_below(valid)), _mm256_maskload_ps(p + 8, lanes_below(valid - 8))};
}
inline void vstore(float* p, const Vec& v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
inline __m256 bf16_to_f32(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }

// n float16 values as float32 (exact): a group of GGML block scales (`GroupScales`).
inline void halves_to_floats(const uint16_t* h, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) out[i] = _cvtsh_ss(h[i]);
}

// Half H (0: elements 0..15, 1: elements 16..31) of whole block b of one row, from that row's own pointers
// (`RowBytes`), with no bounds to test: what `tile` runs for every block before a ragged end.
template <Format F, int H>
inline Vec decode_half_block(const RowBytes& r, int64_t b) {
  if constexpr (F == kF32) {
    const float* p = reinterpret_cast<const float*>(r.codes) + b * kBlock + 16 * H;
    return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  } else if constexpr (F == kBF16) {
    const __m128i* q = reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(r.codes) + b * kBlock + 16 * H);
    return {bf16_to_f32(_mm_loadu_si128(q)), bf16_to_f32(_mm_loadu_si128(q + 1))};
  } else if constexpr (F == kQ4_1) {
    // byte j of a block holds code j (low nibble) and code j + 16 (high nibble); d * q + m rounded once (one FMA),
    // as the AVX-512 build's table holds it
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r.codes + b * 16));
    const __m256 d = _mm256_set1_ps(r.d[b]), m = _mm256_set1_ps(r.m[b]);
    const __m256i lo = _mm256_cvtepu8_epi32(bytes), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    auto value = [&](__m256i q) {
      q = H ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(15));
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
    };
    return {value(lo), value(hi)};
  } else if constexpr (F == kQ8_0) {
    const int8_t* p = reinterpret_cast<const int8_t*>(r.codes) + b * kBlock + 16 * H;
    const __m256 d = _mm256_set1_ps(r.d[b]);
    auto eight = [&](const int8_t* q) {
      return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)))));
    };
    return {eight(p), eight(p + 8)};
  } else {  // NVFP4: element 2i in the low nibble; one e4m3 scale per 16. |e2m1| by an 8-entry table, then the sign
    const uint8_t* c = r.codes + b * 16 + 8 * H;
    const __m256 table = _mm256_mul_ps(_mm256_loadu_ps(E2M1), _mm256_set1_ps(E4M3[r.scale[b * 2 + H]]));  // scaled
    const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
    const __m128i twice = _mm_unpacklo_epi8(eight, eight);  // each byte twice: low nibble, then high
    auto half = [&](__m128i dup) {
      const __m256i code = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(dup), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28);
      return _mm256_xor_ps(_mm256_permutevar8x32_ps(table, code), _mm256_castsi256_ps(sign));
    };
    return {half(twice), half(_mm_srli_si128(twice, 8))};
  }
}

// Half H of block b of row n; zero past K: a ragged last block (dense weights; NVFP4's half block), else the whole
// block's half above.
template <Format F, int H>
inline Vec decode_half(const Weight& w, int64_t n, int64_t b) {
  const int64_t K = w.K;
  const int valid = int(std::min<int64_t>(kBlock, K - b * kBlock)) - 16 * H;
  if constexpr (F == kF32) {
    if (valid < 16) return vload(reinterpret_cast<const float*>(w.codes) + n * K + b * kBlock + 16 * H, valid);
  } else if constexpr (F == kBF16) {
    if (valid < 16) {
      alignas(32) uint16_t tmp[16] = {};
      std::memcpy(tmp, reinterpret_cast<const uint16_t*>(w.codes) + n * K + b * kBlock + 16 * H,
                  sizeof(uint16_t) * std::max(valid, 0));
      const __m128i* q = reinterpret_cast<const __m128i*>(tmp);
      return {bf16_to_f32(_mm_loadu_si128(q)), bf16_to_f32(_mm_loadu_si128(q + 1))};
    }
  } else if constexpr (F == kNVFP4) {
    if (valid <= 0) return vzero();
  } else {
    static_assert(!kWholeBlocksOnly<F>, "GGML weights run through decode_half_block with their float32 scales");
  }
  return decode_half_block<F, H>(row_bytes<F>(w, n), b);
}
