// dflash-jax CPU matmul kernel: y[M, N] = x[M, K] . W[N, K]^T for small M (decode, verify, draft), as an XLA FFI
// custom call. W is dense (float32, bfloat16) or block-quantized (GGML Q4_1 / Q8_0, NVFP4); x and y are float32.
//
// Why: XLA:CPU runs a 1-row product as a GEMV at memory speed but every product of 2+ rows through a GEMM path that
// costs ~2.2x that, and it has no fast path for 4- or 8-bit weights at all. Here each weight block is read once per
// tile of up to 8 rows and decoded in registers, so a verify of D + 1 tokens reads the weights once, and compact
// weights stream as compact bytes.
//
// Exactness: every y[m, n] is one chain over K in 32-wide blocks, in block order, accumulated in 16 lanes and summed
// by one fixed horizontal reduction. Nothing about it depends on M, on the other rows, or on which thread ran it, so
// a row's result is bit-identical in a decode (M = 1) and in a verify (M = D + 1): greedy speculative decoding stays
// equal to autoregressive decoding by construction. The decoded weights are exactly the dequantized values
// (GGML: d * q + m rounded once, as the float32 dequantization; NVFP4: e2m1(code) * e4m3(block scale), exact),
// with NVFP4's tensor scale applied to the float32 result as the portable backend does.
//
// Builds: AVX-512, AVX2 + FMA + F16C, or portable C++ (`cpu_vectors_*.h`), whichever is the best this CPU runs
// (-march=native). They compute the same chains, so every value is the same whichever CPU computed it.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#define DFLASH_X86_AVX2 1  // AVX2 + FMA + F16C, which every AVX-512 CPU has too
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// kQ4_1_Q8 / kQ8_0_Q8: the same weights with x rounded to Q8 blocks, llama.cpp's integer dot (cpu_q8_dot.h);
// kQ4_1_BF16 / kQ8_0_BF16: the same weights and x rounded to bfloat16, AVX512-BF16's dot product (cpu_bf16_dot.h)
enum Format : int64_t {
  kF32 = 0, kBF16 = 1, kQ4_1 = 2, kQ8_0 = 3, kNVFP4 = 4, kQ4_1_Q8 = 5, kQ8_0_Q8 = 6, kQ4_1_BF16 = 7, kQ8_0_BF16 = 8
};

struct Weight {
  Format format;
  const uint8_t* codes;  // F32 / BF16: the values [N, K]; Q4_1: [N, K/2]; Q8_0: int8 [N, K]; NVFP4: [N, K/2]
  const void* scale;     // Q4_1 / Q8_0: float16 [N, K/32]; NVFP4: e4m3 bytes [N, K/16]
  const void* mins;      // Q4_1: float16 [N, K/32]
  int64_t N, K;
  float tensor_scale;    // NVFP4's per-tensor scale (1 for the others)
};

float E4M3[256];
const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

struct Tables {
  Tables() {
    for (int i = 0; i < 256; ++i) {
      const int e = (i >> 3) & 15, m = i & 7;
      float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
      if (e == 15 && m == 7) v = NAN;
      E4M3[i] = (i & 128) ? -v : v;
    }
  }
} tables;

