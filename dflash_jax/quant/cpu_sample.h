// dflash-jax CPU kernel: draws from softmax rows of logits at a temperature (no top-k / top-p), by the inverse CDF: a
// row's token, a row's log-sum-exp (rejection sampling's p at drafted ids), and the residual's token where rejection
// sampling stops. Included by cpu_matmul.cc inside its anonymous namespace, after cpu_attention.h (its 16-lane
// vectors, f16_exp and f16_sum) and `Workers` (the handler symbols are defined there).
//
// Why: XLA:CPU ran a sampled decode step's draw (`decode.sampling.sample_tokens`: a softmax over SmolLM2's 49,152
// ids, then the two-level inverse CDF) in ~0.22 ms, 6% of a step (`bench.loop_profile --temperature 0.7`), where three
// passes over the row's 196 KB cost a few tens of microseconds; a sampled speculative step's acceptance
// (`accept_block`: the verify rows' log-sum-exp, then the residual's softmax, subtraction and draw) took ~0.37 ms.
//
// The function: e_i = exp((x_i - max x) / T) (f16_exp: within 1 ulp), summed in blocks of 16 lanes (f16_sum's tree)
// and the blocks in order; the token is the first i whose running sum reaches u x that total (u in (0, 1), one per
// row), the same rule as `_categorical`; an index whose e_i is 0 is never the first to reach it. The probabilities
// are softmax(x / T) to float rounding, so the law is the one `processed_probs` gives (tests/test_sampling.py).

// The maximum of x[0, n), NaN ignored (-inf where there is none); exact in any order.
inline float row_max(const float* x, int64_t n) {
  F16 best = f16_splat(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const F16 v = f16_load(x + i);
    best = v > best ? v : best;
  }
  float m = -INFINITY;
  for (int l = 0; l < 16; ++l) m = best[l] > m ? best[l] : m;
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// Block b's 16 sums of `blocks` blocks, sums[b] = f16_sum(block(b)) (block(b): a 16-lane vector, which it may also
// store), 16 blocks at a time by `sums16` (the same tree, the same values, ~15x fewer operations than 16 horizontal
// sums); returns the sums added in block order.
template <class Block>
inline float summed_blocks(int64_t blocks, float* sums, Block block) {
  float total = 0.f;
  for (int64_t g = 0; g < blocks; g += 16) {
    F16 v[16];
    for (int m = 0; m < 16; ++m) {
      const int64_t b = g + (((m & 1) << 3) | ((m & 2) << 1) | ((m & 4) >> 1) | ((m & 8) >> 3));  // bitrev4(m)
      v[m] = b < blocks ? block(b) : f16_splat(0.f);
    }
    const F16 s = sums16(v);
    for (int64_t j = 0; j < std::min<int64_t>(16, blocks - g); ++j) {
      sums[g + j] = s[j];
      total = total + s[j];
    }
  }
  return total;
}

// Ids [16 b, 16 b + 16) of x[0, n), -inf past n.
inline F16 block_of(const float* x, int64_t n, int64_t b) {
  if (16 * b + 16 <= n) return f16_load(x + 16 * b);
  F16 v = f16_splat(-INFINITY);
  std::memcpy(&v, x + 16 * b, sizeof(float) * size_t(n - 16 * b));
  return v;
}

// e_i = exp((x_i - m) / T) for blocks of 16 ids (lanes past n: exp(-inf) = 0) into e (scratch of n + 16 floats; null:
// not kept), each block's sum into sums (n / 16 + 16 floats); returns the blocks' sums added in order.
inline float exp_blocks(const float* x, int64_t n, float m, float inv_t, float* e, float* sums) {
  const F16 vm = f16_splat(m), vt = f16_splat(inv_t);
  return summed_blocks((n + 15) / 16, sums, [&](int64_t b) {
    const F16 p = f16_exp((block_of(x, n, b) - vm) * vt);
    if (e) f16_store(e + 16 * b, p);
    return p;
  });
}

// The first index i of e[0, n) (blocks' sums in `sums`) whose running sum reaches target, with e_i > 0 (where rounding
// leaves the running sum just short, the last index with mass in the block that reaches it).
inline int32_t inverse_cdf(const float* e, const float* sums, int64_t n, float target) {
  const int64_t blocks = (n + 15) / 16;
  float c = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    if (c + sums[b] < target && b + 1 < blocks) {
      c = c + sums[b];
      continue;
    }
    int64_t last = -1;
    for (int64_t i = 16 * b; i < std::min(n, 16 * b + 16); ++i) {
      if (e[i] > 0.f) last = i;
      c = c + e[i];
      if (c >= target && e[i] > 0.f) return int32_t(i);
    }
    if (last >= 0) return int32_t(last);
  }
  for (int64_t i = n - 1; i >= 0; --i) if (e[i] > 0.f) return int32_t(i);
  return 0;
}

