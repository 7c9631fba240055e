// Paged decode attention that reads K/V where they lie in the block pool (no gather).
//
// One work item = (sequence, KV head, partition of its blocks). The query heads that share a
// KV head (GQA group) are computed together, so each K/V row is loaded and converted to fp32
// once per group, not once per query head. Within a partition the softmax is online, one block
// at a time (running max, running sum, rescaled accumulator); a context longer than one
// partition is split across work items (flash-decoding), each leaving (max, sum, acc) behind,
// merged by a second pass. All arithmetic is fp32 whatever the cache dtype.
//
// The inner loops over head_dim are written for the compiler's auto-vectoriser (omp simd with
// a reduction); the build picks -mavx512f / -mavx2 / nothing from the running CPU's flags.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// A row of the cache as fp32: fp32 rows are read in place, bf16 rows widened into `buffer`.
inline const float* load_row(const float* src, float* /*buffer*/, int64_t /*n*/) { return src; }

inline const float* load_row(const at::BFloat16* src, float* buffer, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t widened = static_cast<uint32_t>(bits[i]) << 16;
    float value;
    std::memcpy(&value, &widened, sizeof(value));
    buffer[i] = value;
  }
  return buffer;
}

// int8 KV cache (engine/quant/kv_int8.py): a row of codes times its per-token, per-head scale.
inline const float* load_row(const int8_t* src, float row_scale, float* buffer, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(src[i]) * row_scale;
  return buffer;
}

// A K or V row of the cache as fp32, whatever the cache holds (float caches carry no scale).
template <typename cache_t>
inline const float* load_kv_row(const cache_t* src, float /*row_scale*/, float* buffer,
                                int64_t n) {
  return load_row(src, buffer, n);
}

template <>
inline const float* load_kv_row(const int8_t* src, float row_scale, float* buffer, int64_t n) {
  return load_row(src, row_scale, buffer, n);
}

// One K or V row (one token, one KV head) into the int8 cache, quantized as
// engine/quant/kv_int8.py's `quantize_kv` does, bit for bit: in fp32, scale = max(|x|, 1e-12) /
// 127 and code = round-half-to-even(x / scale) clamped to [-127, 127] (IEEE divisions, no
// reciprocal: the build has no fast-math). A row holding a NaN (no finite model makes one)
// stores codes 0 and a NaN scale, where torch's cast of NaN is undefined. `buffer`: head_dim
// floats of scratch.
template <typename T>
inline void quantize_row(const T* src, int64_t head_dim, float* buffer, int8_t* codes,
                         float* scale_out) {
  const float* x = load_row(src, buffer, head_dim);
  float amax = 0.0f;
  bool is_nan = false;
  for (int64_t d = 0; d < head_dim; ++d) {
    const float a = std::fabs(x[d]);
    is_nan |= std::isnan(a);
    amax = a > amax ? a : amax;
  }
  const float scale = std::max(amax, 1e-12f) / 127.0f;
  for (int64_t d = 0; d < head_dim; ++d) {
    const float q = std::nearbyint(x[d] / scale);
    codes[d] = is_nan ? 0 : static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q)));
  }
  *scale_out = is_nan ? std::numeric_limits<float>::quiet_NaN() : scale;
}

inline void store_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void store_row(const float* src, at::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<at::BFloat16>(src[i]);  // round to nearest even
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

inline void scale(float alpha, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= alpha;
}

// 2^f's degree-6 Taylor polynomial, highest power first (the vector exponentials below).
[[maybe_unused]] constexpr float kExp2Taylor[7] = {
    1.5403530393381606e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f,
    5.5504108664821580e-2f, 2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.f};

#if defined(__AVX512F__)
// e^x for x <= 0 (scores minus their running max), 16 lanes: 2^(x log2 e) split into an
// integer power (applied exactly by scalef) and 2^f, f in [-1/2, 1/2], by its degree-6 Taylor
// polynomial (relative error ~1e-7, fp32's own rounding). Replaces 16 calls of scalar expf.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(kExp2Taylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Taylor[i]));
  return _mm512_scalef_ps(p, n);
}

// out[i] = the sum of v[i]'s 16 lanes, for 16 vectors: four levels of shuffles and adds (45
// instructions) where 16 horizontal sums cost a serial chain of 15 scalar adds each. It is
// how the decode scores a block: a dot product of 64 ended in such a chain per token and
// query head, and that chain was the decode's largest cost at 32 rows.
inline __m512 lane_sums16(const __m512* v) {
  __m512 pairs[8], quads[4], octets[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v2i (0+2), v2i+1 (0+2), v2i (1+3), v2i+1 (1+3)]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of v4i .. v4i+3
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: v8i..+3 (halves 0, 1), v8i+4..+7 (halves 0, 1)
    octets[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], kEven),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], kOdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(octets[0], octets[1], kEven),
                       _mm512_shuffle_f32x4(octets[0], octets[1], kOdd));
}

// The vector operations the decode's block loops use (group_block_scores, group_block_values),
// one vector of kWidth floats at a time; the AVX2 build has its own below.
struct Lanes {
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // out[i] = the sum of v[i]'s lanes, for 16 vectors.
  static void store_sums16(float* out, const V* v) { _mm512_storeu_ps(out, lane_sums16(v)); }
};

