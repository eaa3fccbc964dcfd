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
// than XLA's key blocks, which copied each layer's cache slice head-major before their two products.
//
// Vectors are GCC/Clang vector extensions of 8 floats (any ISA: the compiler maps them to AVX2, NEON or pairs of SSE
// registers), with no FMA contraction (the build passes -ffp-contract=off): each operation rounds on its own, the same
// in every build. exp is our own (Cody-Waite reduction and a degree-6 polynomial: within 1 ulp of the exact value over
// [-87, 0], measured), evaluated the same way for every row.

typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));

inline F8 f8_load(const float* p) { F8 v; std::memcpy(&v, p, sizeof v); return v; }
inline void f8_store(float* p, F8 v) { std::memcpy(p, &v, sizeof v); }
inline F8 f8_splat(float x) { return F8{x, x, x, x, x, x, x, x}; }
inline float f8_sum(F8 v) {  // (l + l+4), then (+2), then (+1)
  const float a0 = v[0] + v[4], a1 = v[1] + v[5], a2 = v[2] + v[6], a3 = v[3] + v[7];
  return (a0 + a2) + (a1 + a3);
}

// exp(x) for x <= 0 (scores minus their maximum); x below -87.3 gives 0.
inline F8 f8_exp(F8 x) {
  const F8 lo = f8_splat(-87.3f);
  const I8 tiny = x < lo;
  x = tiny ? lo : x;
  const F8 t = x * f8_splat(1.44269504088896341f) + f8_splat(0.5f);
  I8 n = __builtin_convertvector(t, I8);  // truncates toward zero: floor for t >= 0, fixed below for t < 0
  const F8 nf0 = __builtin_convertvector(n, F8);
  n = n + (nf0 > t);  // a lane whose truncation rounded up (t < 0, not integral) steps down by one (true = -1)
  const F8 nf = __builtin_convertvector(n, F8);
  const F8 r = (x - nf * f8_splat(0.693359375f)) - nf * f8_splat(-2.12194440e-4f);
  F8 p = f8_splat(1.9875691500e-4f);
  p = p * r + f8_splat(1.3981999507e-3f);
  p = p * r + f8_splat(8.3334519073e-3f);
  p = p * r + f8_splat(4.1665795894e-2f);
  p = p * r + f8_splat(1.6666665459e-1f);
  p = p * r + f8_splat(5.0000001201e-1f);
  const F8 y = (p * (r * r) + r) + f8_splat(1.f);
  const I8 bits = (n + 127) << 23;
  F8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const F8 out = y * scale;
  return tiny ? f8_splat(0.f) : out;
}

// Attention of every (row b, kv head h, group member g, query t) over two key sources in one pass, as
// models/attention.py's `attention` computes it: the cached keys (slot order), then this call's fresh keys (their
// order: a draft tree's nodes come parent before child, so a path's keys are in position order as a decode's are).
// l = sum of exp(score - max) over the visible keys, o = the exp-weighted sum of their values (the caller divides);
// a query that sees no key gets l = 0, o = 0. One pass over all of a row's keys (no key blocks, no merges of
// partial softmaxes), so the row's sums are the same whether its keys sit in the cache (a decode, a chain's verify)
// or partly among the fresh keys (a draft tree's verify).
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

// The scores of N keys for one query row: each key's chain is the products of 8-lane slices added in order, then
// f8_sum, times scale; N > 1 only interleaves N independent chains (the same operations per key).
// NV = hd / 8 is a template argument so that the slices' loops unroll and the row's accumulators stay in registers.
template <int N, int NV>
inline void key_scores(const float* qr, const float* const* keys, float scale, float* s) {
  F8 a[N];
  F8 q8 = f8_load(qr);
  for (int k = 0; k < N; ++k) a[k] = q8 * f8_load(keys[k]);
  for (int j = 1; j < NV; ++j) {
    q8 = f8_load(qr + 8 * j);
    for (int k = 0; k < N; ++k) a[k] = a[k] + q8 * f8_load(keys[k] + 8 * j);
  }
  for (int k = 0; k < N; ++k) s[k] = f8_sum(a[k]) * scale;
}

// Keys ahead of the one being read that are prefetched (a row's visible keys: a head's stream in the cache, with
// slots the row does not see skipped, then the fresh keys, strided by the other heads').
constexpr int64_t kPrefetchKeys = 16;

inline void prefetch_row(const float* p, int64_t hd) {
  for (int64_t i = 0; i < hd; i += 16) __builtin_prefetch(p + i);
}

