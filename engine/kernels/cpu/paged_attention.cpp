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
template <typename scalar_t, int HEAD_DIM>
void attend_partition(const scalar_t* q, const scalar_t* cache, const int64_t* table,
                      int64_t context_len, int64_t kv_head, int64_t first_block,
                      int64_t last_block, float softmax_scale, const Shapes& s, float* m,
                      float* l, float* acc) {
  const int64_t G = s.group, B = s.block_size;
  const int64_t D = HEAD_DIM > 0 ? HEAD_DIM : s.head_dim;
  std::vector<float> qf(G * D), row(D), scores(G * B);
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
    const scalar_t* block = cache + table[b] * B * token_stride + kv_head * D;
    if (b + 1 < last_block) {
      // Blocks lie anywhere in the pool, so the hardware prefetcher cannot follow the table:
      // fetch the next block's K/V rows of this head while this block is computed.
      const char* next =
          reinterpret_cast<const char*>(cache + table[b + 1] * B * token_stride + kv_head * D);
      const int64_t row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
      for (int64_t t = 0; t < B; ++t) {
        for (int64_t offset = 0; offset < row_bytes; offset += 64) {
          __builtin_prefetch(next + t * token_stride * sizeof(scalar_t) + offset);
          __builtin_prefetch(next + (t * token_stride + v_offset) * sizeof(scalar_t) + offset);
        }
      }
    }
    for (int64_t t = 0; t < num_tokens; ++t) {
      const float* k = load_row(block + t * token_stride, row.data(), D);
      for (int64_t g = 0; g < G; ++g) scores[g * B + t] = dot(qf.data() + g * D, k, D);
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores.data() + g * B;
      float block_max = *std::max_element(sg, sg + num_tokens);
      float new_max = std::max(m[g], block_max);
      float correction = std::exp(m[g] - new_max);  // 0 on the first block (m = -inf)
      float sum = 0.f;
      for (int64_t t = 0; t < num_tokens; ++t) {
        sg[t] = std::exp(sg[t] - new_max);
        sum += sg[t];
      }
      l[g] = l[g] * correction + sum;
      m[g] = new_max;
      if (correction != 1.f) scale(correction, acc + g * D, D);
    }
    for (int64_t t = 0; t < num_tokens; ++t) {
      const float* v = load_row(block + t * token_stride + v_offset, row.data(), D);
      for (int64_t g = 0; g < G; ++g) axpy(scores[g * B + t], v, acc + g * D, D);
    }
  }
}

template <typename scalar_t>
void decode_impl(const torch::Tensor& q, const torch::Tensor& kv_cache,
                 const torch::Tensor& block_table, const torch::Tensor& context_lens,
                 double softmax_scale, int64_t partition_blocks, torch::Tensor& out) {
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
  const scalar_t* cache_ptr = kv_cache.data_ptr<scalar_t>();
  const int64_t* table_ptr = block_table.data_ptr<int64_t>();
  const int64_t* lens_ptr = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t G = s.group, D = s.head_dim, P = s.num_partitions;
  const float sm_scale = static_cast<float>(softmax_scale);

  // Partials [seq, kv_head, partition]: m [G], l [G], acc [G, D].
  const int64_t partial = G * (D + 2);
  std::vector<float> partials(s.num_seqs * s.num_kv_heads * P * partial);
  const int64_t num_items = s.num_seqs * s.num_kv_heads * P;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out_row(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / (s.num_kv_heads * P);
      const int64_t kv_head = (item / P) % s.num_kv_heads;
      const int64_t part = item % P;
      const int64_t context_len = lens_ptr[seq];
      const int64_t num_blocks = (context_len + s.block_size - 1) / s.block_size;
      const int64_t first = part * partition_blocks;
      const int64_t last = std::min(num_blocks, first + partition_blocks);
      float* slot = partials.data() + item * partial;
      float *m = slot, *l = slot + G, *acc = slot + 2 * G;
      if (first >= last) {  // beyond this sequence's context: an empty partial
        for (int64_t g = 0; g < G; ++g) m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0;
        continue;
      }
      const scalar_t* q_seq = q_ptr + seq * s.q_seq_stride;
      const int64_t* table_seq = table_ptr + seq * s.max_blocks;
      if (D == 64) {
        attend_partition<scalar_t, 64>(q_seq, cache_ptr, table_seq, context_len, kv_head, first,
                                       last, sm_scale, s, m, l, acc);
      } else if (D == 128) {
        attend_partition<scalar_t, 128>(q_seq, cache_ptr, table_seq, context_len, kv_head, first,
                                        last, sm_scale, s, m, l, acc);
      } else {
        attend_partition<scalar_t, 0>(q_seq, cache_ptr, table_seq, context_len, kv_head, first,
                                      last, sm_scale, s, m, l, acc);
      }
      if (P == 1) {  // the only partition: normalise and write out now
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t d = 0; d < D; ++d) out_row[d] = acc[g * D + d] / l[g];
          store_row(out_row.data(), out_ptr + (seq * s.num_heads + kv_head * G + g) * D, D);
        }
      }
    }
  });
  if (P == 1) return;
  // Merge the partitions of each (sequence, KV head).
  at::parallel_for(0, s.num_seqs * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(D);
    for (int64_t pair = begin; pair < end; ++pair) {
      const float* base = partials.data() + pair * P * partial;
      const int64_t seq = pair / s.num_kv_heads, kv_head = pair % s.num_kv_heads;
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
  });
}