#elif defined(__AVX2__)
// As the AVX-512 exp_ps, 8 lanes: 2^n applied by building its bits (n >= -126 after the clamp:
// a normal number, so the product with 2^f is exact).
inline __m256 exp_ps8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(y, n);
  __m256 p = _mm256_set1_ps(kExp2Taylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Taylor[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                          _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// out[i] = the sum of v[i]'s 8 lanes, for 8 vectors (the AVX2 lane_sums16).
inline __m256 lane_sums8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // per 128-bit half
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

inline float max8(__m256 v) {
  v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_max_ps(v, _mm256_permute_ps(v, 0x4E));
  return _mm256_cvtss_f32(_mm256_max_ps(v, _mm256_permute_ps(v, 0xB1)));
}

inline float sum8(__m256 v) {
  v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_add_ps(v, _mm256_permute_ps(v, 0x4E));
  return _mm256_cvtss_f32(_mm256_add_ps(v, _mm256_permute_ps(v, 0xB1)));
}

struct Lanes {  // as the AVX-512 one, 8 floats a vector
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store_sums16(float* out, const V* v) {
    _mm256_storeu_ps(out, lane_sums8(v));
    _mm256_storeu_ps(out + 8, lane_sums8(v + 8));
  }
};
#endif

// Online-softmax step of one row over one block's first n scores (in place: scores become
// weights): returns the correction for the row's accumulator and updates its max and sum.
inline float softmax_step(float* sr, int64_t n, int64_t B, float& m, float& l) {
#if defined(__AVX512F__)
  if (B == 16) {
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1u);
    const __m512 scores = _mm512_loadu_ps(sr);
    const float new_max = std::max(m, _mm512_mask_reduce_max_ps(keep, scores));
    const __m512 weights =
        _mm512_maskz_mov_ps(keep, exp_ps(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
    _mm512_storeu_ps(sr, weights);
    const float correction = std::exp(m - new_max);  // 0 on the first block (m = -inf)
    l = l * correction + _mm512_reduce_add_ps(weights);
    m = new_max;
    return correction;
  }
#elif defined(__AVX2__)
  if (B == 16) {
    const __m256 index = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 count = _mm256_set1_ps(static_cast<float>(n));
    const __m256 keep[2] = {_mm256_cmp_ps(index, count, _CMP_LT_OQ),
                            _mm256_cmp_ps(_mm256_add_ps(index, _mm256_set1_ps(8)), count,
                                          _CMP_LT_OQ)};
    const __m256 low = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 scores[2];
    for (int h = 0; h < 2; ++h)
      scores[h] = _mm256_blendv_ps(low, _mm256_loadu_ps(sr + 8 * h), keep[h]);
    const float new_max = std::max(m, max8(_mm256_max_ps(scores[0], scores[1])));
    __m256 total = _mm256_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      const __m256 w = _mm256_and_ps(
          keep[h], exp_ps8(_mm256_sub_ps(scores[h], _mm256_set1_ps(new_max))));
      _mm256_storeu_ps(sr + 8 * h, w);
      total = _mm256_add_ps(total, w);
    }
    const float correction = std::exp(m - new_max);  // 0 on the first block (m = -inf)
    l = l * correction + sum8(total);
    m = new_max;
    return correction;
  }
#endif
  const float new_max = std::max(m, *std::max_element(sr, sr + n));
  const float correction = std::exp(m - new_max);
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    sr[t] = std::exp(sr[t] - new_max);
    sum += sr[t];
  }
  l = l * correction + sum;
  m = new_max;
  return correction;
}

// Prefetches `bytes` from `p` (a K or V row, or a block's scales).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(c + offset);
}

// Blocks lie anywhere in the pool, so the hardware prefetcher cannot follow the block table:
// fetch one block's K and V rows of one head (`rows`: its first K row) at once, while the
// previous block is computed (extend only: the decode paths spread these over the block's
// rows, see attend_partition). Strides in elements of the cache.
template <typename cache_t>
inline void prefetch_block(const cache_t* rows, int64_t block_size, int64_t head_dim,
                           int64_t token_stride, int64_t v_offset) {
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t t = 0; t < block_size; ++t) {
    prefetch_bytes(rows + t * token_stride, row_bytes);
    prefetch_bytes(rows + t * token_stride + v_offset, row_bytes);
  }
}

// scores [G, B]: the G query rows of a group (qf [G, D], scaled) against the block's first
// num_tokens K rows (the rest of each row of scores is left undefined).
template <typename cache_t, int HEAD_DIM>
inline void group_block_scores(const float* qf, int64_t G, int64_t D, int64_t B,
                               const cache_t* block, const float* block_scales,
                               int64_t num_tokens, int64_t token_stride, int64_t num_kv_heads,
                               float* row, float* scores, const cache_t* next_keys) {
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(cache_t));
#if defined(__AVX512F__) || defined(__AVX2__)
  constexpr int64_t kMaxGroup = 8, W = Lanes::kWidth;
  if constexpr (HEAD_DIM > 0 && HEAD_DIM % W == 0) {
    if (B == 16 && G <= kMaxGroup) {  // each row's products in one vector per token; sums at the end
      Lanes::V partial[kMaxGroup][16];
      for (int64_t t = 0; t < 16; ++t) {
        if (t >= num_tokens) {
          for (int64_t g = 0; g < G; ++g) partial[g][t] = Lanes::zero();
          continue;
        }
        if (next_keys != nullptr) prefetch_bytes(next_keys + t * token_stride, row_bytes);
        const float k_scale = block_scales ? block_scales[t * 2 * num_kv_heads] : 1.f;
        const float* k = load_kv_row(block + t * token_stride, k_scale, row, HEAD_DIM);
        for (int64_t g = 0; g < G; ++g) {
          const float* q = qf + g * HEAD_DIM;
          Lanes::V sum = Lanes::mul(Lanes::load(q), Lanes::load(k));
          for (int64_t d = W; d < HEAD_DIM; d += W)
            sum = Lanes::fmadd(Lanes::load(q + d), Lanes::load(k + d), sum);
          partial[g][t] = sum;
        }
      }
      for (int64_t g = 0; g < G; ++g) Lanes::store_sums16(scores + g * B, partial[g]);
      return;
    }
  }
#endif
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (next_keys != nullptr) prefetch_bytes(next_keys + t * token_stride, row_bytes);
    const float k_scale = block_scales ? block_scales[t * 2 * num_kv_heads] : 1.f;
    const float* k = load_kv_row(block + t * token_stride, k_scale, row, D);
    for (int64_t g = 0; g < G; ++g) scores[g * B + t] = dot(qf + g * D, k, D);
  }
}

// acc [G, D] += weights [G, B] (first num_tokens of each row) times the block's V rows
// (`values`: the first V row; `value_scales`: int8 caches' per-row scales, else null).
template <typename cache_t, int HEAD_DIM>
inline void group_block_values(const float* weights, int64_t G, int64_t D, int64_t B,
                               const cache_t* values, const float* value_scales,
                               int64_t num_tokens, int64_t token_stride, int64_t num_kv_heads,
                               float* rows, float* acc, const cache_t* next_values) {
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(cache_t));
#if defined(__AVX512F__) || defined(__AVX2__)
  constexpr int64_t W = Lanes::kWidth;
  if constexpr (HEAD_DIM > 0 && HEAD_DIM % W == 0 && HEAD_DIM / W <= 8) {
    if (num_tokens <= 16) {  // each query row's accumulator in registers across the block
      constexpr int kChunks = HEAD_DIM / W;
      const float* v[16];
      for (int64_t t = 0; t < num_tokens; ++t) {
        if (next_values != nullptr) prefetch_bytes(next_values + t * token_stride, row_bytes);
        const float scale = value_scales ? value_scales[t * 2 * num_kv_heads] : 1.f;
        v[t] = load_kv_row(values + t * token_stride, scale, rows + t * HEAD_DIM, HEAD_DIM);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* a = acc + g * HEAD_DIM;
        Lanes::V sum[kChunks];
        for (int c = 0; c < kChunks; ++c) sum[c] = Lanes::load(a + W * c);
        for (int64_t t = 0; t < num_tokens; ++t) {
          const Lanes::V w = Lanes::set1(weights[g * B + t]);
          for (int c = 0; c < kChunks; ++c)
            sum[c] = Lanes::fmadd(w, Lanes::load(v[t] + W * c), sum[c]);
        }
        for (int c = 0; c < kChunks; ++c) Lanes::store(a + W * c, sum[c]);
      }
      return;
    }
  }
