// A few-row dense matmul for CPUs with AVX512-BF16: y = x @ W^T for an fp32 or bf16 weight, read in place.
//
// x (M, K) and W (N, K) share a dtype (fp32 or bf16); y (M, N) has it too. W is the `nn.Linear` weight
// as it is: no copy, no re-layout, so a model's state dict and memory stay what they were.
//
// Why it exists: batch-1 decode is one pass over every weight, so a step can be no faster than
// weight bytes / memory bandwidth. torch's kernels for a few rows are built for larger problems
// (`bench generation` compares them with this one). Here each thread streams its own contiguous share
// of W's rows, one row after the next (one sequential stream per core: interleaving two rows' streams
// read far slower on Zen 4; a thread done early takes rows from the back of another's share), one 256-
// or 512-bit load of the row (`load_bits`) per FMA (fp32) or `vdpbf16ps` (bf16: 16 or 32 products, exact
// in fp32) for each of up to 4 rows of x, while the row sits in L1. Sums are in fp32, 8 independent ones
// for a single row of x to cover the FMA's latency; a bf16 result is rounded once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include <cpuid.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "parallel_rows.h"

namespace {

constexpr int kTile = 4;   // rows of x per pass over a row of W (while it sits in L1)
// Before reading a row of W, ask for the bytes 8 KiB further on into L2 (one prefetch per 64-byte line):
// on a 2-core Xeon with AMX the hardware's own prefetcher alone left two threads streaming slower than
// with these (4-32 KiB ahead all did as well; into L1 less so, and `prefetchnta` was far slower), and
// SmolLM2's compiled step at 2 threads got faster in every alternated round; at 1 thread, no change.
// Measured on that Xeon only (on Zen 4 an earlier software prefetch did not move the kernel).
constexpr int64_t kPrefetchAhead = 8 << 10;

// The elements one load holds, the product-sum step and the final sum, per dtype and load width (256 or
// 512 bits). Which width streams faster depends on the core (`load_bits`), so both are built.
template <typename T, int Bits>
struct Lanes;

template <>
struct Lanes<float, 256> {
  static constexpr int64_t n = 8;
  using V = __m256;
  using Acc = __m256;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const float* p, int64_t left) { return _mm256_maskz_loadu_ps((__mmask8)((1u << left) - 1), p); }
  static Acc fma(Acc acc, V w, V x) { return _mm256_fmadd_ps(w, x, acc); }
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  static float sum(Acc v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};

template <>
struct Lanes<c10::BFloat16, 256> : Lanes<float, 256> {
  static constexpr int64_t n = 16;
  using V = __m256bh;
  static V load(const c10::BFloat16* p) { return (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static V load(const c10::BFloat16* p, int64_t left) {
    return (__m256bh)_mm256_maskz_loadu_epi16((__mmask16)((1u << left) - 1), p);
  }
  static Acc fma(Acc acc, V w, V x) { return _mm256_dpbf16_ps(acc, w, x); }
};

template <>
struct Lanes<float, 512> {
  static constexpr int64_t n = 16;
  using V = __m512;
  using Acc = __m512;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const float* p, int64_t left) { return _mm512_maskz_loadu_ps((__mmask16)((1u << left) - 1), p); }
  static Acc fma(Acc acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float sum(Acc v) { return _mm512_reduce_add_ps(v); }
};

template <>
struct Lanes<c10::BFloat16, 512> : Lanes<float, 512> {
  static constexpr int64_t n = 32;
  using V = __m512bh;
  static V load(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static V load(const c10::BFloat16* p, int64_t left) {
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((uint64_t{1} << left) - 1), p);
  }
  static Acc fma(Acc acc, V w, V x) { return _mm512_dpbf16_ps(acc, w, x); }
};

inline void store(float* y, float v) { *y = v; }
inline void store(c10::BFloat16* y, float v) { *y = c10::BFloat16(v); }   // round to nearest even

// y[t * N] for one row of W and TT rows of x (x[t * K], k < K).
template <typename T, int Bits, int TT>
void block(const T* w, const T* x, int64_t K, T* y, int64_t N) {
  using L = Lanes<T, Bits>;
  constexpr int C = TT == 1 ? 8 : 2;   // independent sums per row of x, to hide the FMA's latency
  typename L::Acc acc[TT][C];
  for (int t = 0; t < TT; ++t)
    for (int c = 0; c < C; ++c) acc[t][c] = L::zero();
  int64_t k = 0;
  for (; k + C * L::n <= K; k += C * L::n) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      typename L::V xv[TT];
      for (int t = 0; t < TT; ++t) xv[t] = L::load(x + t * K + k + c * L::n);
      const typename L::V wv = L::load(w + k + c * L::n);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) acc[t][c] = L::fma(acc[t][c], wv, xv[t]);
    }
  }
  for (; k + L::n <= K; k += L::n) {   // the last whole chunks
    typename L::V xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = L::load(x + t * K + k);
    const typename L::V wv = L::load(w + k);
    for (int t = 0; t < TT; ++t) acc[t][0] = L::fma(acc[t][0], wv, xv[t]);
  }
  if (k < K) {   // a partial chunk: zeros past the end of each row
    typename L::V xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = L::load(x + t * K + k, K - k);
    const typename L::V wv = L::load(w + k, K - k);
    for (int t = 0; t < TT; ++t) acc[t][0] = L::fma(acc[t][0], wv, xv[t]);
  }
  for (int t = 0; t < TT; ++t) {
    typename L::Acc s = acc[t][0];
    for (int c = 1; c < C; ++c) s = L::add(s, acc[t][c]);
    store(y + t * N, L::sum(s));
  }
}

