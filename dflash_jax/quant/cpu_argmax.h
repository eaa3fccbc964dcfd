// dflash-jax CPU kernel: the first maximum of each row of logits (greedy decoding's token), as jnp.argmax finds it.
// Included by cpu_matmul.cc inside its anonymous namespace, after the FFI headers and `Workers` (its handler symbol is
// defined there).
//
// Why: XLA:CPU runs `models.layers.first_argmax` (a max, then the first index equal to it) as two passes over a
// 49,152-wide row, ~70 us a decode step and ~150 us for a 3-row verify on a Zen 5 (`bench.loop_profile`): ~2% of a
// step, where one pass over the row's 196 KB costs a few microseconds. No value is rounded, so the index is the same
// as XLA's: the first maximum, or the first NaN where a row holds one (as jnp.argmax); -0 and +0 are equal.
//
// Vectors are GCC/Clang vector extensions of 16 lanes (any ISA: one AVX-512 register, two AVX2 ones, four NEON ones).

typedef float F16v __attribute__((vector_size(64)));
typedef int32_t I16v __attribute__((vector_size(64)));

// The first index of the maximum of x[0, n) (of the first NaN if there is one); 0 for n == 0.
inline int32_t first_argmax_row(const float* x, int64_t n) {
  if (n == 0) return 0;
  int64_t i = 0;
  int32_t best_at = 0;
  if (n >= 16) {
    // lane l keeps the first maximum among elements l, l + 16, ...: `>` keeps the earlier one of equal values
    F16v best;
    std::memcpy(&best, x, sizeof best);
    I16v at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, idx = at;
    I16v nan = best != best;
    for (i = 16; i + 16 <= n; i += 16) {
      F16v v;
      std::memcpy(&v, x + i, sizeof v);
      idx += 16;
      nan |= v != v;
      const I16v gt = v > best;
      best = gt ? v : best;
      at = gt ? idx : at;
    }
    bool any_nan = false;
    for (int l = 0; l < 16; ++l) any_nan |= nan[l] != 0;
    if (any_nan) {
      for (int64_t j = 0;; ++j) if (x[j] != x[j]) return int32_t(j);
    }
    // across lanes: the maximum, then the smallest index holding it (the lanes' indices interleave)
    float m = best[0];
    for (int l = 1; l < 16; ++l) m = best[l] > m ? best[l] : m;
    best_at = INT32_MAX;
    for (int l = 0; l < 16; ++l) if (best[l] == m && at[l] < best_at) best_at = at[l];
  }
  float m = x[best_at];
  for (; i < n; ++i) {  // the rest (or a row shorter than a vector), in order
    if (x[i] != x[i]) return int32_t(i);
    if (x[i] > m) {
      m = x[i];
      best_at = int32_t(i);
    }
  }
  return best_at;
}

// The FFI handler (its symbol, DflashFirstArgmax, is defined in cpu_matmul.cc): x [..., N] -> int32 [...].
ffi::Error FirstArgmaxImpl(ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  const auto dims = x.dimensions();
  if (dims.size() == 0) return ffi::Error::InvalidArgument("x has no last axis");
  const int64_t n = dims.back(), rows = n ? x.element_count() / n : 0;
  if (out->element_count() != rows) return ffi::Error::InvalidArgument("one index per row of x");
  const float* xp = x.typed_data();
  int32_t* op = out->typed_data();
  Workers::get().run(rows, [&](int64_t r) { op[r] = first_argmax_row(xp + r * n, n); });
  return ffi::Error::Success();
}