#endif
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (next_values != nullptr) prefetch_bytes(next_values + t * token_stride, row_bytes);
    const float scale = value_scales ? value_scales[t * 2 * num_kv_heads] : 1.f;
    const float* v = load_kv_row(values + t * token_stride, scale, rows, D);
    for (int64_t g = 0; g < G; ++g) axpy(weights[g * B + t], v, acc + g * D, D);
  }
}

struct Shapes {
  int64_t num_seqs, num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t partition_blocks, num_partitions;
  int64_t q_seq_stride, q_head_stride;  // in elements; the head_dim stride is 1
};

// Attention of one (sequence, KV head, partition) over blocks [first, last) of the sequence,
// leaving the group's running max `m` [group], sum `l` [group] and unnormalised acc
// [group, head_dim].
// HEAD_DIM > 0 fixes head_dim at compile time (64, 128: the common ones), so the row loops
// unroll into straight vector code with no remainder handling; 0 reads it at run time.
// `scales` (int8 caches only, else null): [num_blocks, block_size, 2, num_kv_heads] float32.
template <typename scalar_t, typename cache_t, int HEAD_DIM>
void attend_partition(const scalar_t* q, const cache_t* cache, const float* scales,
                      const int64_t* table, int64_t context_len, int64_t kv_head,
                      int64_t first_block, int64_t last_block, float softmax_scale,
                      const Shapes& s, float* m, float* l, float* acc) {
  const int64_t G = s.group, B = s.block_size;
  const int64_t D = HEAD_DIM > 0 ? HEAD_DIM : s.head_dim;
  // Per-thread scratch, grown once: an allocation per item cost more than a short partition.
  thread_local std::vector<float> qf, row, scores;
  qf.resize(G * D);
  row.resize(B * D);
  scores.resize(G * B);
  for (int64_t g = 0; g < G; ++g) {
    const float* q_row = load_row(q + (kv_head * G + g) * s.q_head_stride, row.data(), D);
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = q_row[d] * softmax_scale;
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  std::fill(acc, acc + G * D, 0.f);
  // cache [num_blocks, block_size, 2, num_kv_heads, head_dim]
  const int64_t token_stride = 2 * s.num_kv_heads * D;
  const int64_t v_offset = s.num_kv_heads * D;
  for (int64_t b = first_block; b < last_block; ++b) {
    const int64_t num_tokens = std::min(B, context_len - b * B);
    const cache_t* block = cache + table[b] * B * token_stride + kv_head * D;
    // scale of token t's K: block_scales[t * 2 * KVH]; its V: the next KVH entries on
    const float* block_scales =
        scales == nullptr ? nullptr : scales + (table[b] * B * 2) * s.num_kv_heads + kv_head;
    // The next block's rows are prefetched a row per token as this block's are read. Issued
    // all at once (64 prefetches a block for a bf16 head of 64) they filled the core's miss
    // buffers and stalled it until the first ones returned.
    const cache_t* next =
        b + 1 < last_block ? cache + table[b + 1] * B * token_stride + kv_head * D : nullptr;
    if (next != nullptr && scales != nullptr)  // the next block's scales: [B, 2, KVH] floats
      prefetch_bytes(scales + table[b + 1] * B * 2 * s.num_kv_heads,
                     B * 2 * s.num_kv_heads * static_cast<int64_t>(sizeof(float)));
    group_block_scores<cache_t, HEAD_DIM>(qf.data(), G, D, B, block, block_scales, num_tokens,
                                          token_stride, s.num_kv_heads, row.data(),
                                          scores.data(), next);
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores.data() + g * B;
      const float correction = softmax_step(sg, num_tokens, B, m[g], l[g]);
      if (correction != 1.f) scale(correction, acc + g * D, D);
    }
    group_block_values<cache_t, HEAD_DIM>(scores.data(), G, D, B, block + v_offset,
                                          block_scales ? block_scales + s.num_kv_heads : nullptr,
                                          num_tokens, token_stride, s.num_kv_heads, row.data(),
                                          acc, next != nullptr ? next + v_offset : nullptr);
  }
}

// One work item of decode: (sequence, KV head, partition) over its share of the sequence's
// blocks, leaving the partial m [G], l [G], acc [G, D] in `slot`; with one partition it is the
// whole answer and goes straight to out [num_seqs, num_heads, head_dim].
template <typename scalar_t, typename cache_t>
void decode_item(const scalar_t* q_seq, const cache_t* cache, const float* scales,
                 const int64_t* table_seq, int64_t context_len, int64_t seq, int64_t kv_head,
                 int64_t part, float softmax_scale, const Shapes& s, float* slot,
                 scalar_t* out_ptr) {
  const int64_t G = s.group, D = s.head_dim;
  const int64_t num_blocks = (context_len + s.block_size - 1) / s.block_size;
  const int64_t first = part * s.partition_blocks;
  const int64_t last = std::min(num_blocks, first + s.partition_blocks);
  float *m = slot, *l = slot + G, *acc = slot + 2 * G;
  if (first >= last) {  // beyond this sequence's context: an empty partial
    for (int64_t g = 0; g < G; ++g) m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0;
    return;
  }
  if (D == 64) {
    attend_partition<scalar_t, cache_t, 64>(q_seq, cache, scales, table_seq, context_len,
                                            kv_head, first, last, softmax_scale, s, m, l, acc);
  } else if (D == 128) {
    attend_partition<scalar_t, cache_t, 128>(q_seq, cache, scales, table_seq, context_len,
                                             kv_head, first, last, softmax_scale, s, m, l, acc);
  } else {
    attend_partition<scalar_t, cache_t, 0>(q_seq, cache, scales, table_seq, context_len,
                                           kv_head, first, last, softmax_scale, s, m, l, acc);
  }
  if (s.num_partitions == 1) {  // the only partition: normalise and write out now
    std::vector<float> out_row(D);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t d = 0; d < D; ++d) out_row[d] = acc[g * D + d] / l[g];
      store_row(out_row.data(), out_ptr + (seq * s.num_heads + kv_head * G + g) * D, D);
    }
  }
}

// Merges the partitions of one (sequence, KV head): `base` holds its num_partitions partials.
template <typename scalar_t>
void merge_partitions(const float* base, int64_t seq, int64_t kv_head, const Shapes& s,
                      scalar_t* out_ptr) {
  const int64_t G = s.group, D = s.head_dim, P = s.num_partitions, partial = G * (D + 2);
  std::vector<float> merged(D);
  for (int64_t g = 0; g < G; ++g) {
    float global_max = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < P; ++p) global_max = std::max(global_max, base[p * partial + g]);
    std::fill(merged.begin(), merged.end(), 0.f);
    float total = 0.f;
    for (int64_t p = 0; p < P; ++p) {
      const float* slot = base + p * partial;
      if (slot[G + g] == 0.f) continue;  // empty partition
      const float weight = std::exp(slot[g] - global_max);
      total += weight * slot[G + g];
      axpy(weight, slot + 2 * G + g * D, merged.data(), D);
    }
    scale(1.f / total, merged.data(), D);
    store_row(merged.data(), out_ptr + (seq * s.num_heads + kv_head * G + g) * D, D);
  }
}