// Causal attention of one query tile of one extend chunk (prefill after cached tokens) and one
// KV head, over the cache through the sequence's block table. Query i of the tile sits at
// position first_pos + i and attends to cache positions [0, first_pos + i] (its own K/V were
// written to the cache before the call). The tile's rows are (query, group head) pairs, so
// each K/V row is loaded (and widened) once per tile and group, then used by every row.
template <typename scalar_t, int HEAD_DIM>
void extend_tile(const scalar_t* q, int64_t q_row_stride, int64_t q_head_stride,
                 const scalar_t* cache, const int64_t* table, int64_t first_pos,
                 int64_t num_queries, int64_t kv_head, float softmax_scale, const Shapes& s,
                 scalar_t* out, int64_t out_row_stride) {
  const int64_t G = s.group, B = s.block_size;
  const int64_t D = HEAD_DIM > 0 ? HEAD_DIM : s.head_dim;
  const int64_t R = num_queries * G;  // row r = query (r / G), head kv_head * G + r % G
  std::vector<float> qf(R * D), row(D), scores(R * B), m(R), l(R), acc(R * D, 0.f);
  std::vector<int64_t> valid(R);
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
    if (b + 1 < num_blocks) {  // scattered blocks: prefetch the next one (see attend_partition)
      const char* next =
          reinterpret_cast<const char*>(cache + table[b + 1] * B * token_stride + kv_head * D);
      const int64_t row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
      for (int64_t t = 0; t < B; ++t) {
        for (int64_t offset = 0; offset < row_bytes; offset += 64) {
          __builtin_prefetch(next + t * token_stride * sizeof(scalar_t) + offset);
          __builtin_prefetch(next + (t * token_stride + v_offset) * sizeof(scalar_t) + offset);
        }
      }
    }
    // Keys of this block that row r may see: positions <= its own (causal).
    for (int64_t r = 0; r < R; ++r) {
      valid[r] = std::max<int64_t>(0, std::min(num_tokens, first_pos + r / G - b * B + 1));
    }
    for (int64_t t = 0; t < num_tokens; ++t) {
      const float* k = load_row(block + t * token_stride, row.data(), D);
      for (int64_t r = 0; r < R; ++r) {
        if (t < valid[r]) scores[r * B + t] = dot(qf.data() + r * D, k, D);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = valid[r];
      if (n == 0) continue;  // the whole block lies after this query: nothing changes
      float* sr = scores.data() + r * B;
      const float new_max = std::max(m[r], *std::max_element(sr, sr + n));
      const float correction = std::exp(m[r] - new_max);  // 0 on the first block (m = -inf)
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        sr[t] = std::exp(sr[t] - new_max);
        sum += sr[t];
      }
      l[r] = l[r] * correction + sum;
      m[r] = new_max;
      if (correction != 1.f) scale(correction, acc.data() + r * D, D);
    }
    for (int64_t t = 0; t < num_tokens; ++t) {
      const float* v = load_row(block + t * token_stride + v_offset, row.data(), D);
      for (int64_t r = 0; r < R; ++r) {
        if (t < valid[r]) axpy(scores[r * B + t], v, acc.data() + r * D, D);
      }
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
  m.def("paged_attention_extend", &paged_attention_extend,
        "Causal extend (prefill after cached tokens) attention over the block pool, in place");
}
