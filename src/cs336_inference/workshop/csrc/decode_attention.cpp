// Attention of a decode step's few query rows over every cached key, on CPUs with AVX512-BF16.
//
// q (B, K, R, H): the R = G x T query rows of each key/value head (grouped-query attention stacks a
// group's heads as rows); k (B, K, S, H) and v (B, K, S, Hv): the cache, read in place (each row
// contiguous, any other stride). out (B, K, R, Hv) = softmax(q k^T * scale) v with every key visible,
// which is what a plain decode step needs (a masked attention, as in a prefill, stays with torch's).
//
// Why it exists: torch's fused CPU attention is built for blocks of many queries; with the three
// query rows of a decode step it spends several times longer per cached token than the arithmetic
// needs. Here one task is one (batch, head): each key row is read once for all R queries (one
// `vdpbf16ps` per 32 values: bf16 products are exact in fp32, so the only rounding is fp32
// accumulation), the softmax runs 16 scores at a time in fp32, then each value row is read once.
// An fp32 model (q, k, v all fp32, fp32 out) runs the same algorithm with fp32 products (one fused
// multiply-add per 16 values) and no rounding of the output.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 16;     // query rows per head kept in registers
constexpr int64_t kMaxChunks = 8;    // H / 32 <= 8: head dims up to 256

inline __m512 exp_ps(__m512 x) {     // e^x for x <= 0 (a score minus the row's max), to ~1 ulp
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));   // x log2(e) = n + f
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);                                        // |f| <= 1/2
  // 2^f by its Taylor series in f ln 2 (degree 7: the next term is below 1e-8 for |f| <= 1/2)
  __m512 p = _mm512_set1_ps(1.5252733804059840e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381608e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);                                               // 2^f * 2^n
}

inline __m512 bf16x16_to_fp32(const c10::BFloat16* p) {   // 16 bf16 -> 16 fp32 (a shift of the bits)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512bh load_bf16x32(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

inline __m512 load16(const c10::BFloat16* p) { return bf16x16_to_fp32(p); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline void store16(c10::BFloat16* p, __m512 x) {   // round to bf16 (nearest even)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }

// scores (R, S16) = q k^T * scale, bf16: one `vdpbf16ps` per 32 values of a row pair
void scores_of(const c10::BFloat16* q, const c10::BFloat16* kp, int64_t ks, int64_t R, int64_t H, int64_t S,
               float scale, float* scores) {
  const int64_t C = H / 32, S16 = (S + 15) / 16 * 16;
  __m512bh qv[kMaxRows][kMaxChunks];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) qv[r][c] = load_bf16x32(q + r * H + 32 * c);
  for (int64_t s = 0; s < S; ++s) {                   // each key row read once for all rows
    __m512bh kv[kMaxChunks];
    for (int64_t c = 0; c < C; ++c) kv[c] = load_bf16x32(kp + s * ks + 32 * c);
    for (int64_t r = 0; r < R; ++r) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < C; ++c) acc = _mm512_dpbf16_ps(acc, qv[r][c], kv[c]);
      scores[r * S16 + s] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

// the same in fp32: one fused multiply-add per 16 values. C = H / 16 is a constant here, so a key row
// and each query row stay in registers.
template <int C>
void scores_f32(const float* q, const float* kp, int64_t ks, int64_t R, int64_t S, float scale, float* scores) {
  const int64_t S16 = (S + 15) / 16 * 16;
  for (int64_t s = 0; s < S; ++s) {
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = _mm512_loadu_ps(kp + s * ks + 16 * c);
    for (int64_t r = 0; r < R; ++r) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + r * 16 * C), kv[0]);
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * 16 * C + 16 * c), kv[c], acc);
      scores[r * S16 + s] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

void scores_of(const float* q, const float* kp, int64_t ks, int64_t R, int64_t H, int64_t S, float scale,
               float* scores) {
  switch (H / 32) {   // H % 32 == 0, H <= 256 (checked by the caller)
    case 1: return scores_f32<2>(q, kp, ks, R, S, scale, scores);
    case 2: return scores_f32<4>(q, kp, ks, R, S, scale, scores);
    case 3: return scores_f32<6>(q, kp, ks, R, S, scale, scores);
    case 4: return scores_f32<8>(q, kp, ks, R, S, scale, scores);
    case 5: return scores_f32<10>(q, kp, ks, R, S, scale, scores);
    case 6: return scores_f32<12>(q, kp, ks, R, S, scale, scores);
    case 7: return scores_f32<14>(q, kp, ks, R, S, scale, scores);
    default: return scores_f32<16>(q, kp, ks, R, S, scale, scores);
  }
}

// One (batch, head): q (R, H) contiguous; k rows at kp + s * ks, v rows at vp + s * vs; out (R, Hv).
// T is c10::BFloat16 (bf16 q, k, v and out) or float (all fp32); the softmax and sums are fp32 either way.
template <typename T>
void one_head(const T* q, const T* kp, int64_t ks, const T* vp, int64_t vs, int64_t R, int64_t H, int64_t S,
              int64_t Hv, float scale, float* scores, T* out) {
  const int64_t S16 = (S + 15) / 16 * 16;
  scores_of(q, kp, ks, R, H, S, scale, scores);
  for (int64_t r = 0; r < R; ++r) {                   // softmax, 16 scores at a time, in fp32
    float* row = scores + r * S16;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t s = 0; s < S; s += 16) {
      const __mmask16 m = S - s >= 16 ? 0xFFFF : (__mmask16)((1u << (S - s)) - 1);
      top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, row + s));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; s += 16) {
      const __mmask16 m = S - s >= 16 ? 0xFFFF : (__mmask16)((1u << (S - s)) - 1);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + s), mx));
      total = _mm512_mask_add_ps(total, m, total, e);
      _mm512_mask_storeu_ps(row + s, m, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
    for (int64_t s = 0; s < S; s += 16) {
      const __mmask16 m = S - s >= 16 ? 0xFFFF : (__mmask16)((1u << (S - s)) - 1);
      _mm512_mask_storeu_ps(row + s, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + s), inv));
    }
  }
  for (int64_t j = 0; j < Hv; j += 16) {              // out: 16 value columns at a time, all rows
    __m512 acc[kMaxRows];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      const __m512 vj = load16(vp + s * vs + j);
      for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(scores[r * S16 + s]), vj, acc[r]);
    }
    for (int64_t r = 0; r < R; ++r) store16(out + r * Hv + j, acc[r]);
  }
}

