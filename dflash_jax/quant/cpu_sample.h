// dflash-jax CPU kernel: the token each row of logits draws at a temperature (no top-k / top-p), by the inverse CDF.
// Included by cpu_matmul.cc inside its anonymous namespace, after cpu_attention.h (its 16-lane vectors, f16_exp and
// f16_sum) and `Workers` (its handler symbol is defined there).
//
// Why: XLA:CPU ran a sampled decode step's draw (`decode.sampling.sample_tokens`: a softmax over SmolLM2's 49,152
// ids, then the two-level inverse CDF) in ~0.22 ms, 6% of a step (`bench.loop_profile --temperature 0.7`), where three
// passes over the row's 196 KB cost a few tens of microseconds. Where `generate` samples on this CPU it decodes
// plainly (speculation does not pay there), so every sampled token pays it.
//
// The function: e_i = exp((x_i - max x) / T) (f16_exp: within 1 ulp), summed in blocks of 16 lanes (f16_sum's tree)
// and the blocks in order; the token is the first i whose running sum reaches u x that total (u in (0, 1), one per
// row), the same rule as `_categorical`; an index whose e_i is 0 is never the first to reach it. The probabilities
// are softmax(x / T) to float rounding, so the law is the one `processed_probs` gives (tests/test_sampling.py).

// The token of one row x[0, n) at 1 / inv_t, for the uniform u; e: scratch of n + 16 floats, sums: of n / 16 + 1.
inline int32_t sample_row(const float* x, int64_t n, float inv_t, float u, float* e, float* sums) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  if (!(m > -INFINITY)) return 0;  // every logit -inf (or NaN): no distribution to draw from
  const int64_t blocks = (n + 15) / 16;
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    F16 v = f16_splat(-INFINITY);
    std::memcpy(&v, x + 16 * b, sizeof(float) * size_t(std::min<int64_t>(16, n - 16 * b)));
    const F16 p = f16_exp((v - f16_splat(m)) * f16_splat(inv_t));  // lanes past n: exp(-inf) = 0
    f16_store(e + 16 * b, p);
    sums[b] = f16_sum(p);
    total = total + sums[b];
  }
  const float target = u * total;
  float c = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    if (c + sums[b] < target && b + 1 < blocks) {
      c = c + sums[b];
      continue;
    }
    // the block that reaches the target: its elements in order (the last one with mass where rounding leaves the
    // running sum just short)
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

// The FFI handler (its symbol, DflashSampleRows, is defined in cpu_matmul.cc): x [..., N], u [...] in (0, 1),
// temperature [1] (> 0) -> int32 [...].
ffi::Error SampleRowsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> temperature,
                          ffi::Result<ffi::Buffer<ffi::S32>> out) {
  const auto dims = x.dimensions();
  if (dims.size() == 0) return ffi::Error::InvalidArgument("x has no last axis");
  const int64_t n = dims.back(), rows = n ? x.element_count() / n : 0;
  if (out->element_count() != rows || u.element_count() != rows)
    return ffi::Error::InvalidArgument("one uniform and one token per row of x");
  if (temperature.element_count() != 1) return ffi::Error::InvalidArgument("one temperature");
  const float inv_t = 1.f / temperature.typed_data()[0];
  const float* xp = x.typed_data();
  const float* up = u.typed_data();
  int32_t* op = out->typed_data();
  Workers::get().run(rows, [&](int64_t r) {
    thread_local std::vector<float> e, sums;
    e.resize(size_t(n + 16));
    sums.resize(size_t(n / 16 + 1));
    op[r] = n ? sample_row(xp + r * n, n, inv_t, up[r], e.data(), sums.data()) : 0;
  });
  return ffi::Error::Success();
}