template <typename scalar_t, typename cache_t = scalar_t>
void decode_impl(const torch::Tensor& q, const torch::Tensor& kv_cache,
                 const torch::Tensor& block_table, const torch::Tensor& context_lens,
                 double softmax_scale, int64_t partition_blocks, torch::Tensor& out,
                 const float* scales = nullptr) {
  Shapes s;
  s.num_seqs = q.size(0);
  s.num_heads = q.size(1);
  s.head_dim = q.size(2);
  s.block_size = kv_cache.size(1);
  s.num_kv_heads = kv_cache.size(3);
  s.group = s.num_heads / s.num_kv_heads;
  s.max_blocks = block_table.size(1);
  s.partition_blocks = partition_blocks;
  s.num_partitions = (s.max_blocks + partition_blocks - 1) / partition_blocks;
  s.q_seq_stride = q.stride(0);
  s.q_head_stride = q.stride(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* cache_ptr = kv_cache.data_ptr<cache_t>();
  const int64_t* table_ptr = block_table.data_ptr<int64_t>();
  const int64_t* lens_ptr = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t P = s.num_partitions;
  const float sm_scale = static_cast<float>(softmax_scale);

  // Partials [seq, kv_head, partition]: m [G], l [G], acc [G, D].
  const int64_t partial = s.group * (s.head_dim + 2);
  std::vector<float> partials(s.num_seqs * s.num_kv_heads * P * partial);
  const int64_t num_items = s.num_seqs * s.num_kv_heads * P;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / (s.num_kv_heads * P);
      decode_item<scalar_t, cache_t>(q_ptr + seq * s.q_seq_stride, cache_ptr, scales,
                                     table_ptr + seq * s.max_blocks, lens_ptr[seq], seq,
                                     (item / P) % s.num_kv_heads, item % P, sm_scale, s,
                                     partials.data() + item * partial, out_ptr);
    }
  });
  if (P == 1) return;
  at::parallel_for(0, s.num_seqs * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair)
      merge_partitions(partials.data() + pair * P * partial, pair / s.num_kv_heads,
                       pair % s.num_kv_heads, s, out_ptr);
  });
}


#if defined(__AVX512F__) || defined(__AVX2__)
// Scores of ROWS query rows (q [ROWS, D]) against one 16-token block (kt [D, 16]): one FMA chain
// per row and vector over d; four rows are independent chains sharing each load of kt, so the
// FMA latency is hidden.
template <int ROWS, int HEAD_DIM>
inline void block_scores_rows(const float* q, int64_t D, const float* kt, float* s) {
  if constexpr (HEAD_DIM > 0) D = HEAD_DIM;
  constexpr int H = 16 / Lanes::kWidth;  // vectors per 16 tokens
  Lanes::V a[ROWS][H];
  for (int j = 0; j < ROWS; ++j)
    for (int h = 0; h < H; ++h) a[j][h] = Lanes::zero();
  for (int64_t d = 0; d < D; ++d) {
    Lanes::V k[H];
    for (int h = 0; h < H; ++h) k[h] = Lanes::load(kt + d * 16 + h * Lanes::kWidth);
    for (int j = 0; j < ROWS; ++j) {
      const Lanes::V qd = Lanes::set1(q[j * D + d]);
      for (int h = 0; h < H; ++h) a[j][h] = Lanes::fmadd(qd, k[h], a[j][h]);
    }
  }
  for (int j = 0; j < ROWS; ++j)
    for (int h = 0; h < H; ++h) Lanes::store(s + 16 * j + h * Lanes::kWidth, a[j][h]);
}
#endif

// Scores of one query row against one block: s[t] = q . k_t for t < B, with the block's K
// transposed to kt [D, B] (zero past the block's tokens), so the loop is a broadcast-FMA over
// the block's tokens with no horizontal sums. B = 16: one AVX-512 register, two AVX2 ones.
template <int HEAD_DIM>
inline void block_scores(const float* q, const float* kt, int64_t D, int64_t B, float* s) {
  if constexpr (HEAD_DIM > 0) D = HEAD_DIM;
#if defined(__AVX512F__) || defined(__AVX2__)
  if (B == 16) return block_scores_rows<1, HEAD_DIM>(q, D, kt, s);
#endif
  std::fill(s, s + B, 0.f);
  for (int64_t d = 0; d < D; ++d) {
    const float qd = q[d];
    const float* row = kt + d * B;
#pragma omp simd
    for (int64_t t = 0; t < B; ++t) s[t] += qd * row[t];
  }
}

// acc [D] += sum over t < n of p[t] * v[t] (v rows [n, D] fp32): the accumulator stays in
// registers across the block's tokens when D is a compile-time multiple of the vector width
// that fits 8 registers (AVX-512: up to 128; AVX2: up to 64).
template <int HEAD_DIM>
inline void block_values(const float* p, const float* v, int64_t n, int64_t D, float* acc) {
#if defined(__AVX512F__) || defined(__AVX2__)
  constexpr int64_t W = Lanes::kWidth;
  if constexpr (HEAD_DIM > 0 && HEAD_DIM % W == 0 && HEAD_DIM / W <= 8) {
    constexpr int R = HEAD_DIM / W;
    Lanes::V a[R];
    for (int j = 0; j < R; ++j) a[j] = Lanes::load(acc + W * j);
    for (int64_t t = 0; t < n; ++t) {
      const Lanes::V weight = Lanes::set1(p[t]);
      const float* row = v + t * HEAD_DIM;
      for (int j = 0; j < R; ++j) a[j] = Lanes::fmadd(weight, Lanes::load(row + W * j), a[j]);
    }
    for (int j = 0; j < R; ++j) Lanes::store(acc + W * j, a[j]);
    return;
  }
#endif
  if constexpr (HEAD_DIM > 0) D = HEAD_DIM;
  for (int64_t t = 0; t < n; ++t) axpy(p[t], v + t * D, acc, D);
}

