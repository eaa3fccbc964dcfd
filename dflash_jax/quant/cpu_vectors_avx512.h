// dflash-jax CPU matmul kernel: the AVX-512 build (16-lane registers).
// Included by cpu_matmul.cc inside its anonymous namespace, after Weight, the E4M3 / E2M1 tables, half_to_float and
// kBlock, RowBytes; defines Vec (16 float lanes), vzero / vfma / vadd / vsum / vload, decode<F>, and decode_block<F>
// (whole blocks from a row's own pointers: the loop that cpu_matmul.cc runs first on this build).

using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
// x elements [k, k + 16) of one row, zero past `valid` (a dense weight's ragged last block)
inline Vec vload(const float* p, int valid) {
  return valid >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(__mmask16((1u << std::max(valid, 0)) - 1), p);
}
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }

// NVFP4: 16 weights from 8 code bytes (element 2i in the low nibble) and their e4m3 scale byte.
inline Vec nvfp4_half(const uint8_t* c, uint8_t scale) {
  const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  return _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(eight, eight)), shifts),
                               _mm512_mul_ps(_mm512_loadu_ps(E2M1), _mm512_set1_ps(E4M3[scale])));
}

// n float16 values as float32 (exact): a group of GGML block scales (`GroupScales`).
inline void halves_to_floats(const uint16_t* h, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
  if (i < n) {
    const __mmask16 k = __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, h + i)));
  }
}

// Whole blocks (K % 32 == 0 for the block formats; the dense ones' blocks before a ragged end): block b of one row,
// from that row's own pointers (`RowBytes`), with no bounds to test. The same values as `decode`.
template <Format F>
inline void decode_block(const RowBytes& r, int64_t b, Vec& w0, Vec& w1) {
  if constexpr (F == kF32) {
    const float* p = reinterpret_cast<const float*>(r.codes) + b * kBlock;
    w0 = _mm512_loadu_ps(p);
    w1 = _mm512_loadu_ps(p + 16);
  } else if constexpr (F == kBF16) {
    const __m256i* p = reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(r.codes) + b * kBlock);
    w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16));
    w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p + 1)), 16));
  } else if constexpr (F == kQ4_1) {
    // byte j of a block holds code j (low nibble) and code j + 16 (high nibble), as GGML stores it
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.codes + b * 16)));
    const Vec iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const Vec table = _mm512_fmadd_ps(iota, _mm512_set1_ps(r.d[b]), _mm512_set1_ps(r.m[b]));  // d * q + m, q = 0..15
    w0 = _mm512_permutexvar_ps(q, table);  // uses the low 4 bits of each index: the low nibble
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  } else if constexpr (F == kQ8_0) {
    const int8_t* p = reinterpret_cast<const int8_t*>(r.codes) + b * kBlock;
    const Vec d = _mm512_set1_ps(r.d[b]);
    w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
    w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))));
  } else {  // NVFP4: one e4m3 scale per 16
    w0 = nvfp4_half(r.codes + b * 16, r.scale[b * 2]);
    w1 = nvfp4_half(r.codes + b * 16 + 8, r.scale[b * 2 + 1]);
  }
}

// The 32 weights of block b of row n, as two vectors (elements 0..15 and 16..31); zero past K. `tile` runs whole
// blocks through `decode_block` above, and this for a dense or NVFP4 weight's ragged last block (GGML weights have
// none: K % 32 == 0).
template <Format F>
inline void decode(const Weight& w, int64_t n, int64_t b, Vec& w0, Vec& w1) {
  const int64_t K = w.K;
  if constexpr (F == kF32) {
    const float* p = reinterpret_cast<const float*>(w.codes) + n * K + b * kBlock;
    const int valid = int(std::min<int64_t>(kBlock, K - b * kBlock));
    w0 = vload(p, valid);
    w1 = vload(p + 16, valid - 16);
  } else if constexpr (F == kBF16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(w.codes) + n * K + b * kBlock;
    const int valid = int(std::min<int64_t>(kBlock, K - b * kBlock));
    auto half = [](const uint16_t* q, int v) {
      __m256i h = v >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))
                          : _mm256_maskz_loadu_epi16(__mmask16((1u << std::max(v, 0)) - 1), q);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bf16 -> f32, exact
    };
    w0 = half(p, valid);
    w1 = half(p + 16, valid - 16);
  } else if constexpr (F == kNVFP4) {
    const RowBytes r = row_bytes<F>(w, n);
    if (b * kBlock + 16 < K) return decode_block<F>(r, b, w0, w1);
    // a half block (K % 32 == 16): its first 16 weights (8 code bytes, one scale), zero after; nothing past the row
    w0 = nvfp4_half(r.codes + b * 16, r.scale[b * 2]);
    w1 = vzero();
  } else {
    static_assert(!kWholeBlocksOnly<F>, "GGML weights run through decode_block with their float32 scales");
  }
}
