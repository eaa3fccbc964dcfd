// dflash-jax CPU kernel: one block of attention's partial softmax with every row's sums in one fixed order.
// Included by cpu_matmul.cc inside its anonymous namespace, after the FFI headers and `Workers` (its handler symbol is
// defined there).
//
// Why: XLA:CPU picks a dot's and a reduction's summation order from their shapes, so a query row attended as one of
// 1 row (a decode) or of 8 rows (a verify) comes out a few ulps apart. With float32 activations greedy decoding
// survives that unless two logits tie to the last bits; with activations rounded to Q8 blocks (cpu_q8_dot.h) an ulp
// can move the next layer's input by a whole rounding step and a different token follows. Here every sum of a row
// (its scores over the head dimension, its softmax weights and weighted values over the keys it sees, in key order)
// depends on that row's query and visible keys alone, so a decode and a verify of one token give the same bits.
// Every CPU generation loop runs it (float32 and Q8 activations alike): on SmolLM2 it is also 3x cheaper in a step
// than XLA's key blocks, which copied each layer's cache slice head-major before their two products. (Its form of
// 2026-12-07, 16-lane FMA chains and 64-key chunks, took 0.80-0.87 of the time of the 8-lane one-pass form at SmolLM2's
// shapes: docs/cpu-step.md.)
//
// Vectors are GCC/Clang vector extensions of 16 floats (any ISA: the compiler maps them to one AVX-512 register, two
// AVX2 ones, or four NEON / SSE ones), with no FMA contraction (the build passes -ffp-contract=off): each operation
// rounds on its own, and the FMAs are explicit (`f16_fma`: one rounding in every build, the portable one by std::fma),
// so every build gives the same bits. exp is our own (Cody-Waite reduction and a degree-6 polynomial: within 1 ulp of
// the exact value over [-87, 0], measured), evaluated the same way for every row.

typedef float F16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));