inline float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) { bits = sign; } else {  // subnormal: renormalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 1024));
      bits = sign | uint32_t(127 - 15 - e) << 23 | (man & 1023) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

constexpr int kBlock = 32;

// One weight row's bytes: its codes (or dense values), its block scales and Q4_1's mins; for GGML weights also those
// scales and mins as float32 (`d`, `m`, from `GroupScales` below: what the decoding reads).
struct RowBytes {
  const uint8_t* codes;
  const uint8_t* scale;
  const uint8_t* mins;
  const float* d = nullptr;
  const float* m = nullptr;
};

// GGML weights are whole blocks (K % 32 == 0, checked at the call): `tile` runs them only through decode_block /
// decode_half_block with their float32 scales, never through the ragged-block decoding.
template <Format F>
constexpr bool kWholeBlocksOnly = F == kQ4_1 || F == kQ8_0;

template <Format F>
inline RowBytes row_bytes(const Weight& w, int64_t n) {
  const int64_t K = w.K;
  const int64_t code_bytes = F == kF32 ? 4 * K : F == kBF16 ? 2 * K : F == kQ8_0 ? K : K / 2;
  const int64_t scale_bytes = F == kNVFP4 ? K / 16 : 2 * (K / kBlock);
  return {w.codes + n * code_bytes, reinterpret_cast<const uint8_t*>(w.scale) + n * scale_bytes,
          reinterpret_cast<const uint8_t*>(w.mins) + n * scale_bytes};
}

// The vector type and the weight decoding of the build this CPU runs: the same chains and values in all three
// (tests/test_cpu_kernel.py compares them), only the speed differs.
#if defined(__AVX512F__)
#include "cpu_vectors_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "cpu_vectors_avx2.h"
#else
#include "cpu_vectors_portable.h"
#endif
#if !defined(__AVX512F__)
// The builds that decode half a block at a time (AVX2, portable): a block is its two halves.
template <Format F>
inline void decode(const Weight& w, int64_t n, int64_t b, Vec& w0, Vec& w1) {
  w0 = decode_half<F, 0>(w, n, b);
  w1 = decode_half<F, 1>(w, n, b);
}

template <Format F>
inline void decode_block(const RowBytes& r, int64_t b, Vec& w0, Vec& w1) {
  w0 = decode_half_block<F, 0>(r, b);
  w1 = decode_half_block<F, 1>(r, b);
}
#endif
// Rows [0, M) of x in tiles of up to kMax rows: tile(std::integral_constant<int, T>(), m0) for each tile, its height T
// a compile-time constant (the accumulators' count). The float, Q8 and bfloat16 products all tile this way.
template <int T, int kMax, typename Tile>
inline void tile_of_height(int64_t rows, int64_t m0, const Tile& tile) {
  if constexpr (T >= kMax) {
    tile(std::integral_constant<int, kMax>(), m0);
  } else if (rows == T) {
    tile(std::integral_constant<int, T>(), m0);
  } else {
    tile_of_height<T + 1, kMax>(rows, m0, tile);
  }
}

template <int kMax, typename Tile>
inline void for_each_tile(int64_t M, const Tile& tile) {
  for (int64_t m0 = 0; m0 < M; m0 += kMax) tile_of_height<1, kMax>(std::min<int64_t>(kMax, M - m0), m0, tile);
}

#include "cpu_q8_dot.h"

// GGML weights' float16 block scales (and Q4_1's mins) as float32, converted a small group of consecutive rows at a
// time, before the first of them runs. A block's decoding then broadcasts two floats from memory instead of converting
// two float16 values on the vector pipes, with no bytes added to what a step streams (the floats stay in this thread's
// L1). The conversion is exact: the same values. On a Zen 5, 30 layers' products took 0.88 / 0.90 / 0.90 / 0.94 of
// the time at 1 / 2 / 4 / 8 rows (docs/cpu-step.md). Group size, measured there: ~128 floats (7 rows of a 576-wide
// weight); a whole row at a time stalls (floats stored just before they are read wait on store-to-load forwarding),
// and groups of 2,048 floats were slower than none, waiting on memory for a burst of scales that the prefetcher had
// not fetched, so each group also prefetches the next one's.
template <Format F>
class GroupScales {
 public:
  GroupScales(const Weight& w, int64_t n1) : w_(w), n1_(n1), nb_(w.K / kBlock) {}

  // Row n's bytes; rows are asked for in increasing order (`tile`'s loop).
  __attribute__((always_inline)) RowBytes row(int64_t n) {
    RowBytes r = row_bytes<F>(w_, n);
    if constexpr (kWholeBlocksOnly<F>) {
      if (n >= end_) convert(n);
      r.d = d_ + (n - first_) * nb_;
      r.m = m_ + (n - first_) * nb_;
    }
    return r;
  }

 private:
  static constexpr int64_t kFloats = 128;

  const uint16_t* halves(const void* p, int64_t row) const { return reinterpret_cast<const uint16_t*>(p) + row * nb_; }

  void convert(int64_t n) {
    static thread_local std::vector<float> d, m;
    const int64_t rows = std::min(n1_ - n, std::max<int64_t>(1, kFloats / std::max<int64_t>(nb_, 1)));
    first_ = n;
    end_ = n + rows;
    d.resize(size_t(rows * nb_));
    halves_to_floats(halves(w_.scale, n), rows * nb_, d.data());
    d_ = d.data();
    if constexpr (F == kQ4_1) {
      m.resize(size_t(rows * nb_));
      halves_to_floats(halves(w_.mins, n), rows * nb_, m.data());
      m_ = m.data();
    }
    const int64_t next_bytes = 2 * std::min(n1_ - end_, rows) * nb_;
    for (int64_t off = 0; off < next_bytes; off += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(halves(w_.scale, end_)) + off);
      if constexpr (F == kQ4_1) __builtin_prefetch(reinterpret_cast<const char*>(halves(w_.mins, end_)) + off);
    }
  }

  const Weight& w_;
  const int64_t n1_, nb_;
  int64_t first_ = 0, end_ = 0;
  const float* d_ = nullptr;
  const float* m_ = nullptr;
};