// The token of one row x[0, n) at 1 / inv_t, for the uniform u; e: scratch of n + 16 floats, sums: of n / 16 + 16.
// probs (may be null): softmax(x / T) itself, e_i / S, written there (zeros for a row with no distribution).
inline int32_t sample_row(const float* x, int64_t n, float inv_t, float u, float* e, float* sums,
                          float* probs = nullptr) {
  const float m = row_max(x, n);
  if (!(m > -INFINITY)) {  // every logit -inf (or NaN): no distribution to draw from
    if (probs) std::fill(probs, probs + n, 0.f);
    return 0;
  }
  const float total = exp_blocks(x, n, m, inv_t, e, sums);
  if (probs) {
    const float inv_total = 1.f / total;
    for (int64_t i = 0; i < n; ++i) probs[i] = e[i] * inv_total;
  }
  return inverse_cdf(e, sums, n, u * total);
}

// log sum_i exp(x_i / T) of one row, as max / T + log(the sum of exp_blocks): rejection sampling's p at a drafted id
// is then exp(x_id / T - this) (`decode.sampling.verify_probs`), with no row of probabilities written.
inline float row_logsumexp(const float* x, int64_t n, float inv_t, float* sums) {
  const float m = row_max(x, n);
  if (!(m > -INFINITY)) return -INFINITY;
  return m * inv_t + std::log(exp_blocks(x, n, m, inv_t, nullptr, sums));
}

// The token drawn where rejection sampling stops at a proposed slot: from r = normalize(max(p - q, 0)), p = softmax(x /
// T), q = q_on x q[0, nq) (zero past nq) plus a point mass of 1 at `point` (none where point < 0); from p itself where
// r is all zero (`decode.sampling.residual_probs`). With e_i = p_i x S (S = the sum of e), r_i x S = max(e_i - S q_i,
// 0), so nothing is divided: the inverse CDF is the same at any scale. e, r: scratch of n + 16 floats each; sums: of
// 2 (n / 16 + 16).
inline int32_t residual_row(const float* x, int64_t n, float inv_t, const float* q, int64_t nq, float q_on,
                            int32_t point, float u, float* e, float* r, float* sums) {
  const float m = row_max(x, n);
  if (!(m > -INFINITY)) return 0;
  const int64_t blocks = (n + 15) / 16;
  float* rsums = sums + blocks + 16;
  const float S = exp_blocks(x, n, m, inv_t, e, sums);
  const F16 sq = f16_splat(S * q_on);
  const float total = summed_blocks(blocks, rsums, [&](int64_t b) {
    F16 qv = {};
    if (16 * b < nq) std::memcpy(&qv, q + 16 * b, sizeof(float) * size_t(std::min<int64_t>(16, nq - 16 * b)));
    F16 d = f16_load(e + 16 * b) - sq * qv;
    d = d > 0.f ? d : f16_splat(0.f);
    if (point >= 16 * b && point < 16 * b + 16) d[point - 16 * b] = 0.f;  // p - 1 <= 0
    f16_store(r + 16 * b, d);
    return d;
  });
  if (total > 0.f) return inverse_cdf(r, rsums, n, u * total);
  return inverse_cdf(e, sums, n, u * S);
}