// Causal attention of one query tile of one extend chunk (prefill after cached tokens) and one
// KV head, over the cache through the sequence's block table. Query i of the tile sits at
// position first_pos + i and attends to cache positions [0, first_pos + i] (its own K/V were
// written to the cache before the call). The tile's rows are (query, group head) pairs; each
// block's K/V rows of the head are widened to fp32 once (K transposed) and used by every row,
// so the work per block is two small matrix products (scores, then values), not dot products.
template <typename scalar_t, int HEAD_DIM>
void extend_tile(const scalar_t* q, int64_t q_row_stride, int64_t q_head_stride,
                 const scalar_t* cache, const int64_t* table, int64_t first_pos,
                 int64_t num_queries, int64_t kv_head, float softmax_scale, const Shapes& s,
                 scalar_t* out, int64_t out_row_stride) {
  const int64_t G = s.group, B = s.block_size;
  const int64_t D = HEAD_DIM > 0 ? HEAD_DIM : s.head_dim;
  const int64_t R = num_queries * G;  // row r = query (r / G), head kv_head * G + r % G
  std::vector<float> qf(R * D), row(D), scores(R * B), m(R), l(R), acc(R * D, 0.f);
  std::vector<float> kt(D * B, 0.f), vf(B * D);
  for (int64_t r = 0; r < R; ++r) {
    const scalar_t* src = q + (r / G) * q_row_stride + (kv_head * G + r % G) * q_head_stride;
    const float* q_row = load_row(src, row.data(), D);
    for (int64_t d = 0; d < D; ++d) qf[r * D + d] = q_row[d] * softmax_scale;
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  const int64_t token_stride = 2 * s.num_kv_heads * D;
  const int64_t v_offset = s.num_kv_heads * D;
  const int64_t last_pos = first_pos + num_queries - 1;
  const int64_t num_blocks = last_pos / B + 1;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t num_tokens = std::min(B, last_pos + 1 - b * B);
    const scalar_t* block = cache + table[b] * B * token_stride + kv_head * D;
    if (b + 1 < num_blocks) {
      prefetch_block(cache + table[b + 1] * B * token_stride + kv_head * D, B, D, token_stride,
                     v_offset);
    }
    for (int64_t t = 0; t < num_tokens; ++t) {
      const float* k = load_row(block + t * token_stride, row.data(), D);
      for (int64_t d = 0; d < D; ++d) kt[d * B + t] = k[d];
      const float* v = load_row(block + t * token_stride + v_offset, vf.data() + t * D, D);
      if (v != vf.data() + t * D) std::memcpy(vf.data() + t * D, v, D * sizeof(float));
    }
    if (num_tokens < B) {  // the last block's tail: zeros, so the score loop stays full width
      for (int64_t d = 0; d < D; ++d) std::fill(&kt[d * B + num_tokens], &kt[d * B + B], 0.f);
    }
    int64_t r = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    if (B == 16) {
      for (; r + 4 <= R; r += 4)
        block_scores_rows<4, HEAD_DIM>(qf.data() + r * D, D, kt.data(), &scores[r * B]);
    }
#endif
    for (; r < R; ++r) block_scores<HEAD_DIM>(qf.data() + r * D, kt.data(), D, B, &scores[r * B]);
    for (r = 0; r < R; ++r) {
      // Keys of this block that row r may see: positions <= its own (causal).
      const int64_t n = std::max<int64_t>(0, std::min(num_tokens, first_pos + r / G - b * B + 1));
      if (n == 0) continue;  // the whole block lies after this query: nothing changes
      float* sr = scores.data() + r * B;
      const float correction = softmax_step(sr, n, B, m[r], l[r]);
      if (correction != 1.f) scale(correction, acc.data() + r * D, D);
      block_values<HEAD_DIM>(sr, vf.data(), n, D, acc.data() + r * D);
    }
  }
  for (int64_t r = 0; r < R; ++r) {  // every row saw key 0, so l[r] > 0
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) row[d] = acc[r * D + d] * inv;
    store_row(row.data(), out + (r / G) * out_row_stride + (kv_head * G + r % G) * D, D);
  }
}