// Rows of x per pass over a weight row: their accumulators (two 16-lane vectors a row) stay in registers. AVX-512
// has 32 registers of 16 lanes: 8 rows. Elsewhere a 16-lane vector takes several registers (two of AVX2's 16, four
// of NEON's 32), so 4 rows, and each row's two chains in two passes (`tile`); measured on a Zen 1 (AVX2) through
// `bench.step_costs`: verify D 7 88-96 ms with 4 rows and two passes against 102 ms with 2 rows and 154 ms with 1.
#if defined(__AVX512F__)
constexpr int kTile = 8;
#else
#define DFLASH_HALF_PASSES 1
constexpr int kTile = 4;
#endif

// The weight stream's next bytes requested ahead of a tile of 5-8 rows, one cache line at a time: there each block
// lasts longest, and the hardware's own prefetching left the loop waiting on memory. On a Zen 5, 30 layers' products
// at 8 rows took 0.84-0.85 of the time with 1 KB ahead (2 KB: 0.84-0.86), while at 1-4 rows the same prefetches
// changed nothing measurable or cost 1-3% (docs/cpu-step.md). A prefetch past the weight's end never faults.
template <Format F>
constexpr int64_t kBlockBytes = F == kF32 ? 128 : F == kBF16 ? 64 : F == kQ8_0 ? 32 : 16;  // codes of 32 weights
constexpr int64_t kPrefetchAhead = 1024;

template <Format F>
inline void prefetch_ahead(const RowBytes& r, int64_t b) {
  const int64_t at = b * kBlockBytes<F>;
  if (kBlockBytes<F> < 64 && at % 64) return;
  for (int64_t line = 0; line < std::max<int64_t>(kBlockBytes<F>, 64); line += 64)
    __builtin_prefetch(r.codes + at + kPrefetchAhead + line);
}

// One pass over weight rows [n0, n1) for T rows of x, in every build (the vector type and `decode` above).
template <Format F, int T>
void tile(const Weight& w, const float* x, float* y, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t K = w.K, nb = (K + kBlock - 1) / kBlock;
  const float* xt = x + m0 * K;
  const int64_t N = w.N;
  const float tensor_scale = w.tensor_scale;
  GroupScales<F> scales(w, n1);
  for (int64_t n = n0; n < n1; ++n) {
    // two accumulators per row (each block's first and second halves): a 1-row product waits on one FMA per block,
    // not two; combined as lo + hi for every row whatever T
    Vec lo[T], hi[T];
    for (int i = 0; i < T; ++i) lo[i] = hi[i] = vzero();
#if defined(DFLASH_HALF_PASSES)
    // AVX2, 3+ rows: the two chains in two passes over the row (the second from L1): half the accumulators live at a
    // time, so AVX2's 16 registers hold 4 rows' without spilling; the same chains, so the same values
    if constexpr (T > 2) {
      const RowBytes r = scales.row(n);
      auto pass = [&](auto half, Vec* acc) {  // one half H of every block into its chains: whole blocks, as below
        constexpr int H = decltype(half)::value;
        int64_t b = 0;
        for (; b < K / kBlock; ++b) {
          const Vec wh = decode_half_block<F, H>(r, b);
          for (int i = 0; i < T; ++i) acc[i] = vfma(wh, vload(xt + i * K + b * kBlock + 16 * H, 16), acc[i]);
        }
        if constexpr (!kWholeBlocksOnly<F>) {
          for (; b < nb; ++b) {
            const Vec wh = decode_half<F, H>(w, n, b);
            const int valid = int(std::min<int64_t>(kBlock, K - b * kBlock)) - 16 * H;
            for (int i = 0; i < T; ++i) acc[i] = vfma(wh, vload(xt + i * K + b * kBlock + 16 * H, valid), acc[i]);
          }
        }
      };
      pass(std::integral_constant<int, 0>(), lo);
      pass(std::integral_constant<int, 1>(), hi);
    } else
#endif
    {
      int64_t b = 0;
      // Whole blocks first, decoded from the row's own pointers: no bounds to test and no index arithmetic per block,
      // which the general loop below spends on every block (15-18% of a product at 1-8 rows with AVX-512, measured
      // on Zen 5: docs/cpu-step.md); that loop is left with a dense or NVFP4 weight's ragged last block. The same
      // values.
      const RowBytes r = scales.row(n);
      for (; b < K / kBlock; ++b) {
        if constexpr (T > 4) prefetch_ahead<F>(r, b);
        Vec w0, w1;
        decode_block<F>(r, b, w0, w1);
        for (int i = 0; i < T; ++i) {
          const float* xm = xt + i * K + b * kBlock;
          lo[i] = vfma(w0, vload(xm, 16), lo[i]);
          hi[i] = vfma(w1, vload(xm + 16, 16), hi[i]);
        }
      }
      if constexpr (!kWholeBlocksOnly<F>) {
        for (; b < nb; ++b) {
          Vec w0, w1;
          decode<F>(w, n, b, w0, w1);
          const int valid = int(std::min<int64_t>(kBlock, K - b * kBlock));
          for (int i = 0; i < T; ++i) {
            const float* xm = xt + i * K + b * kBlock;
            lo[i] = vfma(w0, vload(xm, valid), lo[i]);
            hi[i] = vfma(w1, vload(xm + 16, valid - 16), hi[i]);
          }
        }
      }
    }
    for (int i = 0; i < T; ++i) y[(m0 + i) * N + n] = vsum(vadd(lo[i], hi[i])) * tensor_scale;
  }
}

