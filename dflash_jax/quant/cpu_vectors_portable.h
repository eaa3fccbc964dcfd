// dflash-jax CPU matmul kernel: the portable C++ build (ARM, older x86).
// The same chains (16 lanes, block order, one fixed reduction), left to the compiler.
// Included by cpu_matmul.cc inside its anonymous namespace, after Weight, the E4M3 / E2M1 tables, half_to_float and
// kBlock, RowBytes; defines Vec (16 float lanes), vzero / vfma / vadd / vsum / vload, decode_half<F, H> and
// decode_half_block<F, H> (whole blocks from a row's own pointers; cpu_matmul.cc makes decode / decode_block of them).


struct Vec { float v[16]; };
inline Vec vzero() { Vec r; for (float& f : r.v) f = 0.f; return r; }
inline Vec vfma(const Vec& a, const Vec& b, Vec c) { for (int l = 0; l < 16; ++l) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]); return c; }
inline float vsum(const Vec& a) {
  float t[16];
  std::memcpy(t, a.v, sizeof t);
  for (int w = 8; w >= 1; w /= 2) for (int l = 0; l < w; ++l) t[l] += t[l + w];
  return t[0];
}
inline Vec vload(const float* p, int valid) { Vec r; for (int l = 0; l < 16; ++l) r.v[l] = l < valid ? p[l] : 0.f; return r; }
inline void vstore(float* p, const Vec& v) { for (int l = 0; l < 16; ++l) p[l] = v.v[l]; }
inline Vec vadd(const Vec& a, const Vec& b) { Vec r; for (int l = 0; l < 16; ++l) r.v[l] = a.v[l] + b.v[l]; return r; }

// Half H (0: elements 0..15, 1: elements 16..31) of block b of one row (`RowBytes`: its own pointers), its first
// `valid` weights (16 for a whole half), zero after. The block's scales are read once, then one loop per format that
// the compiler can vectorize (NEON on ARM).
template <Format F, int H>
inline Vec decode_half_at(const RowBytes& row, int64_t b, int valid) {
  Vec r = vzero();
  valid = std::min(valid, 16);
  if (valid <= 0) return r;
  if constexpr (F == kF32) {
    const float* p = reinterpret_cast<const float*>(row.codes) + b * kBlock + 16 * H;
    for (int l = 0; l < valid; ++l) r.v[l] = p[l];
  } else if constexpr (F == kBF16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(row.codes) + b * kBlock + 16 * H;
    for (int l = 0; l < valid; ++l) {
      const uint32_t bits = uint32_t(p[l]) << 16;
      std::memcpy(&r.v[l], &bits, 4);
    }
  } else if constexpr (F == kQ4_1) {  // byte j: code j (low nibble) and code j + 16 (high nibble)
    const uint8_t* p = row.codes + b * 16;
    const float d = row.d[b], m = row.m[b];
    for (int l = 0; l < 16; ++l) r.v[l] = std::fma(float(H ? p[l] >> 4 : p[l] & 15), d, m);
  } else if constexpr (F == kQ8_0) {
    const int8_t* p = reinterpret_cast<const int8_t*>(row.codes) + b * kBlock + 16 * H;
    const float d = row.d[b];
    for (int l = 0; l < 16; ++l) r.v[l] = d * float(p[l]);
  } else {  // NVFP4: element 2i in the low nibble; one e4m3 scale per 16
    const uint8_t* p = row.codes + b * 16 + 8 * H;
    const float scale = E4M3[row.scale[b * 2 + H]];
    for (int l = 0; l < 16; ++l) r.v[l] = E2M1[(l % 2) ? (p[l / 2] >> 4) : (p[l / 2] & 15)] * scale;
  }
  return r;
}

// Half H of block b of row n; zero past K.
template <Format F, int H>
inline Vec decode_half(const Weight& w, int64_t n, int64_t b) {
  static_assert(!kWholeBlocksOnly<F>, "GGML weights run through decode_half_block with their float32 scales");
  return decode_half_at<F, H>(row_bytes<F>(w, n), b, int(std::min<int64_t>(kBlock, w.K - b * kBlock)) - 16 * H);
}

// Half H of whole block b of one row (the loops' whole blocks before a ragged end).
template <Format F, int H>
inline Vec decode_half_block(const RowBytes& r, int64_t b) { return decode_half_at<F, H>(r, b, 16); }

// n float16 values as float32 (exact): a group of GGML block scales (`GroupScales`).
inline void halves_to_floats(const uint16_t* h, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = half_to_float(h[i]);
}