template <typename scalar_t>
void extend_impl(const torch::Tensor& q, const torch::Tensor& kv_cache,
                 const torch::Tensor& block_table, const torch::Tensor& query_starts,
                 const torch::Tensor& query_lens, const torch::Tensor& start_positions,
                 double softmax_scale, int64_t query_tile, torch::Tensor& out) {
  Shapes s;
  s.num_seqs = block_table.size(0);
  s.num_heads = q.size(1);
  s.head_dim = q.size(2);
  s.block_size = kv_cache.size(1);
  s.num_kv_heads = kv_cache.size(3);
  s.group = s.num_heads / s.num_kv_heads;
  s.max_blocks = block_table.size(1);
  s.partition_blocks = 0;
  s.num_partitions = 0;
  s.q_seq_stride = q.stride(0);
  s.q_head_stride = q.stride(1);
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* lens = query_lens.data_ptr<int64_t>();
  const int64_t* positions = start_positions.data_ptr<int64_t>();
  // Work items: (sequence, query tile) pairs, each for every KV head.
  std::vector<int64_t> tile_seq, tile_first;
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    TORCH_CHECK(lens[seq] >= 1 && positions[seq] >= 0 && starts[seq] >= 0 &&
                    starts[seq] + lens[seq] <= q.size(0),
                "extend chunk ", seq, " lies outside q");
    TORCH_CHECK((positions[seq] + lens[seq] + s.block_size - 1) / s.block_size <= s.max_blocks,
                "block_table too narrow for extend chunk ", seq);
    for (int64_t first = 0; first < lens[seq]; first += query_tile) {
      tile_seq.push_back(seq);
      tile_first.push_back(first);
    }
  }
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* cache_ptr = kv_cache.data_ptr<scalar_t>();
  const int64_t* table_ptr = block_table.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t out_row_stride = s.num_heads * s.head_dim;
  const float sm_scale = static_cast<float>(softmax_scale);
  const int64_t num_tiles = static_cast<int64_t>(tile_seq.size());
  at::parallel_for(0, num_tiles * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item / s.num_kv_heads, kv_head = item % s.num_kv_heads;
      const int64_t seq = tile_seq[tile], first = tile_first[tile];
      const int64_t n = std::min(query_tile, lens[seq] - first);
      const int64_t row0 = starts[seq] + first;
      const scalar_t* q_tile = q_ptr + row0 * s.q_seq_stride;
      scalar_t* out_tile = out_ptr + row0 * out_row_stride;
      const int64_t* table_seq = table_ptr + seq * s.max_blocks;
      const int64_t pos = positions[seq] + first;
      if (s.head_dim == 64) {
        extend_tile<scalar_t, 64>(q_tile, s.q_seq_stride, s.q_head_stride, cache_ptr, table_seq,
                                  pos, n, kv_head, sm_scale, s, out_tile, out_row_stride);
      } else if (s.head_dim == 128) {
        extend_tile<scalar_t, 128>(q_tile, s.q_seq_stride, s.q_head_stride, cache_ptr, table_seq,
                                   pos, n, kv_head, sm_scale, s, out_tile, out_row_stride);
      } else {
        extend_tile<scalar_t, 0>(q_tile, s.q_seq_stride, s.q_head_stride, cache_ptr, table_seq,
                                 pos, n, kv_head, sm_scale, s, out_tile, out_row_stride);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// The attention of a fused decode step (engine/kernels/cpu/decode_step.cpp): decode_impl's two
// phases as two tasks, so the bits are decode_impl's. Items of the first: (row, KV head,
// partition), as many partitions as decode_impl would make for the step's block table (the
// step says, in *num_partitions); the item whose partition holds the row's last block first
// writes the new K and V into the cache (no other item reads that slot): copied into a bf16
// cache, quantized into an int8 one (`quantize_row`, the bits of store_kv_int8). The second
// merges each (row, KV head)'s partitions (nothing to do with one). bf16 q; a bf16 cache, or
// int8 codes with their scales.
//
// A step whose rows are consecutive positions of one sequence (a speculative step's
// verification: row j attends to the K and V rows 0..j-1 write) cannot write them inside the
// attention items, which run at once on the threads: such a step says so in num_partitions[2],
// and a task of its own (`store_task`, items: row x KV head) writes every row's K and V first,
// with the same `write_kv`, behind a barrier.

using bf16 = at::BFloat16;

struct DecodeTask {
  const bf16* qkv;  // [rows, (num_heads + 2 * num_kv_heads) * head_dim], RoPE applied
  void* cache;      // [num_kv_blocks, block_size, 2, num_kv_heads, head_dim] bf16 or int8
  float* scales;    // int8 caches: [num_kv_blocks, block_size, 2, num_kv_heads]; else null
  const int64_t* block_table;     // [max_rows, max_blocks]
  const int64_t* context_lens;    // [max_rows]
  const int64_t* slot_mapping;    // [max_rows]
  const int64_t* num_partitions;  // [3]: this step's partitions, blocks per partition, and
                                  // whether store_task wrote the new K and V (1) or not (0)
  float* partials;                // [max_rows, num_kv_heads, max_partitions, G * (D + 2)]
  bf16* out;                      // [rows, num_heads, head_dim]
  Shapes shapes;                  // num_partitions: the most a step may use
  float softmax_scale;
};

Shapes step_shapes(const DecodeTask& t) {
  Shapes s = t.shapes;
  s.num_partitions = t.num_partitions[0];
  s.partition_blocks = t.num_partitions[1];
  return s;
}

// The row's new K and V of one KV head into its slot.
inline void write_kv(const DecodeTask& t, const bf16* k, const bf16* v, int64_t slot,
                     int64_t kv_head, int64_t D, int64_t KVH, bf16* cache) {
  bf16* row = cache + (slot * 2 * KVH + kv_head) * D;
  std::memcpy(row, k, D * sizeof(bf16));
  std::memcpy(row + KVH * D, v, D * sizeof(bf16));
}

inline void write_kv(const DecodeTask& t, const bf16* k, const bf16* v, int64_t slot,
                     int64_t kv_head, int64_t D, int64_t KVH, int8_t* codes) {
  thread_local std::vector<float> buffer;
  buffer.resize(D);
  const int64_t k_row = slot * 2 * KVH + kv_head, v_row = k_row + KVH;
  quantize_row(k, D, buffer.data(), codes + k_row * D, t.scales + k_row);
  quantize_row(v, D, buffer.data(), codes + v_row * D, t.scales + v_row);
}

// Row `row`'s new K and V of one KV head (in its qkv row) into its slot.
template <typename cache_t>
inline void write_row_kv(const DecodeTask& t, const Shapes& s, int64_t row, int64_t kv_head,
                         cache_t* cache) {
  const int64_t D = s.head_dim, KVH = s.num_kv_heads;
  const bf16* q_row = t.qkv + row * s.q_seq_stride;
  write_kv(t, q_row + (s.num_heads + kv_head) * D, q_row + (s.num_heads + KVH + kv_head) * D,
           t.slot_mapping[row], kv_head, D, KVH, cache);
}

template <typename cache_t>
void decode_task(const void* raw, int64_t rows, int64_t begin, int64_t end) {
  const DecodeTask& t = *static_cast<const DecodeTask*>(raw);
  const Shapes s = step_shapes(t);
  const int64_t D = s.head_dim, KVH = s.num_kv_heads, P = s.num_partitions;
  const int64_t partial = s.group * (D + 2);
  cache_t* cache = static_cast<cache_t*>(t.cache);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t row = item / (KVH * P), kv_head = (item / P) % KVH, part = item % P;
    const bf16* q_row = t.qkv + row * s.q_seq_stride;
    const int64_t context_len = t.context_lens[row];
    const int64_t last_block = (context_len - 1) / s.block_size;
    if (t.num_partitions[2] == 0 && part == last_block / s.partition_blocks)
      write_row_kv(t, s, row, kv_head, cache);
    decode_item<bf16, cache_t>(q_row, cache, t.scales, t.block_table + row * s.max_blocks,
                               context_len, row, kv_head, part, t.softmax_scale, s,
                               t.partials + item * partial, t.out);
  }
}

// Items: row x KV head. Each row's new K and V into its slot (steps that set num_partitions[2]).
template <typename cache_t>
void store_task(const void* raw, int64_t rows, int64_t begin, int64_t end) {
  const DecodeTask& t = *static_cast<const DecodeTask*>(raw);
  const int64_t KVH = t.shapes.num_kv_heads;
  cache_t* cache = static_cast<cache_t*>(t.cache);
  for (int64_t item = begin; item < end; ++item)
    write_row_kv(t, t.shapes, item / KVH, item % KVH, cache);
}

void merge_task(const void* raw, int64_t rows, int64_t begin, int64_t end) {
  const DecodeTask& t = *static_cast<const DecodeTask*>(raw);
  const Shapes s = step_shapes(t);
  if (s.num_partitions == 1) return;  // the first phase wrote the output
  const int64_t partial = s.group * (s.head_dim + 2);
  for (int64_t pair = begin; pair < end; ++pair)
    merge_partitions(t.partials + pair * s.num_partitions * partial, pair / s.num_kv_heads,
                     pair % s.num_kv_heads, s, t.out);
}

// qkv [max_rows, (H + 2 KVH) * D] bf16 buffer; cache the layer's pool (bf16, or int8 codes with
// `scales` [num_blocks, block_size, 2, KVH] float32); block_table [max_rows, max_blocks],
// context_lens and slot_mapping [max_rows] int64 buffers; num_partitions [3] int64 (set per
// step: partitions, blocks per partition, K/V written by store_task; the caller keeps
// rows * KVH * partitions within the partials); partials float32
// [max_rows * KVH * max_partitions * G * (D + 2)], max_partitions those of `partition_blocks`;
// out [max_rows, H, D]. Items per run: rows * KVH * partitions, then rows * KVH.
py::capsule decode_task_args(torch::Tensor qkv, torch::Tensor cache, float* scales,
                             torch::Tensor block_table, torch::Tensor context_lens,
                             torch::Tensor slot_mapping, torch::Tensor num_partitions,
                             torch::Tensor partials, torch::Tensor out, int64_t num_heads,
                             int64_t partition_blocks, double softmax_scale) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "decode task: bf16 qkv and out");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && cache.dim() == 5 &&
                  cache.is_contiguous() && out.is_contiguous() && out.dim() == 3,
              "decode task: qkv [rows, width], kv_cache 5-d contiguous, out [rows, heads, dim]");
  for (const auto* x : {&block_table, &context_lens, &slot_mapping, &num_partitions})
    TORCH_CHECK(x->scalar_type() == at::kLong && x->is_contiguous(),
                "decode task: block_table, context_lens, slot_mapping, num_partitions "
                "contiguous int64");
  TORCH_CHECK(num_partitions.numel() >= 3,
              "decode task: num_partitions holds (partitions, blocks per partition, K/V stored "
              "by store_task)");
  Shapes s;
  s.num_seqs = out.size(0);
  s.num_heads = num_heads;
  s.num_kv_heads = cache.size(3);
  s.head_dim = cache.size(4);
  s.block_size = cache.size(1);
  TORCH_CHECK(num_heads % s.num_kv_heads == 0 && out.size(1) == num_heads &&
                  out.size(2) == s.head_dim &&
                  qkv.size(1) == (num_heads + 2 * s.num_kv_heads) * s.head_dim,
              "decode task: head counts of qkv, cache and out differ");
  TORCH_CHECK(partition_blocks >= 1, "decode task: partition_blocks must be >= 1");
  s.group = num_heads / s.num_kv_heads;
  s.max_blocks = block_table.size(1);
  s.partition_blocks = partition_blocks;
  s.num_partitions = (s.max_blocks + partition_blocks - 1) / partition_blocks;
  s.q_seq_stride = qkv.stride(0);
  s.q_head_stride = s.head_dim;
  TORCH_CHECK(partials.scalar_type() == at::kFloat && partials.is_contiguous() &&
                  partials.numel() >= s.num_seqs * s.num_kv_heads * s.num_partitions *
                                          s.group * (s.head_dim + 2),
              "decode task: partials too small for max_rows x KV heads x partitions");
  auto* task = new DecodeTask{qkv.data_ptr<bf16>(), cache.data_ptr(), scales,
                              block_table.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                              slot_mapping.data_ptr<int64_t>(), num_partitions.data_ptr<int64_t>(),
                              partials.data_ptr<float>(), out.data_ptr<bf16>(), s,
                              static_cast<float>(softmax_scale)};
  return py::capsule(task, "mini_infer.task_args",
                     [](void* p) { delete static_cast<DecodeTask*>(p); });
}

