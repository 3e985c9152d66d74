// A few-row int4 matmul for CPUs with AVX512-BF16 (Zen 4, Sapphire Rapids and newer).
//
// y = x @ W^T with W = u * scale + (zero - 8 * scale): u the 4-bit codes, one (scale, zero) pair
// per group of inputs, the grid of torch's int4pack kernels (so GGUF's Q4_1 maps on exactly).
//
// Why it exists: at batch 1, torch's `_weight_int4pack_mm_for_cpu` spends most of its time turning
// codes into numbers. Here a code becomes a bf16 number with one bit operation: the bf16 bit pattern
// 0x4300 | u is exactly 128 + u (7 mantissa bits, exponent 2^7), so per group
//     sum_k x_k w_k = scale * sum_k x_k (128 + u_k) + (zero - 136 * scale) * sum_k x_k,
// and `vdpbf16ps` multiplies 32 such values by 32 activations into 16 fp32 lanes. Products of bf16
// values are exact in fp32: the only rounding is fp32 accumulation, as in any matmul.
//
// fp32 activations (y in fp32): each row of x is split once into two bf16 numbers, x = hi + lo to about
// 16 significant bits, and the codes, decoded once, are multiplied by both halves: twice the dot-product
// instructions on the same bytes, which a memory-bound decode step mostly hides, for a matmul close to
// fp32's accuracy (bf16 activations round x to 8 bits: enough to swap two close logits). Or, split off,
// x is rounded once to bf16 and only y stays fp32.
//
// Each of the 16 lanes is one output row, so a group's scale is one vector multiply for 16 rows and
// no horizontal sums are needed. Layout, per block of 16 output rows (one contiguous stream each):
//   codes (N/16, K/8, 32) int16: word 2i+e of chunk q holds, in its four nibbles (lowest first),
//         u[row i, 8q + 2j + e] for j = 0..3; nibble j of all 32 words is one `vdpbf16ps` operand
//         against the activation pair (x[8q+2j], x[8q+2j+1]) broadcast to every lane.
//   sz    (N/16, K/g, 2, 16) bf16: the scale, then the zero, of each row of the block, per group.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel_rows.h"

namespace {

constexpr int kTile = 4;   // rows of x per pass over a block: the codes are decoded once for all of them
// Independent sums per row of x, for vdpbf16ps's latency. The same for every tile height T, and each
// row's own arithmetic does not depend on the rows beside it: a row of x gets the same bits whether it
// is multiplied alone or among others (a greedy request answers the same alone and in a batch).
constexpr int kChains = 4;

inline __m512 bf16x16_to_fp32(const c10::BFloat16* p) {   // 16 bf16 -> 16 fp32 (a shift of the bits)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512bh pair_to_all_lanes(const c10::BFloat16* x) {   // (x[0], x[1]) as one 32-bit word, in every lane
  int32_t pair;
  std::memcpy(&pair, x, 4);
  return (__m512bh)_mm512_set1_epi32(pair);
}

inline void store16(c10::BFloat16* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }

// y[m, 16 rows of the block] for T rows of x (hi, lo, xsum and y point at the first of them). With
// kSplit, each row of x is hi + lo, two bf16 numbers (`split_rows`), and both halves are multiplied by
// the codes decoded once: hi into chains 0 and 1, lo into chains 2 and 3. Without, x is hi alone.
template <int T, bool kSplit, typename Out>
void block_rows(const uint16_t* codes, const c10::BFloat16* sz, const c10::BFloat16* hi, const c10::BFloat16* lo,
                const float* xsum, int64_t K, int64_t group, Out* y, int64_t N) {
  const __m512i low4 = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  const int64_t G = K / group, chunks = group / 8;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 dot[T][kChains];
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < kChains; ++c) dot[t][c] = _mm512_setzero_ps();
    for (int64_t q = g * chunks; q < (g + 1) * chunks; ++q) {
      _mm_prefetch(reinterpret_cast<const char*>(codes + (q + 8) * 32), _MM_HINT_T0);   // 512 bytes ahead
      const __m512i v = _mm512_loadu_si512(codes + q * 32);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        // (v >> 4j) & 0xF | 0x4300 in each 16-bit word: 0xEA is the truth table of (a & b) | c
        const __m512bh w = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4 * j), low4, bias, 0xEA);
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) {
          const int64_t at = t * K + 8 * q + 2 * j;
          if constexpr (kSplit) {
            dot[t][j % 2] = _mm512_dpbf16_ps(dot[t][j % 2], w, pair_to_all_lanes(hi + at));
            dot[t][2 + j % 2] = _mm512_dpbf16_ps(dot[t][2 + j % 2], w, pair_to_all_lanes(lo + at));
          } else {
            dot[t][j] = _mm512_dpbf16_ps(dot[t][j], w, pair_to_all_lanes(hi + at));
          }
        }
      }
    }
    const __m512 s = bf16x16_to_fp32(sz + g * 32), z = bf16x16_to_fp32(sz + g * 32 + 16);
    const __m512 offset = _mm512_fmadd_ps(_mm512_set1_ps(-136.f), s, z);   // zero - 136 * scale
    for (int t = 0; t < T; ++t) {
      const __m512 d = _mm512_add_ps(_mm512_add_ps(dot[t][0], dot[t][1]), _mm512_add_ps(dot[t][2], dot[t][3]));
      acc[t] = _mm512_fmadd_ps(d, s, acc[t]);
      acc[t] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[t * G + g]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) store16(y + t * N, acc[t]);
}