// One query row over its `count` visible keys (in order): l = the sum of exp(score - max), o = the exp-weighted sum
// of the values (a row without keys gets 0 and 0). s and p: scratch of count + 8 floats.
template <int NV>
void attend_row(const float* qr, const float* const* keys, const float* const* vals, int64_t count, float scale,
                float* s, float* p, float* l, float* o) {
  constexpr int64_t hd = 8 * NV;
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    for (int64_t k = i + kPrefetchKeys; k < std::min(count, i + kPrefetchKeys + 4); ++k) prefetch_row(keys[k], hd);
    key_scores<4, NV>(qr, keys + i, scale, s + i);
  }
  for (; i < count; ++i) key_scores<1, NV>(qr, keys + i, scale, s + i);
  F8 mv = f8_splat(-INFINITY);  // the row's maximum score (a maximum is exact in any order)
  int64_t c = 0;
  for (; c + 8 <= count; c += 8) {
    const F8 v = f8_load(s + c);
    mv = v > mv ? v : mv;
  }
  float m = -INFINITY;
  for (int j = 0; j < 8; ++j) m = std::max(m, mv[j]);
  for (; c < count; ++c) m = std::max(m, s[c]);
  F8 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = f8_splat(0.f);
  F8 lsum = f8_splat(0.f);
  if (count > 0) {
    for (int64_t i = count; i < ((count + 7) / 8) * 8; ++i) s[i] = -INFINITY;
    for (int64_t i = 0; i < count; i += 8) {
      const F8 e = f8_exp(f8_load(s + i) - f8_splat(m));
      f8_store(p + i, e);
      lsum = lsum + e;  // lanes past `count` add exp(-inf) = 0
    }
    for (int64_t i = 0; i < count; ++i) {
      if (i + kPrefetchKeys < count) prefetch_row(vals[i + kPrefetchKeys], hd);
      const F8 w = f8_splat(p[i]);
      for (int j = 0; j < NV; ++j) acc[j] = acc[j] + w * f8_load(vals[i] + 8 * j);
    }
  }
  *l = f8_sum(lsum);
  for (int j = 0; j < NV; ++j) f8_store(o + 8 * j, acc[j]);
}

using AttendRow = void (*)(const float*, const float* const*, const float* const*, int64_t, float, float*, float*,
                           float*, float*);

template <int... NV>
AttendRow attend_row_for(int64_t nv, std::integer_sequence<int, NV...>) {
  AttendRow found = nullptr;
  ((found = (nv == NV + 1) ? &attend_row<NV + 1> : found), ...);
  return found;
}

// A unit of work is one (b, h, t): the G query rows of one position and kv head, one after the other on one thread
// (`Workers`, cpu_matmul.cc), so they share the list of visible keys and the later rows read the keys and values
// from the core's cache (one unit per row fetched them from memory once per row). A row's sums depend on its query
// and visible keys alone, whichever unit or thread computes it.
void attention_rows(const float* q, const KeySource (&src)[2], float scale, int64_t B, int64_t T, int64_t nKV,
                    int64_t G, int64_t hd, float* l_out, float* o_out) {
  const int64_t total = src[0].n + src[1].n;
  const AttendRow attend = attend_row_for(hd / 8, std::make_integer_sequence<int, 16>());
  Workers::get().run(B * nKV * T, [&](int64_t unit) {
    const int64_t b = unit / (nKV * T), h = (unit / T) % nKV, t = unit % T;
    thread_local std::vector<float> s, p;
    thread_local std::vector<const float*> keys, vals;
    s.resize(size_t(total + 8));
    p.resize(size_t(total + 8));
    keys.resize(size_t(total + 8));
    vals.resize(size_t(total + 8));
    int64_t count = 0;  // the position's visible keys, in order
    for (const KeySource& ks : src) {
      const uint8_t* vr = ks.vis + (b * T + t) * ks.n;
      for (int64_t c = 0; c < ks.n; ++c) {
        if (!vr[c]) continue;
        keys[size_t(count)] = ks.at(ks.k, b, c, h);
        vals[size_t(count)] = ks.at(ks.v, b, c, h);
        ++count;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const int64_t row = ((b * nKV + h) * G + g) * T + t;
      attend(q + (((b * T + t) * nKV + h) * G + g) * hd, keys.data(), vals.data(), count, scale, s.data(), p.data(),
             l_out + row, o_out + row * hd);
    }
  });
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