inline F16 f16_load(const float* p) { F16 v; std::memcpy(&v, p, sizeof v); return v; }
template <bool HALF>
inline F16 f16_load_slice(const float* p) {  // 16 floats, or 8 and zeros (the last slice of hd % 16 == 8)
  if constexpr (HALF) {
    F16 v = {};
    std::memcpy(&v, p, 32);
    return v;
  } else {
    return f16_load(p);
  }
}
inline void f16_store(float* p, F16 v) { std::memcpy(p, &v, sizeof v); }
inline F16 f16_splat(float x) { return F16{} + x; }
inline F16 f16_fma(F16 a, F16 b, F16 c) {  // a * b + c, rounded once
#if defined(__AVX512F__)
  return F16(_mm512_fmadd_ps(__m512(a), __m512(b), __m512(c)));
#elif defined(__FMA__) && defined(__AVX__)
  __m256 a2[2], b2[2], c2[2];
  std::memcpy(a2, &a, 64);
  std::memcpy(b2, &b, 64);
  std::memcpy(c2, &c, 64);
  c2[0] = _mm256_fmadd_ps(a2[0], b2[0], c2[0]);
  c2[1] = _mm256_fmadd_ps(a2[1], b2[1], c2[1]);
  F16 r;
  std::memcpy(&r, c2, 64);
  return r;
#else
  F16 r;
  for (int i = 0; i < 16; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}
inline float f16_sum(F16 v) {  // lanes (i, i + 8), then (i, i + 4), (i, i + 2), (i, i + 1): `sums16`'s tree
  float a[8];
  for (int i = 0; i < 8; ++i) a[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) a[i] = a[i] + a[i + 4];
  for (int i = 0; i < 2; ++i) a[i] = a[i] + a[i + 2];
  return a[0] + a[1];
}
inline F16 f16_max(F16 a, F16 b) { return a > b ? a : b; }

// The 16 lane sums of 16 vectors at once, lane j of the result the sum of vector bitrev4(j) (so a caller that puts
// key bitrev4(m) in vector m gets key j's sum in lane j), each by f16_sum's tree: lanes (i, i + 8) added first, then
// (i, i + 4), (i, i + 2), (i, i + 1). Two vectors' halves are interleaved at each level, so the 16 sums take 15
// vector adds and 30 two-source shuffles instead of 16 horizontal reductions.
inline F16 sums16(const F16* a) {
  F16 b[8], c[4], d[2];
  for (int m = 0; m < 8; ++m)
    b[m] = __builtin_shufflevector(a[2 * m], a[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * m], a[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int m = 0; m < 4; ++m)
    c[m] = __builtin_shufflevector(b[2 * m], b[2 * m + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * m], b[2 * m + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int m = 0; m < 2; ++m)
    d[m] = __builtin_shufflevector(c[2 * m], c[2 * m + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(c[2 * m], c[2 * m + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// exp(x) for x <= 0 (scores minus their maximum); x below -87.3 gives 0.
inline F16 f16_exp(F16 x) {
  const F16 lo = f16_splat(-87.3f);
  const I16 tiny = x < lo;
  x = tiny ? lo : x;
  const F16 t = x * f16_splat(1.44269504088896341f) + f16_splat(0.5f);
  I16 n = __builtin_convertvector(t, I16);  // truncates toward zero: floor for t >= 0, fixed below for t < 0
  const F16 nf0 = __builtin_convertvector(n, F16);
  n = n + (nf0 > t);  // a lane whose truncation rounded up (t < 0, not integral) steps down by one (true = -1)
  const F16 nf = __builtin_convertvector(n, F16);
  const F16 r = (x - nf * f16_splat(0.693359375f)) - nf * f16_splat(-2.12194440e-4f);
  F16 p = f16_splat(1.9875691500e-4f);
  p = p * r + f16_splat(1.3981999507e-3f);
  p = p * r + f16_splat(8.3334519073e-3f);
  p = p * r + f16_splat(4.1665795894e-2f);
  p = p * r + f16_splat(1.6666665459e-1f);
  p = p * r + f16_splat(5.0000001201e-1f);
  const F16 y = (p * (r * r) + r) + f16_splat(1.f);
  const I16 bits = (n + 127) << 23;
  F16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const F16 out = y * scale;
  return tiny ? f16_splat(0.f) : out;
}

// Attention of every (row b, kv head h, group member g, query t) over two key sources in one call, as
// models/attention.py's `attention` computes it: the cached keys (slot order), then this call's fresh keys (their
// order: a draft tree's nodes come parent before child, so a path's keys are in position order as a decode's are).
// l = sum of exp(score - max) over the visible keys, o = the exp-weighted sum of their values (the caller divides);
// a query that sees no key gets l = 0, o = 0. A row's keys are taken in chunks of its own visible sequence and the
// chunks merged in order (`attention_rows`), so the row's sums are the same whether its keys sit in the cache (a
// decode, a chain's verify) or partly among the fresh keys (a draft tree's verify).
// q [B, T, nKV, G, hd]; ck / cv [B, nKV, S, hd] (head-major, as the caches hold them: a head's keys are one stream)
// with vis_c [B, T, S]; fk / fv [B, Tk, nKV, hd] (as the projections make them) with vis_f [B, T, Tk] (0 / 1);
// l [B, nKV, G, T], o [B, nKV, G, T, hd]. hd a multiple of 8, at most 128.
struct KeySource {
  const float* k;
  const float* v;
  const uint8_t* vis;
  int64_t n;                 // keys per row
  int64_t batch, key, head;  // floats between rows b, keys c, heads h
  const float* at(const float* base, int64_t b, int64_t c, int64_t h) const {
    return base + b * batch + c * key + h * head;
  }
};

// Keys and values are read in chunks of at most kKeyChunk (a unit of work, below); the first row of a unit fetches
// them from memory, requesting the next 16 keys' lines ahead and each group's values while it scores the group.
constexpr int64_t kKeyChunk = 64;

inline void prefetch_row(const float* p, int64_t hd) {
  for (int64_t i = 0; i < hd; i += 16) __builtin_prefetch(p + i);
}

// One query row over `count` <= kKeyChunk visible keys (in order): m = their maximum score, l = the sum of
// exp(score - m), o = the exp-weighted sum of the values (no keys: -inf, 0 and 0). NS = ceil(hd / 16) slices of the
// head dimension, the last one half used when HALF (hd % 16 == 8: its other lanes zero in q, so they add nothing).
// A key's score: q . k as one FMA chain over the slices (the first a product), then its 16 lanes by `sums16`'s tree,
// times scale: the same operations for a key wherever it falls in a group. The weighted values: two chains per slice,
// keys 0, 2, 4, ... in one and 1, 3, 5, ... in the other (two FMA chains in flight instead of one), added at the end;
// l likewise over lanes, then f16_sum. s and p: scratch of kKeyChunk + 16 floats.
template <int NS, bool HALF>
void attend_row(const float* qr, const float* const* keys, const float* const* vals, int64_t count, float scale,
                bool fetch, float* s, float* p, float* m_out, float* l, float* o) {
  constexpr int hd = 16 * NS - (HALF ? 8 : 0);
  auto slice = [](const float* row, int j) {
    return j + 1 < NS ? f16_load(row + 16 * j) : f16_load_slice<HALF>(row + 16 * j);
  };
  F16 q[NS];
  for (int j = 0; j < NS; ++j) q[j] = slice(qr, j);
  for (int64_t k0 = 0; k0 < count; k0 += 16) {
    const int64_t n = std::min<int64_t>(16, count - k0);
    if (fetch) {  // the next group's keys, and this group's values (read after the scores)
      for (int64_t k = k0 + 16; k < std::min(count, k0 + 32); ++k) prefetch_row(keys[k], hd);
      for (int64_t k = k0; k < k0 + n; ++k) prefetch_row(vals[k], hd);
    }
    F16 a[16];
    for (int m = 0; m < 16; ++m) {
      const int key = ((m & 1) << 3) | ((m & 2) << 1) | ((m & 4) >> 1) | ((m & 8) >> 3);  // bitrev4(m)
      const float* kp = keys[k0 + std::min<int64_t>(key, n - 1)];  // past the last key: a copy, discarded
      F16 acc = q[0] * slice(kp, 0);
      for (int j = 1; j < NS; ++j) acc = f16_fma(q[j], slice(kp, j), acc);
      a[m] = acc;
    }
    f16_store(s + k0, sums16(a) * f16_splat(scale));
  }
  const int64_t padded = (count + 15) / 16 * 16;
  for (int64_t i = count; i < padded; ++i) s[i] = -INFINITY;
  F16 mv = f16_splat(-INFINITY);  // the maximum score (a maximum is exact in any order)
  for (int64_t i = 0; i < padded; i += 16) mv = f16_max(mv, f16_load(s + i));
  float m = -INFINITY;
  for (int j = 0; j < 16; ++j) m = std::max(m, mv[j]);
  F16 lsum = f16_splat(0.f);
  for (int64_t i = 0; i < padded; i += 16) {
    const F16 e = f16_exp(f16_load(s + i) - f16_splat(m));
    f16_store(p + i, e);
    lsum = lsum + e;  // lanes past `count` add exp(-inf) = 0
  }
  F16 even[NS], odd[NS];
  for (int j = 0; j < NS; ++j) even[j] = odd[j] = f16_splat(0.f);
  int64_t i = 0;
  for (; i + 2 <= count; i += 2) {
    const F16 w0 = f16_splat(p[i]), w1 = f16_splat(p[i + 1]);
    for (int j = 0; j < NS; ++j) {
      even[j] = f16_fma(w0, slice(vals[i], j), even[j]);
      odd[j] = f16_fma(w1, slice(vals[i + 1], j), odd[j]);
    }
  }
  if (i < count) {
    const F16 w0 = f16_splat(p[i]);
    for (int j = 0; j < NS; ++j) even[j] = f16_fma(w0, slice(vals[i], j), even[j]);
  }
  *m_out = count > 0 ? m : -INFINITY;
  *l = f16_sum(lsum);
  float out[16 * NS];
  for (int j = 0; j < NS; ++j) f16_store(out + 16 * j, even[j] + odd[j]);
  std::memcpy(o, out, sizeof(float) * size_t(hd));
}

using AttendRow = void (*)(const float*, const float* const*, const float* const*, int64_t, float, bool, float*,
                           float*, float*, float*, float*);

// hd = 8 * (H + 1) for H = 0 .. 15: ceil(hd / 16) slices, the last a half one when hd / 8 is odd
template <int... H>
AttendRow attend_row_for(int64_t hd, std::integer_sequence<int, H...>) {
  AttendRow found = nullptr;
  ((found = (hd == 8 * (H + 1)) ? &attend_row<(H + 2) / 2, H % 2 == 0> : found), ...);
  return found;
}

// A row's visible keys are cut into chunks of kKeyChunk by their index in the row's visible sequence (cached keys in
// slot order, then fresh keys in their order), and a unit of work is one (b, kv head h, chunk j): every query row of
// that position range and head (its T positions x G group members) over the chunk's keys, one row after the other,
// so the chunk's keys and values (32 KB at hd 64) are fetched from memory once and re-read from L1 by the other
// rows. Each row's chunk gives (m_j, l_j, o_j) relative to its own maximum; the caller then merges a row's chunks in
// chunk order (M = max m_j; l = sum l_j exp(m_j - M), o likewise). Why chunks: with one unit per (b, h, t) a decode
// had 3 units (SmolLM2's kv heads) for 2 threads, each re-reading its head's whole cache from memory per position t,
// so attention was ~35% of a decode step and ~43% of a verify of 4 at 1,024 tokens of context (docs/cpu-step.md).
// Exactness is unchanged: a chunk holds the same keys, in the same order, whether they sit in the cache (a decode, a
// chain's verify) or partly among the fresh keys (a draft tree's nodes), because chunks are cut in the row's own
// visible sequence; a row with one chunk gets l_0 and o_0 times exp(0) = 1, exactly the one-pass values.

void attention_rows(const float* q, const KeySource (&src)[2], float scale, int64_t B, int64_t T, int64_t nKV,
                    int64_t G, int64_t hd, float* l_out, float* o_out) {
  const AttendRow attend = attend_row_for(hd, std::make_integer_sequence<int, 16>());
  // Each (b, t)'s visible keys as indices: c for cached key c, S + c for fresh key c (the same for every head).
  const int64_t S = src[0].n, width = S + src[1].n;
  thread_local std::vector<int32_t> visible;
  thread_local std::vector<int64_t> count;
  visible.resize(size_t(B * T * width));
  count.resize(size_t(B * T));
  int64_t most = 0;
  for (int64_t bt = 0; bt < B * T; ++bt) {
    int32_t* out = visible.data() + bt * width;
    int64_t n = 0;
    for (int s = 0; s < 2; ++s) {
      const uint8_t* vr = src[s].vis + bt * src[s].n;
      const int32_t base = s ? int32_t(S) : 0;
      for (int64_t c = 0; c < src[s].n; ++c) {  // branch-free: write every index, keep the visible ones
        out[n] = base + int32_t(c);
        n += vr[c] != 0;
      }
    }
    count[size_t(bt)] = n;
    most = std::max(most, n);
  }
  const int64_t chunks = std::max<int64_t>(1, (most + kKeyChunk - 1) / kKeyChunk);
  const int64_t rows = B * nKV * G * T, stride = hd + 2;  // a row's chunk partial: m, l, o[hd]
  thread_local std::vector<float> part;
  part.resize(size_t(rows * chunks * stride));
  // the calling thread's buffers, by pointer: inside the workers' lambda a thread_local name is the worker's own
  const int32_t* const vis_idx = visible.data();
  const int64_t* const counts = count.data();
  float* const parts = part.data();
  Workers::get().run(B * nKV * chunks, [&](int64_t unit) {
    const int64_t b = unit / (nKV * chunks), h = (unit / chunks) % nKV, j = unit % chunks;
    thread_local std::vector<float> s, p;
    thread_local std::vector<const float*> keys, vals;
    s.resize(size_t(kKeyChunk + 16));
    p.resize(size_t(kKeyChunk + 16));
    keys.resize(size_t(kKeyChunk));
    vals.resize(size_t(kKeyChunk));
    for (int64_t t = 0; t < T; ++t) {
      const int64_t bt = b * T + t, lo = j * kKeyChunk, n = std::min(counts[bt] - lo, kKeyChunk);
      const int32_t* idx = vis_idx + bt * width + lo;
      for (int64_t i = 0; i < n; ++i) {
        const int s_ = idx[i] >= S, c = s_ ? idx[i] - int32_t(S) : idx[i];
        keys[size_t(i)] = src[s_].at(src[s_].k, b, c, h);
        vals[size_t(i)] = src[s_].at(src[s_].v, b, c, h);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* out = parts + ((((b * nKV + h) * G + g) * T + t) * chunks + j) * stride;
        if (n <= 0) {  // the row has no key in this chunk
          out[0] = -INFINITY;
          continue;
        }
        // the unit's first row fetches the chunk from memory (and requests it ahead); the others find it in L1
        attend(q + (((b * T + t) * nKV + h) * G + g) * hd, keys.data(), vals.data(), n, scale, t == 0 && g == 0,
               s.data(), p.data(), out, out + 1, out + 2);
      }
    }
  });
  // Each row's chunks merged in chunk order (a row without keys: l = 0, o = 0).
  for (int64_t row = 0; row < rows; ++row) {
    const float* pr = part.data() + row * chunks * stride;
    float M = -INFINITY;
    for (int64_t j = 0; j < chunks; ++j) M = std::max(M, pr[j * stride]);
    float* o = o_out + row * hd;
    bool first = true;
    float l = 0.f;
    for (int64_t j = 0; j < chunks; ++j) {
      const float* c = pr + j * stride;
      if (c[0] == -INFINITY) continue;
      const float w = f16_exp(f16_splat(c[0] - M))[0];
      for (int64_t d = 0; d < hd; ++d) o[d] = first ? c[2 + d] * w : o[d] + c[2 + d] * w;
      l = first ? c[1] * w : l + c[1] * w;
      first = false;
    }
    if (first) {
      std::fill(o, o + hd, 0.f);
      l = 0.f;
    }
    l_out[row] = l;
  }
}

// The FFI handler (its symbol, DflashRowAttention, is defined in cpu_matmul.cc): shapes checked, then one call.
ffi::Error RowAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> ck, ffi::Buffer<ffi::F32> cv,
                            ffi::Buffer<ffi::U8> vis_c, ffi::Buffer<ffi::F32> fk, ffi::Buffer<ffi::F32> fv,
                            ffi::Buffer<ffi::U8> vis_f, ffi::Result<ffi::Buffer<ffi::F32>> l,
                            ffi::Result<ffi::Buffer<ffi::F32>> o, float scale) {
  const auto qd = q.dimensions(), cd = ck.dimensions(), fd = fk.dimensions();
  if (qd.size() != 5 || cd.size() != 4 || fd.size() != 4)
    return ffi::Error::InvalidArgument("q [B, T, nKV, G, hd], cached keys and values [B, nKV, S, hd], fresh ones "
                                       "[B, Tk, nKV, hd]");
  const int64_t B = qd[0], T = qd[1], nKV = qd[2], G = qd[3], hd = qd[4], S = cd[2], Tk = fd[1];
  if (cd[0] != B || cd[1] != nKV || cd[3] != hd || fd[0] != B || fd[2] != nKV || fd[3] != hd)
    return ffi::Error::InvalidArgument("keys do not match q");
  if (hd % 8 || hd > 128) return ffi::Error::InvalidArgument("hd is not a multiple of 8 up to 128");
  const KeySource src[2] = {
      {ck.typed_data(), cv.typed_data(), vis_c.typed_data(), S, nKV * S * hd, hd, S * hd},
      {fk.typed_data(), fv.typed_data(), vis_f.typed_data(), Tk, Tk * nKV * hd, nKV * hd, hd}};
  attention_rows(q.typed_data(), src, scale, B, T, nKV, G, hd, l->typed_data(), o->typed_data());
  return ffi::Error::Success();
}