template <Format F>
void rows_of(const Weight& w, const float* x, float* y, int64_t M, int64_t n0, int64_t n1) {
  for_each_tile<kTile>(M, [&](auto T, int64_t m0) { tile<F, decltype(T)::value>(w, x, y, m0, n0, n1); });
}

#include "cpu_bf16_dot.h"

void rows(const Weight& w, const float* x, const ActQ8& xq, const ActBF16& xb, float* y, int64_t M, int64_t n0,
          int64_t n1) {
  switch (w.format) {
    case kQ4_1_BF16: return rows_bf16_of<kQ4_1>(w, xb, y, M, n0, n1);
    case kQ8_0_BF16: return rows_bf16_of<kQ8_0>(w, xb, y, M, n0, n1);
    case kQ4_1_Q8: return rows_q8_of<kQ4_1_Q8>(w, xq, y, M, n0, n1);
    case kQ8_0_Q8: return rows_q8_of<kQ8_0_Q8>(w, xq, y, M, n0, n1);
    case kF32: return rows_of<kF32>(w, x, y, M, n0, n1);
    case kBF16: return rows_of<kBF16>(w, x, y, M, n0, n1);
    case kQ4_1: return rows_of<kQ4_1>(w, x, y, M, n0, n1);
    case kQ8_0: return rows_of<kQ8_0>(w, x, y, M, n0, n1);
    case kNVFP4: return rows_of<kNVFP4>(w, x, y, M, n0, n1);
  }
}

// The kernel's own worker threads. A decode step makes ~120 short calls (a 576 x 576 Q4_1 product is ~200 KB,
// ~12 us of memory traffic), and handing half of one to a thread of XLA's pool costs more than the half: the pool
// thread is usually asleep and takes tens of microseconds to wake (measured: 120 chained calls 3.3-4.4 ms through
// the pool, 2.6 ms on the calling thread alone, 1.3 ms for the same bytes as one call). So, as llama.cpp does, the
// workers here spin for a short while after each job, and a step's next call finds them awake. A worker sleeps on a
// condition variable after kSpinMicros without work, so an idle process costs nothing.
//
// One job at a time: a call that finds the workers busy (XLA may run two independent custom calls at once) does its
// rows alone on its own thread. Results never depend on who ran a chunk (see Exactness above).
class Workers {
 public:
  static Workers& get() {
    static Workers* w = new Workers();  // never destroyed: threads outlive static destruction order safely
    return *w;
  }

  // Threads that run a call's chunks: the workers and the calling thread.
  int64_t threads() const { return int64_t(threads_.size()) + 1; }