// fp32 x (n values, n % 16 == 0) -> hi = bf16(x) and lo = bf16(x - hi): x = hi + lo to about 16
// significant bits (hi alone holds 8), and each product of a code with hi or lo is exact in fp32.
void split_rows(const float* x, int64_t n, c10::BFloat16* hi, c10::BFloat16* lo) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, back)));
  }
}

template <bool kSplit, typename Out>
void run_blocks(const uint16_t* cp, const c10::BFloat16* sp, const c10::BFloat16* hi, const c10::BFloat16* lo,
                const float* xsum, int64_t M, int64_t K, int64_t G, int64_t blocks, Out* yp) {
  const int64_t N = 16 * blocks, group = K / G;
  // each thread streams its own blocks, 16 KiB at a time, then takes over the back of a slower one's
  // (parallel_rows.h; SmolLM2's compiled exact-int4 step at 2 threads, alternated in one process
  // against equal shares and no taking over, was a little faster in most rounds)
  const int64_t block_bytes = 16 * (K / 2) + 16 * G * 2 * 2;
  cs336::parallel_rows(blocks, at::get_num_threads(), std::max<int64_t>(1, (16 << 10) / block_bytes),
                       [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* c = cp + b * K * 4;
      const c10::BFloat16* s = sp + b * G * 32;
      // tiles of kTile rows, then the 1 to 3 rows left over as one tile of their own: a tile decodes each
      // block's codes once, so 2 or 3 rows (a short verify pass, a small batch) cost less than 2 or 3 single rows
      const int64_t tiled = M / kTile * kTile;
      for (int64_t m = 0; m < tiled; m += kTile)
        block_rows<kTile, kSplit>(c, s, hi + m * K, kSplit ? lo + m * K : nullptr, xsum + m * G, K, group,
                                  yp + m * N + b * 16, N);
      const int64_t m = tiled;
      const c10::BFloat16* lo_m = kSplit ? lo + m * K : nullptr;
      if (M - m == 3)
        block_rows<3, kSplit>(c, s, hi + m * K, lo_m, xsum + m * G, K, group, yp + m * N + b * 16, N);
      else if (M - m == 2)
        block_rows<2, kSplit>(c, s, hi + m * K, lo_m, xsum + m * G, K, group, yp + m * N + b * 16, N);
      else if (M - m == 1)
        block_rows<1, kSplit>(c, s, hi + m * K, lo_m, xsum + m * G, K, group, yp + m * N + b * 16, N);
    }
  });
}

// x (M, K) bf16 -> y bf16. x fp32 -> y fp32, x multiplied as hi + lo (split) or rounded once to bf16.
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz, bool split) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                  x.is_contiguous(),
              "int4_gemv: x must be a contiguous (M, K) bf16 or fp32 matrix");
  const int64_t M = x.size(0), K = x.size(1), blocks = codes.size(0), N = 16 * blocks;
  TORCH_CHECK(codes.dim() == 3 && codes.size(1) * 8 == K && codes.size(2) == 32 &&
                  codes.scalar_type() == at::kShort && codes.is_contiguous(),
              "int4_gemv: codes must be contiguous (N/16, K/8, 32) int16");
  TORCH_CHECK(sz.dim() == 4 && sz.size(0) == blocks && sz.size(1) > 0 && K % sz.size(1) == 0 &&
                  (K / sz.size(1)) % 32 == 0 && sz.size(2) == 2 && sz.size(3) == 16 &&
                  sz.scalar_type() == at::kBFloat16 && sz.is_contiguous(),
              "int4_gemv: sz must be contiguous (N/16, K/g, 2, 16) bf16 with g % 32 == 0");
  const int64_t G = sz.size(1), group = K / G;
  std::vector<float> xsum(M * G, 0.f);   // each group's sum of x, in fp32 (the exact x, not its halves)
  const auto* cp = reinterpret_cast<const uint16_t*>(codes.data_ptr<int16_t>());
  const auto* sp = sz.data_ptr<c10::BFloat16>();
  at::Tensor y = at::empty({M, N}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    const auto* xp = x.data_ptr<c10::BFloat16>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t k = g * group; k < (g + 1) * group; ++k) xsum[m * G + g] += static_cast<float>(xp[m * K + k]);
    run_blocks<false>(cp, sp, xp, nullptr, xsum.data(), M, K, G, blocks, y.data_ptr<c10::BFloat16>());
    return y;
  }
  const float* xp = x.data_ptr<float>();
  std::vector<c10::BFloat16> hi(M * K), lo(M * K);
  split_rows(xp, M * K, hi.data(), lo.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t k = g * group; k < (g + 1) * group; ++k)
        xsum[m * G + g] += split ? xp[m * K + k] : static_cast<float>(hi[m * K + k]);
  if (split)
    run_blocks<true>(cp, sp, hi.data(), lo.data(), xsum.data(), M, K, G, blocks, y.data_ptr<float>());
  else
    run_blocks<false>(cp, sp, hi.data(), nullptr, xsum.data(), M, K, G, blocks, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY(cs336, m) { m.def("int4_gemv(Tensor x, Tensor codes, Tensor sz, bool split=True) -> Tensor"); }
TORCH_LIBRARY_IMPL(cs336, CPU, m) { m.impl("int4_gemv", &int4_gemv); }