// The rows of x [..., N] (n = N, rows = the count of rows) and 1 / temperature [1] that the row handlers share, or
// the error that names what is wrong.
inline ffi::Error rows_and_temperature(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& temperature, int64_t& n,
                                       int64_t& rows, float& inv_t) {
  const auto dims = x.dimensions();
  if (dims.size() == 0) return ffi::Error::InvalidArgument("x has no last axis");
  n = dims.back();
  rows = n ? x.element_count() / n : 0;
  if (temperature.element_count() != 1) return ffi::Error::InvalidArgument("one temperature");
  inv_t = 1.f / temperature.typed_data()[0];
  return ffi::Error::Success();
}

// The token of every row of x [..., N] for its uniform u [...] in (0, 1) at temperature [1] (> 0), and where probs is
// given, softmax(x / T) [..., N] (`sample_row`): the handlers DflashSampleRows and DflashSoftmaxDraw.
ffi::Error DrawRows(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& u, ffi::Buffer<ffi::F32>& temperature,
                    float* probs, int64_t probs_count, ffi::Result<ffi::Buffer<ffi::S32>>& out) {
  int64_t n, rows;
  float inv_t;
  if (ffi::Error err = rows_and_temperature(x, temperature, n, rows, inv_t); err.failure()) return err;
  if (out->element_count() != rows || u.element_count() != rows || (probs && probs_count != x.element_count()))
    return ffi::Error::InvalidArgument("probs like x; one uniform and one token per row of x");
  const float* xp = x.typed_data();
  const float* up = u.typed_data();
  int32_t* op = out->typed_data();
  Workers::get().run(rows, [&](int64_t r) {
    thread_local std::vector<float> e, sums;
    e.resize(size_t(n + 16));
    sums.resize(size_t(n / 16 + 16));
    op[r] = n ? sample_row(xp + r * n, n, inv_t, up[r], e.data(), sums.data(), probs ? probs + r * n : nullptr) : 0;
  });
  return ffi::Error::Success();
}

// The FFI handler (its symbol, DflashSampleRows, is defined in cpu_matmul.cc): x [..., N], u [...] in (0, 1),
// temperature [1] (> 0) -> int32 [...].
ffi::Error SampleRowsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> temperature,
                          ffi::Result<ffi::Buffer<ffi::S32>> out) {
  return DrawRows(x, u, temperature, nullptr, 0, out);
}

// The FFI handler (DflashSoftmaxDraw): x [..., N], u [...] in (0, 1), temperature [1] -> probs float32 [..., N] =
// softmax(x / T) and int32 [...] the token drawn from it for u (as DflashSampleRows): a drafter's q at temperature T
// and the draft drawn from it, in one call.
ffi::Error SoftmaxDrawImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> temperature,
                           ffi::Result<ffi::Buffer<ffi::F32>> probs, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  return DrawRows(x, u, temperature, probs->typed_data(), probs->element_count(), out);
}

// The FFI handler (DflashRowLogsumexp): x [..., N], temperature [1] (> 0) -> float32 [...], log sum exp(x / T) per row.
ffi::Error RowLogsumexpImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> temperature,
                            ffi::Result<ffi::Buffer<ffi::F32>> out) {
  int64_t n, rows;
  float inv_t;
  if (ffi::Error err = rows_and_temperature(x, temperature, n, rows, inv_t); err.failure()) return err;
  if (out->element_count() != rows) return ffi::Error::InvalidArgument("one value per row of x");
  const float* xp = x.typed_data();
  float* op = out->typed_data();
  Workers::get().run(rows, [&](int64_t r) {
    thread_local std::vector<float> sums;
    sums.resize(size_t(n / 16 + 16));
    op[r] = n ? row_logsumexp(xp + r * n, n, inv_t, sums.data()) : -INFINITY;
  });
  return ffi::Error::Success();
}