  // Runs body(i) for i in [0, n), split over the calling thread and the workers; returns when all n are done.
  template <typename Body>
  void run(int64_t n, const Body& body) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || threads_.empty() || n < 2) {
      for (int64_t i = 0; i < n; ++i) body(i);
      return;
    }
    auto job = std::make_shared<Job>();
    job->n = n;
    job->body = [&body](int64_t i) { body(i); };
    {
      std::lock_guard<std::mutex> lock(slot_mutex_);
      slot_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    job->work();
    // Only chunks a worker is running remain: spin (a call takes microseconds), yielding now and then in case that
    // worker was descheduled on a loaded machine.
    for (int spins = 0; job->done.load(std::memory_order_acquire) < n; ++spins) {
      if (spins % 4096 == 4095) std::this_thread::yield();
      else pause();
    }
    std::lock_guard<std::mutex> lock(slot_mutex_);
    slot_.reset();  // a late worker holding `job` finds no index left and never calls `body` (gone with this frame)
  }

 private:
  struct Job {
    int64_t n = 0;
    std::function<void(int64_t)> body;
    std::atomic<int64_t> next{0}, done{0};
    void work() {
      for (int64_t i; (i = next.fetch_add(1)) < n;) {
        body(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };

  static constexpr int64_t kSpinMicros = 300;
  static constexpr int kPauseSpins = 2000;  // ~10-20 us of pause instructions

  static void pause() {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_ia32_pause();
#endif
  }

  static int threads_wanted() {
    if (const char* env = std::getenv("DFLASH_JAX_KERNEL_THREADS")) {
      const int t = std::atoi(env);
      if (t >= 1) return std::min(t, 64);
    }
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, std::min(CPU_COUNT(&set), 32));
#endif
    return std::max(1u, std::min(std::thread::hardware_concurrency(), 32u));
  }

  Workers() {
    for (int t = 1; t < threads_wanted(); ++t) threads_.emplace_back([this] { loop(); });
    for (auto& t : threads_) t.detach();
  }

  void loop() {
    uint64_t seen = generation_.load();
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      for (int spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        // Spin on the core for the gap between two calls of a step; past it, yield between checks, so a thread of
        // XLA's own pool (its parallel fusions) that wants this core gets it; then sleep.
        if (spins < kPauseSpins) pause();
        else std::this_thread::yield();
        if (spins % 64 == 63 &&
            std::chrono::steady_clock::now() - start > std::chrono::microseconds(kSpinMicros)) {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleepers_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleepers_.fetch_sub(1);
        }
      }
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(slot_mutex_);
        job = slot_;
        seen = generation_.load();
      }
      if (job) job->work();
    }
  }

  std::mutex busy_, slot_mutex_, sleep_mutex_;
  std::condition_variable wake_;
  std::shared_ptr<Job> slot_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleepers_{0};
  std::vector<std::thread> threads_;
};

#include "cpu_attention.h"
#include "cpu_argmax.h"
#include "cpu_sample.h"