// W's rows n0..n1 against every row of x.
template <typename T, int Bits>
void rows(const T* x, const T* w, T* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(T));
  for (int64_t n = n0; n < n1; ++n) {
    const T* row = w + n * K;
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(row) + kPrefetchAhead;   // past W's end too: never faults
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + b), _MM_HINT_T1);
    int64_t m = 0;
    for (; m + kTile <= M; m += kTile) block<T, Bits, kTile>(row, x + m * K, K, y + m * N + n, N);
    switch (M - m) {   // the last 1 to 3 rows of x in one pass
      case 3: block<T, Bits, 3>(row, x + m * K, K, y + m * N + n, N); break;
      case 2: block<T, Bits, 2>(row, x + m * K, K, y + m * N + n, N); break;
      case 1: block<T, Bits, 1>(row, x + m * K, K, y + m * N + n, N); break;
      default: break;
    }
  }
}

// The load width `dense_gemv` streams with: 256 bits on Zen 4 (AMD family 25), which splits a 512-bit
// load in two and read faster with 256-bit ones; 512 elsewhere. Intel's cores with AVX512-BF16 load 64
// bytes at once: SmolLM2's compiled step on a 2-core Xeon with AMX at 2 threads, 256 against 512-bit
// loads alternated in one process, was faster with 512 at batch 1, 2 and 8, bf16 and fp32. Before
// the 8 KiB prefetch into L2 (above), 512-bit loads had been slower there. Zen 5, whose server
// cores load 512 bits at once, is unmeasured. `dense_gemv_load_bits` reads or overrides the choice
// (tests run both widths on any CPU).
std::atomic<int> forced_bits{0};   // 0: the CPU's default

int default_bits() {
  static const int bits = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 512;
    const bool amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;   // "Auth" "enti" "cAMD"
    if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return 512;
    const unsigned base = (a >> 8) & 0xF, family = base == 0xF ? base + ((a >> 20) & 0xFF) : base;
    return family == 25 ? 256 : 512;
  }();
  return bits;
}

int load_bits() {
  const int forced = forced_bits.load(std::memory_order_relaxed);
  return forced ? forced : default_bits();
}

template <typename T>
void gemv(const T* x, const T* w, T* y, int64_t M, int64_t N, int64_t K) {
  // at least ~64 KiB of weights per thread, taken 16 KiB at a time (parallel_rows.h: SmolLM2's compiled
  // bf16 step at 2 threads, alternated in one process against equal shares and no taking over, was a
  // little faster in most rounds)
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(T));
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (row_bytes + 1));
  cs336::parallel_rows(N, std::min<int64_t>(at::get_num_threads(), (N + grain - 1) / grain),
                       std::max<int64_t>(1, (16 << 10) / row_bytes),
                       [&, wide = load_bits() == 512](int64_t n0, int64_t n1) {
                         if (wide) rows<T, 512>(x, w, y, M, N, K, n0, n1);
                         else rows<T, 256>(x, w, y, M, N, K, n0, n1);
                       });
}

// More than `max_rows` rows go to torch's own matmul (`at::linear`): a compiled graph whose batch size is
// a symbol calls this op for every size, and the choice is made here, per call, with no guard on it.
at::Tensor dense_gemv(const at::Tensor& x, const at::Tensor& w, int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "dense_gemv: x must be (M, K) and w (N, K), got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "dense_gemv: x and w must both be fp32 or both bf16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "dense_gemv: x and w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(N < (int64_t{1} << 32), "dense_gemv: w has ", N, " rows, more than 2^32 - 1");
  if (M > max_rows) return at::linear(x, w);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    gemv<float>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, N, K);
  } else {
    gemv<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(),
                        M, N, K);
  }
  return y;
}

// bits: -1 reads the width in use, 256 or 512 forces one, 0 goes back to the CPU's default. Returns the
// width in use after the call.
int64_t dense_gemv_load_bits(int64_t bits) {
  TORCH_CHECK_VALUE(bits == -1 || bits == 0 || bits == 256 || bits == 512,
                    "dense_gemv_load_bits: bits must be -1 (read), 0 (the CPU's default), 256 or 512, got ", bits);
  if (bits >= 0) forced_bits.store(static_cast<int>(bits), std::memory_order_relaxed);
  return load_bits();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cs336, m) {
  m.def("dense_gemv(Tensor x, Tensor w, int max_rows) -> Tensor");
  m.def("dense_gemv_load_bits(int bits=-1) -> int", &dense_gemv_load_bits);
}
TORCH_LIBRARY_IMPL(cs336, CPU, m) { m.impl("dense_gemv", &dense_gemv); }