py::capsule make_decode_task(torch::Tensor qkv, torch::Tensor kv_cache, torch::Tensor block_table,
                             torch::Tensor context_lens, torch::Tensor slot_mapping,
                             torch::Tensor num_partitions, torch::Tensor partials,
                             torch::Tensor out, int64_t num_heads, int64_t partition_blocks,
                             double softmax_scale) {
  TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16, "decode task: a bf16 cache");
  return decode_task_args(qkv, kv_cache, nullptr, block_table, context_lens, slot_mapping,
                          num_partitions, partials, out, num_heads, partition_blocks,
                          softmax_scale);
}

// The same over the int8 cache: codes [num_blocks, block_size, 2, KVH, D] int8 and scales
// [num_blocks, block_size, 2, KVH] float32, both contiguous.
py::capsule make_decode_task_int8(torch::Tensor qkv, torch::Tensor codes, torch::Tensor scales,
                                  torch::Tensor block_table, torch::Tensor context_lens,
                                  torch::Tensor slot_mapping, torch::Tensor num_partitions,
                                  torch::Tensor partials, torch::Tensor out, int64_t num_heads,
                                  int64_t partition_blocks, double softmax_scale) {
  TORCH_CHECK(codes.dim() == 5 && scales.dim() == 4 && codes.scalar_type() == at::kChar &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.sizes() == codes.sizes().slice(0, 4),
              "decode task: int8 codes [blocks, block_size, 2, heads, head_dim] and contiguous "
              "float32 scales shaped like them without head_dim");
  return decode_task_args(qkv, codes, scales.data_ptr<float>(), block_table, context_lens,
                          slot_mapping, num_partitions, partials, out, num_heads,
                          partition_blocks, softmax_scale);
}

}  // namespace

// q [num_seqs, num_heads, head_dim] (rows and heads may be strided, head_dim contiguous);
// kv_cache [num_blocks, block_size, 2, num_kv_heads, head_dim] contiguous; block_table
// [num_seqs, max_blocks] int64; context_lens [num_seqs] int64 (>= 1); out like q, contiguous.
void paged_attention_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                            torch::Tensor context_lens, double softmax_scale,
                            int64_t partition_blocks, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "q must be 3-d and kv_cache 5-d");
  TORCH_CHECK(q.stride(2) == 1 && kv_cache.is_contiguous() && out.is_contiguous(),
              "head_dim must be contiguous, kv_cache and out contiguous");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, kv_cache and out must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_table and context_lens must be int64");
  TORCH_CHECK(block_table.is_contiguous() && context_lens.is_contiguous(),
              "block_table and context_lens must be contiguous");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.size(2) == kv_cache.size(4), "head_dim of q and kv_cache differ");
  TORCH_CHECK(partition_blocks >= 1, "partition_blocks must be >= 1");
  if (q.size(0) == 0) return;
  if (q.scalar_type() == at::kFloat) {
    decode_impl<float>(q, kv_cache, block_table, context_lens, softmax_scale, partition_blocks,
                       out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_impl<at::BFloat16>(q, kv_cache, block_table, context_lens, softmax_scale,
                              partition_blocks, out);
  } else {
    TORCH_CHECK(false, "paged_attention_decode supports float32 and bfloat16, got ",
                q.scalar_type());
  }
}

// The same over the int8 KV cache: codes [num_blocks, block_size, 2, num_kv_heads, head_dim]
// int8 and scales [num_blocks, block_size, 2, num_kv_heads] float32, both contiguous; each K/V
// row is dequantized (codes x scale, in fp32) as it is read.
void paged_attention_decode_int8(torch::Tensor q, torch::Tensor codes, torch::Tensor scales,
                                 torch::Tensor block_table, torch::Tensor context_lens,
                                 double softmax_scale, int64_t partition_blocks,
                                 torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && codes.dim() == 5 && scales.dim() == 4,
              "q must be 3-d, codes 5-d and scales 4-d");
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
              "codes must be int8 and scales float32");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() &&
                  scales.sizes() == codes.sizes().slice(0, 4),
              "codes and scales must be contiguous, scales shaped like codes without head_dim");
  TORCH_CHECK(q.stride(2) == 1 && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "head_dim of q must be contiguous; out contiguous, of q's dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  block_table.is_contiguous() && context_lens.is_contiguous(),
              "block_table and context_lens must be contiguous int64");
  TORCH_CHECK(q.size(1) % codes.size(3) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.size(2) == codes.size(4), "head_dim of q and the cache differ");
  TORCH_CHECK(partition_blocks >= 1, "partition_blocks must be >= 1");
  if (q.size(0) == 0) return;
  const float* scales_ptr = scales.data_ptr<float>();
  if (q.scalar_type() == at::kFloat) {
    decode_impl<float, int8_t>(q, codes, block_table, context_lens, softmax_scale,
                               partition_blocks, out, scales_ptr);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_impl<at::BFloat16, int8_t>(q, codes, block_table, context_lens, softmax_scale,
                                      partition_blocks, out, scales_ptr);
  } else {
    TORCH_CHECK(false, "paged_attention_decode_int8 supports float32 and bfloat16 q, got ",
                q.scalar_type());
  }
}