// One call computes the products of one x with several weights (a layer's q / k / v, or gate / up: the same input),
// so the per-call cost (the custom call, waking the pool, the final wait) is paid once for all of them. Operands:
// x, then 4 per weight (codes, scale, mins, tensor scale [1]); results: one per weight. Each output row is computed
// exactly as a call with that weight alone would compute it (the chains above), so fusing changes no value.
ffi::Error BlockMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                           ffi::RemainingRets rets, ffi::Span<const int64_t> formats,
                           ffi::Span<const int64_t> n_rows) {
  const size_t n_weights = formats.size();
  if (n_weights == 0 || n_rows.size() != n_weights || args.size() != 4 * n_weights || rets.size() != n_weights)
    return ffi::Error::InvalidArgument("operands: x, then codes, scale, mins, tensor scale per weight; one result each");
  const int64_t K = x.dimensions().back();
  const int64_t M = K ? x.element_count() / K : 0;
  std::vector<Weight> ws(n_weights);
  std::vector<float*> ys(n_weights);
  int64_t total = 0;
  for (size_t i = 0; i < n_weights; ++i) {
    auto codes = args.get<ffi::AnyBuffer>(4 * i), scale = args.get<ffi::AnyBuffer>(4 * i + 1),
         mins = args.get<ffi::AnyBuffer>(4 * i + 2);
    auto tensor_scale = args.get<ffi::Buffer<ffi::F32>>(4 * i + 3);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!codes || !scale || !mins || !tensor_scale || !y) return ffi::Error::InvalidArgument("operand types");
    if (formats[i] < kF32 || formats[i] > kQ8_0_BF16) return ffi::Error::InvalidArgument("unknown weight format");
    Weight& w = ws[i];
    w.format = Format(formats[i]);
    w.K = K;
    w.N = n_rows[i];
    w.codes = reinterpret_cast<const uint8_t*>(codes->untyped_data());
    w.scale = scale->untyped_data();
    w.mins = mins->untyped_data();
    w.tensor_scale = tensor_scale->typed_data()[0];
    if (w.format != kF32 && w.format != kBF16 && w.format != kNVFP4 && K % 32)  // GGML: whole blocks return ffi::Error::InvalidArgument("K % 32 != 0");
    if (w.format == kNVFP4 && K % 16) return ffi::Error::InvalidArgument("K % 16 != 0");
    ys[i] = (*y)->typed_data();
    total += w.N;
  }
  // One chunk per thread: each thread streams one long run of consecutive rows. A chunk is one stream of weight bytes
  // that the hardware prefetcher must pick up anew: with 64 chunks a call (the first choice) two threads each took 32
  // short runs (4.6 KB for a 576-wide Q4_1 weight), and 30 layers' matmuls at 1 row took 6.4-6.8 ms against 3.9-4.4 ms
  // with 4 chunks per thread; 1 per thread made decoding another ~8% faster than 4 (Zen 5, docs/cpu-step.md). Chunks
  // are claimed, not assigned: a worker that has not woken by the time the caller is done leaves its chunk to the
  // caller. Chunk c is rows [c * chunk, ...) of the weights laid end to end, cut at weight boundaries.
  const int64_t wanted = Workers::get().threads();
  const int64_t chunk = std::max<int64_t>(16, (total + wanted - 1) / wanted);
  struct Piece { int32_t weight; int64_t n0, n1; };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < n_weights; ++i)
    for (int64_t n0 = 0; n0 < ws[i].N; n0 += chunk)
      pieces.push_back({int32_t(i), n0, std::min(ws[i].N, n0 + chunk)});
  const float* xp = x.typed_data();
  ActQ8 xq;  // x as Q8 blocks, rounded once for every weight of the call that asks for them
  if (std::any_of(ws.begin(), ws.end(), [](const Weight& w) { return w.format == kQ4_1_Q8 || w.format == kQ8_0_Q8; }))
    quantize_rows_q8(xp, M, K, xq);
  ActBF16 xb;  // x as bfloat16, likewise
  if (std::any_of(ws.begin(), ws.end(), [](const Weight& w) { return w.format == kQ4_1_BF16 || w.format == kQ8_0_BF16; }))
    round_rows_bf16(xp, M, K, xb);
  Workers::get().run(int64_t(pieces.size()), [&](int64_t p) {
    rows(ws[pieces[p].weight], xp, xq, xb, ys[pieces[p].weight], M, pieces[p].n0, pieces[p].n1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashRowAttention, RowAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, T, nKV, G, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cached k [B, nKV, S, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cached v
                                  .Arg<ffi::Buffer<ffi::U8>>()    // visible cached keys [B, T, S]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // fresh k [B, Tk, nKV, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // fresh v
                                  .Arg<ffi::Buffer<ffi::U8>>()    // visible fresh keys [B, T, Tk]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // l [B, nKV, G, T]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o [B, nKV, G, T, hd]
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashFirstArgmax, FirstArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., N]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // [...]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashSampleRows, SampleRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., N]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // u [...]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // temperature [1]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // [...]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashRowLogsumexp, RowLogsumexpImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., N]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // temperature [1]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [...]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashResidualRows, ResidualRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [B, R, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // row [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, nq]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q_on [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // point [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // u [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // temperature [1]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // [B]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashSoftmaxDraw, SoftmaxDrawImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., N]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // u [...]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // temperature [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // probs [..., N]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // [...]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashTopK, TopKImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., N]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // values [..., k]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // ids [..., k]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashBlockMatmul, BlockMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., K]
                                  .RemainingArgs()               // per weight: codes, scale, mins, tensor scale [1]
                                  .RemainingRets()               // per weight: y [..., n_rows]
                                  .Attr<ffi::Span<const int64_t>>("formats")
                                  .Attr<ffi::Span<const int64_t>>("n_rows"));

extern "C" int dflash_kernel_abi_version() { return 6; }

// Which build this is (the chains and values are the same in all three; the speed is not).
extern "C" const char* dflash_kernel_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return "avx2";
#else
  return "portable";
#endif
}