template <typename T>
void run_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), K = q.size(1), R = q.size(2), H = q.size(3), S = k.size(2), Hv = v.size(3);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t S16 = (S + 15) / 16 * 16;
  // a few heads of a short cache are less work than waking another thread: split only larger work
  const int64_t grain = std::max<int64_t>(1, 4096 / (S * R));
  at::parallel_for(0, B * K, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(R * S16);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / K, h = t % K;
      one_head(qp + t * R * H, kp + b * k.stride(0) + h * k.stride(1), k.stride(2),
               vp + b * v.stride(0) + h * v.stride(1), v.stride(2), R, H, S, Hv, scale, scores.data(),
               op + t * R * Hv);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v must be 4-D (B, K, rows, H)");
  const int64_t B = q.size(0), K = q.size(1), R = q.size(2), H = q.size(3), S = k.size(2), Hv = v.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(1) == K && k.size(3) == H && v.size(0) == B && v.size(1) == K &&
                  v.size(2) == S && S >= 1,
              "decode_attention: q (B, K, R, H), k (B, K, S, H), v (B, K, S, Hv) must agree, S >= 1");
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == at::kBFloat16 || dt == at::kFloat) && k.scalar_type() == dt && v.scalar_type() == dt,
              "decode_attention: q, k, v must all be bfloat16 or all float32");
  TORCH_CHECK(H % 32 == 0 && H <= 32 * kMaxChunks && Hv % 16 == 0 && R >= 1 && R <= kMaxRows,
              "decode_attention: H % 32 == 0 and <= 256, Hv % 16 == 0, 1 <= rows <= 16");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k and v rows must be contiguous");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty({B, K, R, Hv}, q.options());
  if (dt == at::kFloat)
    run_heads<float>(qc, k, v, static_cast<float>(scale), out);
  else
    run_heads<c10::BFloat16>(qc, k, v, static_cast<float>(scale), out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cs336, m) { m.def("decode_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor"); }
TORCH_LIBRARY_IMPL(cs336, CPU, m) { m.impl("decode_attention", &decode_attention); }