// Store new K/V rows into the int8 KV cache (`quantize_row`: kv_int8.quantize_kv's bits). kv
// [n, 2, num_kv_heads, head_dim] float32 or bfloat16, contiguous; slots [n] int64, every one
// checked against the pool before anything is written; codes [num_blocks, block_size, 2,
// num_kv_heads, head_dim] int8, scales [num_blocks, block_size, 2, num_kv_heads] float32. One
// thread: a step's rows are a few thousand values, less than waking a second thread costs.
template <typename T>
void store_int8_impl(const T* kv, const int64_t* slots, int64_t n, int64_t rows_per_token,
                     int64_t head_dim, int8_t* codes, float* scales) {
  std::vector<float> buffer(head_dim);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t r = 0; r < rows_per_token; ++r) {
      const int64_t row = slots[t] * rows_per_token + r;
      quantize_row(kv + (t * rows_per_token + r) * head_dim, head_dim, buffer.data(),
                   codes + row * head_dim, scales + row);
    }
  }
}

void store_kv_int8(torch::Tensor kv, torch::Tensor slots, torch::Tensor codes,
                   torch::Tensor scales) {
  TORCH_CHECK(kv.dim() == 4 && kv.size(1) == 2 && kv.is_contiguous(),
              "kv must be contiguous [num_tokens, 2, num_kv_heads, head_dim]");
  TORCH_CHECK(codes.dim() == 5 && scales.dim() == 4 && codes.is_contiguous() &&
                  scales.is_contiguous() && codes.scalar_type() == at::kChar &&
                  scales.scalar_type() == at::kFloat && scales.sizes() == codes.sizes().slice(0, 4),
              "codes must be contiguous int8 [blocks, block_size, 2, heads, head_dim] and scales "
              "contiguous float32 shaped like codes without head_dim");
  TORCH_CHECK(codes.size(2) == 2 && codes.size(3) == kv.size(2) && codes.size(4) == kv.size(3),
              "kv's heads and head_dim differ from the cache's");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) == kv.size(0),
              "slots must be contiguous int64, one per token of kv");
  const int64_t n = kv.size(0), num_slots = codes.size(0) * codes.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " outside the pool of ",
                num_slots);
  }
  const int64_t rows_per_token = 2 * kv.size(2), head_dim = kv.size(3);
  int8_t* codes_ptr = codes.data_ptr<int8_t>();
  float* scales_ptr = scales.data_ptr<float>();
  if (kv.scalar_type() == at::kFloat) {
    store_int8_impl(kv.data_ptr<float>(), slot, n, rows_per_token, head_dim, codes_ptr,
                    scales_ptr);
  } else if (kv.scalar_type() == at::kBFloat16) {
    store_int8_impl(kv.data_ptr<at::BFloat16>(), slot, n, rows_per_token, head_dim, codes_ptr,
                    scales_ptr);
  } else {
    TORCH_CHECK(false, "store_kv_int8 supports float32 and bfloat16 kv, got ", kv.scalar_type());
  }
}

// Extend (prefill after cached tokens): q [num_tokens, num_heads, head_dim] (strided like the
// decode q); chunk i is q rows [query_starts[i], + query_lens[i]) at positions
// start_positions[i] + 0.., attending causally to the cache through block_table [num_chunks,
// max_blocks] (its own new K/V already written). Writes those rows of out [num_tokens,
// num_heads, head_dim] (contiguous) and no others.
void paged_attention_extend(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                            torch::Tensor query_starts, torch::Tensor query_lens,
                            torch::Tensor start_positions, double softmax_scale,
                            int64_t query_tile, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && block_table.dim() == 2,
              "q must be 3-d, kv_cache 5-d and block_table 2-d");
  TORCH_CHECK(q.stride(2) == 1 && kv_cache.is_contiguous() && out.is_contiguous(),
              "head_dim must be contiguous, kv_cache and out contiguous");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, kv_cache and out must share a dtype");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  for (const auto* t : {&block_table, &query_starts, &query_lens, &start_positions}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "block_table, query_starts, query_lens and start_positions must be contiguous "
                "int64");
  }
  const int64_t num_chunks = block_table.size(0);
  TORCH_CHECK(query_starts.numel() == num_chunks && query_lens.numel() == num_chunks &&
                  start_positions.numel() == num_chunks,
              "one query start, length and start position per block-table row");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.size(2) == kv_cache.size(4), "head_dim of q and kv_cache differ");
  TORCH_CHECK(query_tile >= 1, "query_tile must be >= 1");
  if (num_chunks == 0) return;
  if (q.scalar_type() == at::kFloat) {
    extend_impl<float>(q, kv_cache, block_table, query_starts, query_lens, start_positions,
                       softmax_scale, query_tile, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    extend_impl<at::BFloat16>(q, kv_cache, block_table, query_starts, query_lens,
                              start_positions, softmax_scale, query_tile, out);
  } else {
    TORCH_CHECK(false, "paged_attention_extend supports float32 and bfloat16, got ",
                q.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode,
        "Paged decode attention over the block pool, in place (GQA, online softmax)");
  m.def("paged_attention_decode_int8", &paged_attention_decode_int8,
        "Paged decode attention over the int8 KV cache (codes x per-token scales), in place");
  m.def("store_kv_int8", &store_kv_int8,
        "Quantize new K/V rows to the int8 cache at their slots (kv_int8.quantize_kv's bits)");
  m.def("paged_attention_extend", &paged_attention_extend,
        "Causal extend (prefill after cached tokens) attention over the block pool, in place");
  m.def("decode_task_fn", [] {
    return py::capsule(reinterpret_cast<void*>(&decode_task<bf16>), "mini_infer.task_fn");
  });
  m.def("decode_task_int8_fn", [] {
    return py::capsule(reinterpret_cast<void*>(&decode_task<int8_t>), "mini_infer.task_fn");
  });
  m.def("store_task_fn", [] {
    return py::capsule(reinterpret_cast<void*>(&store_task<bf16>), "mini_infer.task_fn");
  });
  m.def("store_task_int8_fn", [] {
    return py::capsule(reinterpret_cast<void*>(&store_task<int8_t>), "mini_infer.task_fn");
  });
  m.def("merge_task_fn", [] {
    return py::capsule(reinterpret_cast<void*>(&merge_task), "mini_infer.task_fn");
  });
  m.def("make_decode_task", &make_decode_task,
        "a fused decode step's K/V write + attention (items: row x KV head x partition), and "
        "the arguments of its merge (items: row x KV head)");
  m.def("make_decode_task_int8", &make_decode_task_int8,
        "the same over the int8 cache (codes and scales): new K/V rows quantized as "
        "store_kv_int8 does");
}