// The FFI handler (DflashResidualRows): x [B, R, N], row [B] (which of the R rows), q [B, nq], q_on [B], point [B],
// u [B] in (0, 1), temperature [1] -> int32 [B] (`residual_row`).
ffi::Error ResidualRowsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> row, ffi::Buffer<ffi::F32> q,
                            ffi::Buffer<ffi::F32> q_on, ffi::Buffer<ffi::S32> point, ffi::Buffer<ffi::F32> u,
                            ffi::Buffer<ffi::F32> temperature, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  const auto dims = x.dimensions(), qdims = q.dimensions();
  if (dims.size() != 3 || qdims.size() != 2) return ffi::Error::InvalidArgument("x [B, R, N] and q [B, nq]");
  const int64_t B = dims[0], R = dims[1], n = dims[2], nq = qdims[1];
  if (qdims[0] != B || nq > n || row.element_count() != B || q_on.element_count() != B ||
      point.element_count() != B || u.element_count() != B || out->element_count() != B)
    return ffi::Error::InvalidArgument("q [B, nq <= N]; one row, q_on, point, uniform and token per batch row");
  if (temperature.element_count() != 1) return ffi::Error::InvalidArgument("one temperature");
  const float inv_t = 1.f / temperature.typed_data()[0];
  Workers::get().run(B, [&](int64_t b) {
    thread_local std::vector<float> e, r, sums;
    e.resize(size_t(n + 16));
    r.resize(size_t(n + 16));
    sums.resize(size_t(2 * (n / 16 + 16)));
    const int64_t at = std::min<int64_t>(std::max<int32_t>(row.typed_data()[b], 0), R - 1);
    out->typed_data()[b] = n ? residual_row(x.typed_data() + (b * R + at) * n, n, inv_t, q.typed_data() + b * nq, nq,
                                            q_on.typed_data()[b], point.typed_data()[b], u.typed_data()[b], e.data(),
                                            r.data(), sums.data()) : 0;
  });
  return ffi::Error::Success();
}

// Whether v ranks above w in lax.top_k's order: the larger value, and +0 above -0.
inline bool ranks_above(float v, float w) {
  return v > w || (v == 0.f && w == 0.f && !std::signbit(v) && std::signbit(w));
}

// The k largest of x[0, n) and their ids, largest first, equal values in id order (lax.top_k's order; a NaN ranks
// as -inf): one pass, each 16 ids tested against the k-th best so far before any is inserted.
inline void top_k_row(const float* x, int64_t n, int64_t k, float* vals, int32_t* ids) {
  int64_t count = 0;
  auto insert = [&](float v, int32_t id) {
    if (!(v == v)) v = -INFINITY;
    if (count == k && !ranks_above(v, vals[k - 1])) return;
    int64_t at = std::min(count, k - 1);
    while (at > 0 && ranks_above(v, vals[at - 1])) {  // after every value ranked >= v: equal values keep id order
      vals[at] = vals[at - 1];
      ids[at] = ids[at - 1];
      --at;
    }
    vals[at] = v;
    ids[at] = id;
    count = std::min(count + 1, k);
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (count == k) {  // >=: a superset of the ids that rank above the k-th (+0 over -0), each then tested exactly
      const I16 maybe = f16_load(x + i) >= f16_splat(vals[k - 1]);
      bool any = false;
      for (int l = 0; l < 16; ++l) any |= maybe[l] != 0;
      if (!any) continue;
    }
    for (int l = 0; l < 16; ++l) insert(x[i + l], int32_t(i + l));
  }
  for (; i < n; ++i) insert(x[i], int32_t(i));
}

// The FFI handler (DflashTopK): x [..., N] -> vals float32 [..., k], ids int32 [..., k] (k <= N).
ffi::Error TopKImpl(ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::F32>> vals,
                    ffi::Result<ffi::Buffer<ffi::S32>> ids) {
  const auto dims = x.dimensions(), kdims = vals->dimensions();
  if (dims.size() == 0 || kdims.size() != dims.size()) return ffi::Error::InvalidArgument("x [..., N], vals [..., k]");
  const int64_t n = dims.back(), k = kdims.back(), rows = n ? x.element_count() / n : 0;
  if (k < 1 || k > n || vals->element_count() != rows * k || ids->element_count() != rows * k)
    return ffi::Error::InvalidArgument("1 <= k <= N; k values and ids per row of x");
  Workers::get().run(rows, [&](int64_t r) {
    top_k_row(x.typed_data() + r * n, n, k, vals->typed_data() + r * k, ids->typed_data() + r * k);
  });
  return ffi::Error::Success();
}
