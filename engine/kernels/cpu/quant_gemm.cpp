// Quantized GEMV / small GEMM (1..~8 activation rows) for weight-only int4 and int8.
//
// Weight layout (packed once at load by quant_gemm.py): output channels in blocks of 16, and
// within a block the 16 channels' codes for one input position side by side, so one vector
// lane is one output channel and the weight stream is read strictly in order:
//   int4: codes uint8 [blocks, K/2, 16]: byte j of entry p holds channel 16b+j's codes for
//         inputs 2p (low nibble) and 2p+1 (high nibble);
//         scale_min float16 [blocks, K/group, 2, 16]: (scale, minimum) of each channel's group
//         (fp16 as in GGUF's Q4_1: 0.625 bytes per weight instead of 0.75 with fp32 pairs;
//         the quantizer rounds them to fp16, so the reference has the same values).
//   int8: codes int8 [blocks, K, 16]; scale float32 [blocks * 16].
// Out-of-range channels of the last block are zero codes with zero scales; their results are
// never stored.
//
// Math (the same as engine/quant/primitives.py's reference, only summed in another order):
//   int4: y[r, o] = sum_g ( s[o,g] * sum_{k in g} q[o,k] x[r,k]  +  m[o,g] * sum_{k in g} x[r,k] )
//   int8: y[r, o] = s[o] * sum_k q[o,k] x[r,k]
// Codes are widened to fp32 in registers and multiplied with fp32 activations (bf16 inputs are
// widened once per call); accumulation is fp32; bf16 outputs are rounded to nearest even.
//
// Instruction sets: AVX-512 (16 lanes = one block; with AVX-512 BF16, int4 x bf16 uses
// vdpbf16ps; with VNNI, int8 activations), AVX2 (two 8-lane halves; or int8 activations with
// vpmaddubsw) and a scalar fallback, all compiled into one library (function-level target
// attributes) and chosen per call by the `isa` argument, so every path can be forced and tested
// on any CPU that runs it.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv_prefetch.h"

namespace {

constexpr int64_t kBlock = 16;  // output channels per block (one AVX-512 vector of fp32)
// The numbers are quant_gemm.py's `_ISA_CODE` (kAvx2Int8 came last, so the others kept theirs).
enum Isa : int64_t {
  kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAvx512Vnni = 4, kAvx2Int8 = 5
};
inline bool is_avx512(int64_t isa) {
  return isa == kAvx512 || isa == kAvx512Bf16 || isa == kAvx512Vnni;
}
// The paths that quantize bf16 activations to int8 per chunk of 32 inputs.
inline bool is_int8_activation(int64_t isa) { return isa == kAvx512Vnni || isa == kAvx2Int8; }
constexpr int64_t kChunk = 32;  // activations quantized to int8 per chunk of 32 inputs (int8 paths)
// Activations per thread's share where a many-row call prepares its activations over torch's
// threads: below this, waking the second thread cost more than the work.
constexpr int64_t kSplitRowsElements = 1 << 17;

struct Problem {
  int64_t rows, in_features, out_features, num_blocks, group_size, num_groups;
  const float* x;     // [rows, K] fp32
  const float* xsum;  // int4: [rows, num_groups] sums of x over each group
  const uint16_t* xbf;  // the bf16 activations [rows, K] when x is bf16 (else nullptr)
  void* y;            // [rows, out_features], float32 or bfloat16 (out_bf16)
  bool out_bf16;
  // The VNNI path's quantized activations (quantize_rows): codes [rows, K], one scale and one
  // code sum per row and chunk of 32 inputs.
  const int8_t* xq = nullptr;
  const float* xd = nullptr;
  const int32_t* xqsum = nullptr;
};

inline float half_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// y[index] = value, rounded to nearest even when y is bf16.
inline void put(const Problem& p, int64_t index, float value) {
  if (p.out_bf16) static_cast<at::BFloat16*>(p.y)[index] = static_cast<at::BFloat16>(value);
  else static_cast<float*>(p.y)[index] = value;
}

#define VNNI_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,fma")))

// Activations to int8 for the VNNI path, per row and chunk of 32 inputs, symmetric:
// d = max|x| / 127, q = round_half_even(x * (127 / max|x|)) (engine/kernels/cpu/quant_gemm.py's
// `quantize_activations` is the reference). With `pair_order` (int4) each 8 inputs are stored
// even ones first, [x0 x2 x4 x6 x1 x3 x5 x7], the order of the low and high nibbles of the
// weights' bytes. xq [rows, K], xd and xqsum [rows, K / 32]. Vectorised: at 32 rows of 1536
// inputs a scalar loop (nearbyintf calls) cost as much as the GEMV it feeds.
// 16 activations as fp32, from fp32 or from bf16 (bits << 16: exact).
VNNI_TARGET inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
VNNI_TARGET inline __m512 load16(const uint16_t* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}

// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)): group_sums' final sum of its eight running
// sums, the same additions (a sum of two is the same bits either way round). AVX only: the
// VNNI and the AVX2 quantizations both call it.
__attribute__((target("avx"))) inline float sum8_as_group_sums(__m256 v) {
  const __m256 pairs = _mm256_add_ps(v, _mm256_permute_ps(v, 0b10110001));        // v0+v1, v2+v3
  const __m256 quads = _mm256_add_ps(pairs, _mm256_permute_ps(pairs, 0b01001110));  // (..)+(..)
  return _mm_cvtss_f32(
      _mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}

// Chunk `c` of a row (its 32 inputs as four 8-float slices, in input order) into the row's
// running group sums; at a group's last chunk, the group's sum (group_sums' bits) into
// row_sums[group], and the next group starts from zero. chunks_per_group = group_size / kChunk.
__attribute__((target("avx"))) inline void add_chunk_to_group_sums(
    __m256& running, const __m256 (&slices)[4], int64_t c, int64_t chunks_per_group,
    float* row_sums) {
  for (int i = 0; i < 4; ++i) running = _mm256_add_ps(running, slices[i]);
  if ((c + 1) % chunks_per_group == 0) {
    row_sums[c / chunks_per_group] = sum8_as_group_sums(running);
    running = _mm256_setzero_ps();
  }
}

// With `xsum` (int4 weights: [rows, K / group_size], group_size a multiple of kChunk), each
// group's activation sum as group_sums makes it, bit for bit (eight running sums over the
// group's inputs in order, then sum8_as_group_sums), from the fp32 values the chunk's
// quantization has loaded anyway: a W2 step of the 135M model spent 0.3 of its 0.85 ms of
// preparation in a second pass for them (loadtest/JOURNAL.md, forty-first session).
template <typename T>  // float or bf16 bits (uint16_t): the same values give the same codes
VNNI_TARGET void quantize_rows(const T* x, int64_t rows, int64_t k, bool pair_order,
                               int8_t* xq, float* xd, int32_t* xqsum, float* xsum = nullptr,
                               int64_t group_size = 0) {
  const int64_t chunks_per_group = xsum != nullptr ? group_size / kChunk : 0;
  alignas(32) uint8_t order[32];
  for (int i = 0; i < 32; ++i) order[i] = static_cast<uint8_t>((i & ~7) + ((i & 7) < 4 ? 2 * (i & 7) : 2 * (i & 7) - 7));
  const __m256i permute = _mm256_load_si256(reinterpret_cast<const __m256i*>(order));
  const int64_t num_chunks = k / kChunk;
  for (int64_t r = 0; r < rows; ++r) {
    __m256 running = _mm256_setzero_ps();
    for (int64_t c = 0; c < num_chunks; ++c) {
      const T* xc = x + r * k + c * kChunk;
      const __m512 a = load16(xc), b = load16(xc + 16);
      if (chunks_per_group > 0) {
        const __m256 slices[4] = {_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1),
                                  _mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1)};
        add_chunk_to_group_sums(running, slices, c, chunks_per_group,
                                xsum + r * (num_chunks / chunks_per_group));
      }
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      // Rounded to nearest even (the default MXCSR mode); |q| <= 127, so the narrowing is exact.
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
      __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(qa)),
                                          _mm512_cvtepi32_epi8(qb), 1);
      if (pair_order) q = _mm256_permutexvar_epi8(permute, q);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * k + c * kChunk), q);
      xd[r * num_chunks + c] = amax / 127.f;
      xqsum[r * num_chunks + c] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
  }
}

// The activations' sum over each group of `group_size` inputs ([rows, K / group_size]; the
// int4 minimum's term), from fp32 or bf16 bits. Eight running sums in a fixed order, so it
// vectorizes without reassociation and every caller gets the same bits from the same values.
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

template <typename T>
void group_sums(const T* x, int64_t rows, int64_t k, int64_t group_size, float* out) {
  const int64_t num_groups = k / group_size;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const T* xg = x + r * k + g * group_size;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t i = 0; i < group_size; i += 8)  // group sizes are multiples of 8
        for (int j = 0; j < 8; ++j) acc[j] += to_f32(xg[i + j]);
      out[r * num_groups + g] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
                                ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Portable scalar path.

void int4_portable(const Problem& p, const uint8_t* codes, const uint16_t* scale_min, int64_t b0,
                   int64_t b1) {
  const int64_t half_k = p.in_features / 2, gs2 = p.group_size / 2;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* cb = codes + b * half_k * kBlock;
    const uint16_t* smb = scale_min + b * p.num_groups * 2 * kBlock;
    const int64_t lanes = std::min(kBlock, p.out_features - b * kBlock);
    for (int64_t r = 0; r < p.rows; ++r) {
      const float* x = p.x + r * p.in_features;
      for (int64_t j = 0; j < lanes; ++j) {
        float total = 0.f;
        for (int64_t g = 0; g < p.num_groups; ++g) {
          float acc = 0.f;
          for (int64_t e = g * gs2; e < (g + 1) * gs2; ++e) {
            const uint8_t byte = cb[e * kBlock + j];
            acc += static_cast<float>(byte & 15) * x[2 * e];
            acc += static_cast<float>(byte >> 4) * x[2 * e + 1];
          }
          const uint16_t* sm = smb + g * 2 * kBlock;
          total += half_to_float(sm[j]) * acc +
                   half_to_float(sm[kBlock + j]) * p.xsum[r * p.num_groups + g];
        }
        put(p, r * p.out_features + b * kBlock + j, total);
      }
    }
  }
}

void int8_portable(const Problem& p, const int8_t* codes, const float* scale, int64_t b0,
                   int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* cb = codes + b * p.in_features * kBlock;
    const int64_t lanes = std::min(kBlock, p.out_features - b * kBlock);
    for (int64_t r = 0; r < p.rows; ++r) {
      const float* x = p.x + r * p.in_features;
      for (int64_t j = 0; j < lanes; ++j) {
        float acc = 0.f;
        for (int64_t k = 0; k < p.in_features; ++k) acc += cb[k * kBlock + j] * x[k];
        put(p, r * p.out_features + b * kBlock + j, scale[b * kBlock + j] * acc);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512: one block = one vector of 16 channels. R rows at a time (R <= 8), each with U
// independent accumulators so that the FMA latency (4 cycles) does not serialise one row.

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// Store the first lanes (mask) of v at y[index...], as fp32 or rounded to nearest-even bf16.
// Unlike put and store8 it does not map a NaN to 0x7FC0, and needs not: bf16 outputs come from
// bf16 activations, so a NaN here is an input's (low 16 bits zero) or the default NaN
// (0xFFC00000), and the rounding's carry cannot reach the exponent of either: a NaN stays NaN.
AVX512_TARGET inline void store16(const Problem& p, int64_t index, __mmask16 mask, __m512 v) {
  if (!p.out_bf16) {
    _mm512_mask_storeu_ps(static_cast<float*>(p.y) + index, mask, v);
    return;
  }
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  _mm256_mask_storeu_epi16(static_cast<at::BFloat16*>(p.y) + index, mask,
                           _mm512_cvtepi32_epi16(rounded));
}

// 16 fp16 values (an int4 block's scales or minimums of one group) as fp32.
AVX512_TARGET inline __m512 load_halves16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int R>
AVX512_TARGET void int4_block_avx512(const Problem& p, const uint8_t* cb, const uint16_t* smb,
                                     int64_t row0, int64_t col0, int64_t lanes) {
  constexpr int U = R <= 2 ? 4 : 2;
  const __m512i low4 = _mm512_set1_epi32(15);
  const int64_t gs2 = p.group_size / 2;
  const float* x = p.x + row0 * p.in_features;
  const float* xsum = p.xsum + row0 * p.num_groups;
  __m512 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.num_groups; ++g) {
    __m512 acc[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
    const uint8_t* c = cb + g * gs2 * kBlock;
    const float* xg = x + g * p.group_size;
    for (int64_t e = 0; e < gs2; e += U / 2) {
#pragma GCC unroll 4
      for (int h = 0; h < U / 2; ++h) {
        const __m512i w = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + (e + h) * kBlock)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(w, low4));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
        const int64_t k = 2 * (e + h);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          acc[r][2 * h] =
              _mm512_fmadd_ps(lo, _mm512_set1_ps(xg[r * p.in_features + k]), acc[r][2 * h]);
          acc[r][2 * h + 1] =
              _mm512_fmadd_ps(hi, _mm512_set1_ps(xg[r * p.in_features + k + 1]), acc[r][2 * h + 1]);
        }
      }
    }
    const __m512 s = load_halves16(smb + g * 2 * kBlock);
    const __m512 m = load_halves16(smb + g * 2 * kBlock + kBlock);
    for (int r = 0; r < R; ++r) {
      __m512 a = acc[r][0];
      for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[r][u]);
      out[r] = _mm512_fmadd_ps(a, s, out[r]);
      out[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * p.num_groups + g]), out[r]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
  for (int r = 0; r < R; ++r) store16(p, (row0 + r) * p.out_features + col0, mask, out[r]);
}

template <int R>
AVX512_TARGET void int8_block_avx512(const Problem& p, const int8_t* cb, const float* scale,
                                     int64_t row0, int64_t col0, int64_t lanes) {
  constexpr int U = R <= 2 ? 4 : 2;
  const float* x = p.x + row0 * p.in_features;
  __m512 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  const int64_t k_main = p.in_features - p.in_features % U;
  for (int64_t k = 0; k < k_main; k += U) {
    gemv_prefetch::ahead(cb + k * kBlock, U * kBlock);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + (k + u) * kBlock))));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r][u] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * p.in_features + k + u]), acc[r][u]);
    }
  }
  for (int64_t k = k_main; k < p.in_features; ++k) {
    const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + k * kBlock))));
    for (int r = 0; r < R; ++r)
      acc[r][0] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * p.in_features + k]), acc[r][0]);
  }
  const __m512 s = _mm512_loadu_ps(scale + col0);
  const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
  for (int r = 0; r < R; ++r) {
    __m512 a = acc[r][0];
    for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[r][u]);
    store16(p, (row0 + r) * p.out_features + col0, mask, _mm512_mul_ps(a, s));
  }
}

// AVX-512 BF16, int4 with bf16 activations: `vdpbf16ps` multiplies a lane's pair of bf16
// values by a pair of activations and adds both products to an fp32 lane, 32 MACs per
// instruction against 16 for an FMA, and bf16 activations are used as they are. The codes
// become bf16 without a conversion instruction: a code q in the mantissa of 1.0 gives
// 1 + q/16 (exact in bf16), so a lane's two codes are two shifts and two bit operations away
// from the byte; the offset sums to the group's activation sum, removed in the epilogue:
//   sum_k q_k x_k = 16 * (sum_k (1 + q_k/16) x_k - sum_k x_k).
// Products of bf16 values are exact in fp32 and the sums are fp32, as in the FMA path.

#define AVX512BF16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

template <int R>
AVX512BF16_TARGET void int4_block_avx512bf16(const Problem& p, const uint8_t* cb,
                                             const uint16_t* smb, int64_t row0, int64_t col0,
                                             int64_t lanes) {
  constexpr int U = R <= 2 ? 4 : 2;
  const __m512i mask = _mm512_set1_epi32(0x00780078);
  const __m512i one = _mm512_set1_epi32(0x3f803f80);
  const int64_t gs2 = p.group_size / 2;
  const uint32_t* x = reinterpret_cast<const uint32_t*>(p.xbf + row0 * p.in_features);
  const int64_t x_stride = p.in_features / 2;  // in pairs
  const float* xsum = p.xsum + row0 * p.num_groups;
  __m512 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.num_groups; ++g) {
    __m512 acc[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
    const uint8_t* c = cb + g * gs2 * kBlock;
    const uint32_t* xg = x + g * gs2;
    for (int64_t e = 0; e < gs2; e += U) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        const __m512i w = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + (e + u) * kBlock)));
        const __m512i codes = _mm512_or_si512(
            _mm512_ternarylogic_epi32(_mm512_slli_epi32(w, 3), _mm512_slli_epi32(w, 15), mask,
                                      0xA8),  // (a | b) & c
            one);
        const __m512bh weights = (__m512bh)codes;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512bh xs = (__m512bh)_mm512_set1_epi32(xg[r * x_stride + e + u]);
          acc[r][u] = _mm512_dpbf16_ps(acc[r][u], weights, xs);
        }
      }
    }
    const __m512 s16 = _mm512_mul_ps(load_halves16(smb + g * 2 * kBlock), _mm512_set1_ps(16.f));
    const __m512 m = load_halves16(smb + g * 2 * kBlock + kBlock);
    for (int r = 0; r < R; ++r) {
      __m512 a = acc[r][0];
      for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[r][u]);
      const __m512 sum = _mm512_set1_ps(xsum[r * p.num_groups + g]);
      out[r] = _mm512_fmadd_ps(m, sum, out[r]);
      out[r] = _mm512_fmadd_ps(_mm512_sub_ps(a, sum), s16, out[r]);
    }
  }
  const __mmask16 mask16 = static_cast<__mmask16>((1u << lanes) - 1u);
  for (int r = 0; r < R; ++r) store16(p, (row0 + r) * p.out_features + col0, mask16, out[r]);
}


// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI, bf16 activations quantized to int8 per chunk of 32 (quantize_rows), as
// llama.cpp does: `vpdpbusd` multiplies 4 unsigned bytes of a lane by 4 signed bytes and adds
// the 4 products to the lane's int32, 64 multiply-adds per instruction against vdpbf16ps's 32,
// and the codes need no widening. The layout stays the one above: a 64-byte load holds 4
// consecutive entries (16 bytes each, one per channel), and `vpermb` (AVX-512 VBMI) transposes
// it so that lane j holds channel j's 4 bytes. int4: each byte's low nibbles are 4 even inputs
// and its high nibbles the 4 odd ones, matched by the activations' pair order. int8: the codes
// become unsigned with +128 (an xor), removed in the epilogue with the chunk's code sum:
//   sum_k (q_k + 128) a_k = sum_k q_k a_k + 128 * sum_k a_k.
// Integer sums are exact; each chunk's sum is scaled by its d in fp32.

// vpermb indices: byte 4j + i of the result is byte 16i + j of the source.
VNNI_TARGET inline __m512i transpose_4x16() {
  alignas(64) uint8_t index[64];
  for (int j = 0; j < 16; ++j)
    for (int i = 0; i < 4; ++i) index[4 * j + i] = static_cast<uint8_t>(16 * i + j);
  return _mm512_load_si512(index);
}

VNNI_TARGET inline __m512i sum_lanes_i32(const __m512i* acc, int n) {
  __m512i s = acc[0];
  for (int u = 1; u < n; ++u) s = _mm512_add_epi32(s, acc[u]);
  return s;
}

template <int R>
VNNI_TARGET void int4_block_vnni(const Problem& p, const uint8_t* cb, const uint16_t* smb,
                                 int64_t row0, int64_t col0, int64_t lanes) {
  constexpr int U = R == 1 ? 4 : R == 2 ? 2 : 1;
  const __m512i perm = transpose_4x16();
  const __m512i low4 = _mm512_set1_epi8(15);
  const int64_t gs2 = p.group_size / 2, chunks_per_group = p.group_size / kChunk;
  const int64_t num_chunks = p.in_features / kChunk, x_stride = p.in_features / 4;
  const int32_t* xq = reinterpret_cast<const int32_t*>(p.xq + row0 * p.in_features);
  const float* xd = p.xd + row0 * num_chunks;
  const float* xsum = p.xsum + row0 * p.num_groups;
  __m512 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.num_groups; ++g) {
    __m512 gacc[R];
    for (int r = 0; r < R; ++r) gacc[r] = _mm512_setzero_ps();
    for (int64_t cg = 0; cg < chunks_per_group; ++cg) {
      const int64_t chunk = g * chunks_per_group + cg;
      const uint8_t* c = cb + (g * gs2 + cg * (kChunk / 2)) * kBlock;
      gemv_prefetch::ahead(c, kChunk / 2 * kBlock);
      __m512i acc[R][U];
      for (int r = 0; r < R; ++r)
        for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int e = 0; e < 4; ++e) {  // 4 loads of 8 inputs x 16 channels
        const __m512i v = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(c + e * 64));
        const __m512i lo = _mm512_and_si512(v, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int32_t* xr = xq + r * x_stride + chunk * 8 + e * 2;
          acc[r][e % U] = _mm512_dpbusd_epi32(acc[r][e % U], lo, _mm512_set1_epi32(xr[0]));
          acc[r][e % U] = _mm512_dpbusd_epi32(acc[r][e % U], hi, _mm512_set1_epi32(xr[1]));
        }
      }
      for (int r = 0; r < R; ++r)
        gacc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_lanes_i32(acc[r], U)),
                                  _mm512_set1_ps(xd[r * num_chunks + chunk]), gacc[r]);
    }
    const __m512 s = load_halves16(smb + g * 2 * kBlock);
    const __m512 m = load_halves16(smb + g * 2 * kBlock + kBlock);
    for (int r = 0; r < R; ++r) {
      out[r] = _mm512_fmadd_ps(gacc[r], s, out[r]);
      out[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * p.num_groups + g]), out[r]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
  for (int r = 0; r < R; ++r) store16(p, (row0 + r) * p.out_features + col0, mask, out[r]);
}

template <int R>
VNNI_TARGET void int8_block_vnni(const Problem& p, const int8_t* cb, const float* scale,
                                 int64_t row0, int64_t col0, int64_t lanes) {
  constexpr int U = R == 1 ? 4 : R == 2 ? 2 : 1;
  const __m512i perm = transpose_4x16();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t num_chunks = p.in_features / kChunk, x_stride = p.in_features / 4;
  const int32_t* xq = reinterpret_cast<const int32_t*>(p.xq + row0 * p.in_features);
  const float* xd = p.xd + row0 * num_chunks;
  const int32_t* xqsum = p.xqsum + row0 * num_chunks;
  __m512 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm512_setzero_ps();
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    const int8_t* c = cb + chunk * kChunk * kBlock;
    gemv_prefetch::ahead(c, kChunk * kBlock);
    __m512i acc[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int e = 0; e < 8; ++e) {  // 8 loads of 4 inputs x 16 channels
      const __m512i v = _mm512_xor_si512(
          _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(c + e * 64)), flip);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r][e % U] = _mm512_dpbusd_epi32(
            acc[r][e % U], v, _mm512_set1_epi32(xq[r * x_stride + chunk * 8 + e]));
    }
    for (int r = 0; r < R; ++r) {
      const __m512i dot = _mm512_sub_epi32(sum_lanes_i32(acc[r], U),
                                           _mm512_set1_epi32(128 * xqsum[r * num_chunks + chunk]));
      out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xd[r * num_chunks + chunk]),
                               out[r]);
    }
  }
  const __m512 s = _mm512_loadu_ps(scale + col0);
  const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
  for (int r = 0; r < R; ++r)
    store16(p, (row0 + r) * p.out_features + col0, mask, _mm512_mul_ps(out[r], s));
}

// ---------------------------------------------------------------------------------------------
// AVX2: a block is two 8-lane halves, each computed in its own pass over the block (the second
// pass finds the block's codes in L1). At most 4 rows at a time (16 ymm registers).

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET inline __m256 load_halves8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int R>
AVX2_TARGET void int4_half_avx2(const Problem& p, const uint8_t* cb, const uint16_t* smb,
                                int64_t row0, float* out_tmp /* [R, 8] */, int half) {
  constexpr int U = R <= 2 ? 4 : 2;
  const __m256i low4 = _mm256_set1_epi32(15);
  const int64_t gs2 = p.group_size / 2;
  const float* x = p.x + row0 * p.in_features;
  const float* xsum = p.xsum + row0 * p.num_groups;
  __m256 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.num_groups; ++g) {
    __m256 acc[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = _mm256_setzero_ps();
    const uint8_t* c = cb + g * gs2 * kBlock + half * 8;
    const float* xg = x + g * p.group_size;
    for (int64_t e = 0; e < gs2; e += U / 2) {
#pragma GCC unroll 4
      for (int h = 0; h < U / 2; ++h) {
        const __m256i w = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + (e + h) * kBlock)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(w, low4));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));
        const int64_t k = 2 * (e + h);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          acc[r][2 * h] =
              _mm256_fmadd_ps(lo, _mm256_set1_ps(xg[r * p.in_features + k]), acc[r][2 * h]);
          acc[r][2 * h + 1] =
              _mm256_fmadd_ps(hi, _mm256_set1_ps(xg[r * p.in_features + k + 1]), acc[r][2 * h + 1]);
        }
      }
    }
    const __m256 s = load_halves8(smb + g * 2 * kBlock + half * 8);
    const __m256 m = load_halves8(smb + g * 2 * kBlock + kBlock + half * 8);
    for (int r = 0; r < R; ++r) {
      __m256 a = acc[r][0];
      for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[r][u]);
      out[r] = _mm256_fmadd_ps(a, s, out[r]);
      out[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[r * p.num_groups + g]), out[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out_tmp + r * 8, out[r]);
}

template <int R>
AVX2_TARGET void int8_half_avx2(const Problem& p, const int8_t* cb, const float* scale,
                                int64_t row0, float* out_tmp, int half, int64_t col0) {
  constexpr int U = R <= 2 ? 4 : 2;
  const float* x = p.x + row0 * p.in_features;
  __m256 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm256_setzero_ps();
  const int8_t* c = cb + half * 8;
  const int64_t k_main = p.in_features - p.in_features % U;
  for (int64_t k = 0; k < k_main; k += U) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + (k + u) * kBlock))));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        acc[r][u] = _mm256_fmadd_ps(w, _mm256_set1_ps(x[r * p.in_features + k + u]), acc[r][u]);
    }
  }
  for (int64_t k = k_main; k < p.in_features; ++k) {
    const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + k * kBlock))));
    for (int r = 0; r < R; ++r)
      acc[r][0] = _mm256_fmadd_ps(w, _mm256_set1_ps(x[r * p.in_features + k]), acc[r][0]);
  }
  const __m256 s = _mm256_loadu_ps(scale + col0 + half * 8);
  for (int r = 0; r < R; ++r) {
    __m256 a = acc[r][0];
    for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[r][u]);
    _mm256_storeu_ps(out_tmp + r * 8, _mm256_mul_ps(a, s));
  }
}

// ---------------------------------------------------------------------------------------------
// AVX2 with int8 activations: the VNNI path's math where there is no AVX-512 (most desktop and
// laptop x86 CPUs, AMD Zen 2 and 3). The activations are quantized as for VNNI
// (quantize_rows_avx2: the same codes and scales, inputs in their own order). `vpmaddubsw`
// multiplies unsigned bytes by signed bytes and adds adjacent pairs into int16 lanes (32
// multiply-adds an instruction, against 8 for an FMA, and the codes need no widening to fp32).
// Integer sums are exact and each chunk's sum is scaled in the VNNI path's order, so the
// outputs are the VNNI path's bits.
//   int4: a 32-byte load holds entries 2e and 2e+1 (16 channels each); the nibbles unpacked
//   side by side give each channel its pair of inputs in an int16 lane, channels 0-7 in one
//   vector and 8-15 in the other, the even entry in the low 128 bits and the odd one in the
//   high. A pair's products sum to at most 2 * 15 * 127, so a chunk's 8 loads sum in int16
//   (at most 30480) before they are widened.
//   int8: 4 entries (two loads) are transposed so that each 32-bit lane holds one channel's
//   codes for inputs k, k+2, k+1, k+3 (the activations are shuffled to match); |q| times the
//   activation with q's sign (`vpsignb`) keeps a pair's products within int16 (2 * 128 * 127),
//   and `vpmaddwd` by ones adds the lane's two pairs into int32.

// 8 activations as fp32, from fp32 or from bf16 (bits << 16: exact).
AVX2_TARGET inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
AVX2_TARGET inline __m256 load8(const uint16_t* x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}

// quantize_rows' codes and scales for finite activations (the same values: a max, one
// division, products rounded to nearest even), in input order; no code sums (the AVX2 int8
// path needs none). For a chunk with an infinity or a NaN the two make no promise of the
// same codes.
// With `xsum`, the int4 groups' activation sums as quantize_rows makes them.
template <typename T>
AVX2_TARGET void quantize_rows_avx2(const T* x, int64_t rows, int64_t k, int8_t* xq, float* xd,
                                    float* xsum = nullptr, int64_t group_size = 0) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lanes
  const int64_t num_chunks = k / kChunk;
  const int64_t chunks_per_group = xsum != nullptr ? group_size / kChunk : 0;
  for (int64_t r = 0; r < rows; ++r) {
    __m256 running = _mm256_setzero_ps();
    for (int64_t c = 0; c < num_chunks; ++c) {
      const T* xc = x + r * k + c * kChunk;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = load8(xc + 8 * i);
      if (chunks_per_group > 0)
        add_chunk_to_group_sums(running, v, c, chunks_per_group,
                                xsum + r * (num_chunks / chunks_per_group));
      __m256 m = _mm256_andnot_ps(sign, v[0]);
      for (int i = 1; i < 4; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
      m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
      m = _mm256_max_ps(m, _mm256_permute_ps(m, 0x4E));
      m = _mm256_max_ps(m, _mm256_permute_ps(m, 0xB1));
      const float amax = _mm256_cvtss_f32(m);
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                               _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * k + c * kChunk),
                          _mm256_permutevar8x32_epi32(bytes, order));
      xd[r * num_chunks + c] = amax / 127.f;
    }
  }
}

// Keeps `v` in a register here. Without it GCC reassociates a chunk's chain of integer adds
// (exact, so it may) into a tree over all 64 products of a 4-row tile, each product stored to
// the stack and loaded back: the AVX2 int8 int4 kernel ran at ~15 multiply-adds a cycle.
AVX2_TARGET inline void in_register(__m256i& v) { asm("" : "+x"(v)); }

// 4 activation codes (inputs 4e .. 4e+3 of row r's chunk) in every 32-bit lane.
AVX2_TARGET inline __m256i broadcast4(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, sizeof(four));
  return _mm256_set1_epi32(four);
}

// 8 outputs into y at index: bf16 rounded to nearest even, a NaN as 0x7FC0 (put's bits, 8 at a
// time; no measurable change in speed against put per output).
AVX2_TARGET inline void store8(const Problem& p, int64_t index, __m256 v) {
  if (!p.out_bf16) {
    _mm256_storeu_ps(static_cast<float*>(p.y) + index, v);
    return;
  }
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i half = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<at::BFloat16*>(p.y) + index), packed);
}

// The first `lanes` of each row's 16 outputs (out[r][0] channels col0 .. col0 + 7, out[r][1]
// the next 8) into y.
template <int R>
AVX2_TARGET void store_avx2_block(const Problem& p, const __m256 (&out)[R][2], int64_t row0,
                                  int64_t col0, int64_t lanes) {
  if (lanes == kBlock) {
    for (int r = 0; r < R; ++r) {
      store8(p, (row0 + r) * p.out_features + col0, out[r][0]);
      store8(p, (row0 + r) * p.out_features + col0 + 8, out[r][1]);
    }
    return;
  }
  float tmp[16];
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(tmp, out[r][0]);
    _mm256_storeu_ps(tmp + 8, out[r][1]);
    for (int64_t j = 0; j < lanes; ++j) put(p, (row0 + r) * p.out_features + col0 + j, tmp[j]);
  }
}

// Many rows: a block's int4 codes rearranged once (unpack_int4_block_dwords) so that each
// 32-bit lane holds one channel's codes for 4 inputs, in the activations' order; then a row's 4
// activation codes are one broadcast, with no shuffle per row (the shuffle and the broadcast
// were ~1.5 of the ~3 cycles a row spent per 4 inputs on the Zen 3), and a chunk's int16 sums
// are added pairwise by `vpmaddwd` into each channel's int32.
//
// Per 4 inputs, two vectors: channels 0-7, then 8-15; in channel j's lane the codes of inputs
// 4e, 4e+1, 4e+2, 4e+3.
AVX2_TARGET void unpack_int4_block_dwords(const uint8_t* cb, int64_t in_features, __m256i* out) {
  const __m256i low4 = _mm256_set1_epi8(15);
  for (int64_t e = 0; e < in_features / 4; ++e) {
    if (e % 8 == 0) gemv_prefetch::ahead(cb + e * 32, kChunk / 2 * kBlock);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + e * 32));
    const __m256i lo = _mm256_and_si256(v, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    // Words (one channel's two inputs): [ch 0-7: 4e, 4e+1 | ch 0-7: 4e+2, 4e+3], and ch 8-15.
    const __m256i words[2] = {_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi)};
    for (int h = 0; h < 2; ++h) {
      // Qwords reordered to [ch 0-3 first pair, ch 0-3 second | ch 4-7 first, ch 4-7 second].
      const __m256i q = _mm256_permute4x64_epi64(words[h], 0xD8);
      _mm256_store_si256(out + 2 * e + h, _mm256_unpacklo_epi16(q, _mm256_srli_si256(q, 8)));
    }
  }
}

// The int8 codes likewise: per 4 inputs, each channel's 4 codes in a 32-bit lane in the
// activations' order, as magnitudes and as signs (`vpsignb` gives each activation code its
// weight's sign); channels {0-3, 8-11}, then {4-7, 12-15}. Four vectors per 4 inputs:
// magnitudes, then codes, for each half.
AVX2_TARGET void unpack_int8_block_dwords(const int8_t* cb, int64_t in_features, __m256i* out) {
  for (int64_t e = 0; e < in_features / 4; ++e) {
    if (e % 8 == 0) gemv_prefetch::ahead(cb + e * 64, kChunk * kBlock);
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + e * 64));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + e * 64 + 32));
    const __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);
    const __m256i even = _mm256_permute2x128_si256(lo, hi, 0x20);  // inputs k, k+2
    const __m256i odd = _mm256_permute2x128_si256(lo, hi, 0x31);   // inputs k+1, k+3
    const __m256i w[2] = {_mm256_unpacklo_epi8(even, odd), _mm256_unpackhi_epi8(even, odd)};
    for (int h = 0; h < 2; ++h) {
      _mm256_store_si256(out + 4 * e + 2 * h, _mm256_abs_epi8(w[h]));
      _mm256_store_si256(out + 4 * e + 2 * h + 1, w[h]);
    }
  }
}

// One chunk's int32 sums of a tile of R rows over a block's 16 channels (sum[r][0]: channels
// 0-7, sum[r][1]: 8-15). Dwords: `codes` is the block as unpack_int4_block_dwords left it (a
// row's activation codes one broadcast, the int16 sums added pairwise by `vpmaddwd`);
// otherwise the block as packed, its nibbles unpacked here for this tile and each row's
// activation codes shuffled into pairs. The same integer sums either way.
template <int R, bool Dwords>
AVX2_TARGET inline void int4_chunk_avx2_int8(const Problem& p, const void* codes,
                                             const int8_t* xq, int64_t chunk,
                                             __m256i (&sum)[R][2]) {
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  // Lane 0 takes the broadcast's bytes 0-1 (the even entry's inputs), lane 1 bytes 2-3.
  const __m256i pairs = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                         2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  const uint8_t* c = static_cast<const uint8_t*>(codes) + chunk * (kChunk / 2) * kBlock;
  const __m256i* w = static_cast<const __m256i*>(codes) + chunk * 16;
  if constexpr (!Dwords) gemv_prefetch::ahead(c, kChunk / 2 * kBlock);
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int e = 0; e < 8; ++e) {  // 4 inputs x 16 channels each
    __m256i a, b;
    if constexpr (Dwords) {
      a = _mm256_load_si256(w + 2 * e), b = _mm256_load_si256(w + 2 * e + 1);
    } else {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + e * 32));
      const __m256i lo = _mm256_and_si256(v, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i x4 = broadcast4(xq + r * p.in_features + chunk * kChunk + e * 4);
      const __m256i xa = Dwords ? x4 : _mm256_shuffle_epi8(x4, pairs);
      acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(a, xa));
      acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(b, xa));
      in_register(acc[r][0]);
      in_register(acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      if constexpr (Dwords) {
        sum[r][h] = _mm256_madd_epi16(acc[r][h], ones);
      } else {
        sum[r][h] = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[r][h])),
                                     _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[r][h], 1)));
      }
    }
  }
}

// One block's 16 outputs for a tile of R rows (codes as int4_chunk_avx2_int8 takes them).
// Per group: the chunks' sums times their activation scales, times the group's scales, plus its
// minimums times the activations' group sums. OneChunkGroups (groups of 32 inputs, GGUF's
// Q4_0/Q4_1) adds each chunk's scaled sum to the outputs at once: the same operations in the
// same order (a group's accumulator starts at zero), without the 8 registers a tile of 4 rows
// would spend on group accumulators (spilled around every chunk: 1.16x at 32 rows on the Zen 3
// without them).
template <int R, bool Dwords, bool OneChunkGroups>
AVX2_TARGET void int4_block_avx2_int8(const Problem& p, const void* codes, const uint16_t* smb,
                                      int64_t row0, int64_t col0, int64_t lanes) {
  const int64_t chunks_per_group = p.group_size / kChunk;
  const int64_t num_chunks = p.in_features / kChunk;
  const int8_t* xq = p.xq + row0 * p.in_features;
  const float* xd = p.xd + row0 * num_chunks;
  const float* xsum = p.xsum + row0 * p.num_groups;
  __m256 out[R][2];
  for (int r = 0; r < R; ++r) out[r][0] = out[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.num_groups; ++g) {
    __m256 gacc[R][2];  // the group's scaled chunk sums (one chunk: the chunk's own)
    if constexpr (!OneChunkGroups) {
      for (int r = 0; r < R; ++r) gacc[r][0] = gacc[r][1] = _mm256_setzero_ps();
    }
    for (int64_t cg = 0; cg < (OneChunkGroups ? 1 : chunks_per_group); ++cg) {
      const int64_t chunk = g * chunks_per_group + cg;
      __m256i sum[R][2];
      int4_chunk_avx2_int8<R, Dwords>(p, codes, xq, chunk, sum);
      for (int r = 0; r < R; ++r) {
        const __m256 d = _mm256_set1_ps(xd[r * num_chunks + chunk]);
        for (int h = 0; h < 2; ++h) {
          if constexpr (OneChunkGroups) {
            gacc[r][h] = _mm256_mul_ps(_mm256_cvtepi32_ps(sum[r][h]), d);
          } else {
            gacc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]), d, gacc[r][h]);
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = load_halves8(smb + g * 2 * kBlock + h * 8);
      const __m256 m = load_halves8(smb + g * 2 * kBlock + kBlock + h * 8);
      for (int r = 0; r < R; ++r) {
        out[r][h] = _mm256_fmadd_ps(gacc[r][h], s, out[r][h]);
        out[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[r * p.num_groups + g]), out[r][h]);
      }
    }
  }
  store_avx2_block<R>(p, out, row0, col0, lanes);
}

// As int4_block_avx2_int8, for int8 codes (Dwords: the block as unpack_int8_block_dwords left
// it). The weights' magnitudes times the activation codes given the weights' signs (`vpsignb`:
// |w| x a fits `vpmaddubsw`'s int16 pairs), pairs summed into int32 by `vpmaddwd`.
template <int R, bool Dwords>
AVX2_TARGET void int8_block_avx2_int8(const Problem& p, const void* codes, const float* scale,
                                      int64_t row0, int64_t col0, int64_t lanes) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i quads = _mm256_setr_epi8(0, 2, 1, 3, 0, 2, 1, 3, 0, 2, 1, 3, 0, 2, 1, 3,
                                         0, 2, 1, 3, 0, 2, 1, 3, 0, 2, 1, 3, 0, 2, 1, 3);
  const int64_t num_chunks = p.in_features / kChunk;
  const int8_t* xq = p.xq + row0 * p.in_features;
  const float* xd = p.xd + row0 * num_chunks;
  __m256 out[R][2];
  for (int r = 0; r < R; ++r) out[r][0] = out[r][1] = _mm256_setzero_ps();
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    const int8_t* c = static_cast<const int8_t*>(codes) + chunk * kChunk * kBlock;
    const __m256i* dw = static_cast<const __m256i*>(codes) + chunk * 32;
    if constexpr (!Dwords) gemv_prefetch::ahead(c, kChunk * kBlock);
    // Channels {0-3, 8-11} and {4-7, 12-15}, as the transposition leaves them.
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int e = 0; e < 8; ++e) {  // 8 times 4 inputs x 16 channels (two loads)
      __m256i u[2], w[2];  // magnitudes and codes
      if constexpr (Dwords) {
        for (int h = 0; h < 2; ++h) {
          u[h] = _mm256_load_si256(dw + 4 * e + 2 * h);
          w[h] = _mm256_load_si256(dw + 4 * e + 2 * h + 1);
        }
      } else {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + e * 64));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + e * 64 + 32));
        const __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);
        const __m256i even = _mm256_permute2x128_si256(lo, hi, 0x20);  // inputs k, k+2
        const __m256i odd = _mm256_permute2x128_si256(lo, hi, 0x31);   // inputs k+1, k+3
        w[0] = _mm256_unpacklo_epi16(even, odd), w[1] = _mm256_unpackhi_epi16(even, odd);
        u[0] = _mm256_abs_epi8(w[0]), u[1] = _mm256_abs_epi8(w[1]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i x4 = broadcast4(xq + r * p.in_features + chunk * kChunk + e * 4);
        const __m256i xa = Dwords ? x4 : _mm256_shuffle_epi8(x4, quads);
        for (int h = 0; h < 2; ++h) {
          acc[r][h] = _mm256_add_epi32(
              acc[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(u[h], _mm256_sign_epi8(xa, w[h])),
                                           ones));
          in_register(acc[r][h]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_set1_ps(xd[r * num_chunks + chunk]);
      const __m256i first = _mm256_permute2x128_si256(acc[r][0], acc[r][1], 0x20);   // 0-7
      const __m256i second = _mm256_permute2x128_si256(acc[r][0], acc[r][1], 0x31);  // 8-15
      out[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), d, out[r][0]);
      out[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(second), d, out[r][1]);
    }
  }
  const __m256 s[2] = {_mm256_loadu_ps(scale + col0), _mm256_loadu_ps(scale + col0 + 8)};
  for (int r = 0; r < R; ++r) {
    out[r][0] = _mm256_mul_ps(out[r][0], s[0]);
    out[r][1] = _mm256_mul_ps(out[r][1], s[1]);
  }
  store_avx2_block<R>(p, out, row0, col0, lanes);
}

// ---------------------------------------------------------------------------------------------
// Row tiling: the block's codes stay in L1 while each tile of rows runs over them.

template <typename Fn>
void for_row_tiles(int64_t rows, int64_t max_tile, Fn&& fn) {
  for (int64_t r0 = 0; r0 < rows; r0 += max_tile) fn(r0, std::min(max_tile, rows - r0));
}

// fn(std::integral_constant<int, n>) for a tile of n rows, 1 <= n <= Max (a kernel compiled for
// each row count up to Max).
template <int Max, int R = 1, typename Fn>
void with_rows(int64_t n, Fn&& fn) {
  if constexpr (R < Max) {
    if (n != R) return with_rows<Max, R + 1>(n, fn);
  }
  fn(std::integral_constant<int, R>{});
}

// The block kernels' driver: for each block of [b0, b1) and each tile of up to MaxTile rows
// (AVX-512: 8, for 32 zmm registers; AVX2: 4, for 16 ymm), block(std::integral_constant<int,
// R>, block index, first row, lanes) with R the tile's rows; a block's tiles in row order, the
// first at row 0.
template <int MaxTile, typename Block>
void over_blocks(const Problem& p, int64_t b0, int64_t b1, Block&& block) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lanes = std::min(kBlock, p.out_features - b * kBlock);
    for_row_tiles(p.rows, MaxTile, [&](int64_t r0, int64_t n) {
      with_rows<MaxTile>(n, [&](auto rows) { block(rows, b, r0, lanes); });
    });
  }
}

// The int4 paths' per-block pointers: codes and (scale, minimum) pairs of block b.
#define INT4_BLOCK_ARGS \
  codes + b * (p.in_features / 2 * kBlock), scale_min + b * (p.num_groups * 2 * kBlock)

void int4_avx512(const Problem& p, const uint8_t* codes, const uint16_t* scale_min, int64_t b0,
                 int64_t b1) {
  over_blocks<8>(p, b0, b1, [&](auto rows, int64_t b, int64_t r0, int64_t lanes) {
    int4_block_avx512<rows()>(p, INT4_BLOCK_ARGS, r0, b * kBlock, lanes);
  });
}

void int4_avx512bf16(const Problem& p, const uint8_t* codes, const uint16_t* scale_min,
                     int64_t b0, int64_t b1) {
  over_blocks<8>(p, b0, b1, [&](auto rows, int64_t b, int64_t r0, int64_t lanes) {
    int4_block_avx512bf16<rows()>(p, INT4_BLOCK_ARGS, r0, b * kBlock, lanes);
  });
}

void int4_vnni(const Problem& p, const uint8_t* codes, const uint16_t* scale_min, int64_t b0,
               int64_t b1) {
  over_blocks<8>(p, b0, b1, [&](auto rows, int64_t b, int64_t r0, int64_t lanes) {
    int4_block_vnni<rows()>(p, INT4_BLOCK_ARGS, r0, b * kBlock, lanes);
  });
}

void int8_avx512(const Problem& p, const int8_t* codes, const float* scale, int64_t b0,
                 int64_t b1) {
  over_blocks<8>(p, b0, b1, [&](auto rows, int64_t b, int64_t r0, int64_t lanes) {
    int8_block_avx512<rows()>(p, codes + b * p.in_features * kBlock, scale, r0, b * kBlock, lanes);
  });
}

void int8_vnni(const Problem& p, const int8_t* codes, const float* scale, int64_t b0,
               int64_t b1) {
  over_blocks<8>(p, b0, b1, [&](auto rows, int64_t b, int64_t r0, int64_t lanes) {
    int8_block_vnni<rows()>(p, codes + b * p.in_features * kBlock, scale, r0, b * kBlock, lanes);
  });
}

#undef INT4_BLOCK_ARGS

// Copies an AVX2 half's [n, 8] results into y, dropping lanes past out_features.
void store_half(const Problem& p, const float* tmp, int64_t r0, int64_t n, int64_t col) {
  const int64_t lanes = std::min<int64_t>(8, p.out_features - col);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < lanes; ++j) put(p, (r0 + r) * p.out_features + col + j, tmp[r * 8 + j]);
}

void int4_avx2(const Problem& p, const uint8_t* codes, const uint16_t* scale_min, int64_t b0,
               int64_t b1) {
  const int64_t block_codes = p.in_features / 2 * kBlock, block_sm = p.num_groups * 2 * kBlock;
  float tmp[4 * 8];
  for (int64_t b = b0; b < b1; ++b) {
    for (int half = 0; half < 2; ++half) {
      const int64_t col = b * kBlock + half * 8;
      if (col >= p.out_features) break;
      for_row_tiles(p.rows, 4, [&](int64_t r0, int64_t n) {
        with_rows<4>(n, [&](auto rows) {
          int4_half_avx2<rows()>(p, codes + b * block_codes, scale_min + b * block_sm, r0, tmp,
                                 half);
        });
        store_half(p, tmp, r0, n, col);
      });
    }
  }
}

void int8_avx2(const Problem& p, const int8_t* codes, const float* scale, int64_t b0,
               int64_t b1) {
  float tmp[4 * 8];
  for (int64_t b = b0; b < b1; ++b) {
    for (int half = 0; half < 2; ++half) {
      const int64_t col = b * kBlock + half * 8;
      if (col >= p.out_features) break;
      for_row_tiles(p.rows, 4, [&](int64_t r0, int64_t n) {
        with_rows<4>(n, [&](auto rows) {
          int8_half_avx2<rows()>(p, codes + b * p.in_features * kBlock, scale, r0, tmp, half,
                                 b * kBlock);
        });
        store_half(p, tmp, r0, n, col);
      });
    }
  }
}

// From this many rows a block's codes are rearranged once for all its tiles of rows
// (int4_block_avx2_int8<R, true>), before its first tile. On the Zen 3 (2 threads, alternating
// builds, per call), against the tile path: 0.91-1.04x at 5 rows, 1.02-1.08x at 6, 1.05-1.09x
// at 8, 1.16-1.25x at 16, 1.25-1.36x at 32, 1.43-1.48x at 128 (SmolLM2's qkv, gate_up, down).
// Tiles of 6 rows ran as fast as tiles of 4.
constexpr int64_t kDwordsMinRows = 6;
// The int8 codes' rearrangement writes twice the int4's bytes per input (magnitudes and signs):
// against the tile path (as above) 0.86-0.93x at 8 rows, 0.96-1.19x at 12, 1.04-1.25x at 16,
// 1.11-1.22x at 32, 1.30-1.37x at 128 (the lm_head 49152x576 the lowest up to 16).
constexpr int64_t kInt8DwordsMinRows = 16;

// A per-thread scratch of `bytes`, 32-byte aligned: a block's rearranged codes.
__m256i* block_scratch(int64_t bytes) {
  thread_local std::vector<uint8_t> storage;
  storage.resize(bytes + 32);
  const auto address = reinterpret_cast<uintptr_t>(storage.data());
  return reinterpret_cast<__m256i*>((address + 31) & ~uintptr_t{31});
}

void int4_avx2_int8(const Problem& p, const uint8_t* codes, const uint16_t* scale_min,
                    int64_t b0, int64_t b1) {
  const int64_t block_codes = p.in_features / 2 * kBlock, block_sm = p.num_groups * 2 * kBlock;
  __m256i* dwords = p.rows >= kDwordsMinRows ? block_scratch(p.in_features * 16) : nullptr;
  const bool one_chunk_groups = p.group_size == kChunk;
  over_blocks<4>(p, b0, b1, [&](auto rows, int64_t b, int64_t r0, int64_t lanes) {
    const uint8_t* cb = codes + b * block_codes;
    const uint16_t* smb = scale_min + b * block_sm;
    auto run = [&](auto dwords_layout, auto one_chunk) {
      int4_block_avx2_int8<rows(), dwords_layout(), one_chunk()>(
          p, dwords_layout() ? static_cast<const void*>(dwords) : cb, smb, r0, b * kBlock, lanes);
    };
    auto groups = [&](auto dwords_layout) {
      if (one_chunk_groups) run(dwords_layout, std::true_type{});
      else run(dwords_layout, std::false_type{});
    };
    if (dwords == nullptr) return groups(std::false_type{});
    if (r0 == 0) unpack_int4_block_dwords(cb, p.in_features, dwords);  // the block's first tile
    groups(std::true_type{});
  });
}

void int8_avx2_int8(const Problem& p, const int8_t* codes, const float* scale, int64_t b0,
                    int64_t b1) {
  const int64_t block_codes = p.in_features * kBlock;
  __m256i* dwords = p.rows >= kInt8DwordsMinRows ? block_scratch(p.in_features * 32) : nullptr;
  over_blocks<4>(p, b0, b1, [&](auto rows, int64_t b, int64_t r0, int64_t lanes) {
    const int8_t* cb = codes + b * block_codes;
    if (dwords == nullptr) {
      int8_block_avx2_int8<rows(), false>(p, cb, scale, r0, b * kBlock, lanes);
      return;
    }
    if (r0 == 0) unpack_int8_block_dwords(cb, p.in_features, dwords);  // the block's first tile
    int8_block_avx2_int8<rows(), true>(p, dwords, scale, r0, b * kBlock, lanes);
  });
}

// ---------------------------------------------------------------------------------------------
// Entry points.

void check_isa(int64_t isa) {
  TORCH_CHECK(isa >= kPortable && isa <= kAvx2Int8, "quant_gemm: unknown isa ", isa);
  if (isa == kAvx512Vnni) {
    TORCH_CHECK(__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi"),
                "quant_gemm: this CPU cannot run the avx512vnni path");
  }
  if (isa == kAvx512Bf16) {
    TORCH_CHECK(__builtin_cpu_supports("avx512bf16"),
                "quant_gemm: this CPU cannot run the avx512bf16 path");
  }
  if (is_avx512(isa)) {
    TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"),
                "quant_gemm: this CPU cannot run the avx512 paths");
  } else if (isa == kAvx2 || isa == kAvx2Int8) {
    TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c"),
                "quant_gemm: this CPU cannot run the avx2 paths");
  }
}

// The activations as fp32 (and as bf16 when they are): plain loops rather than ATen ops, since
// at one row the dispatch of a cast and a sum would cost more than the work.
struct Activations {
  at::Tensor contiguous;       // x, or a contiguous copy of it
  std::vector<float> widened;  // bf16 x as fp32
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  int64_t rows = 0, cols = 0;
};

// x as the kernels take it; bf16 x is widened to fp32 only when `widen` (the paths that read
// fp32: reads_f32), over the threads.
Activations activations(const at::Tensor& x, bool widen = true) {
  TORCH_CHECK(x.dim() == 2, "quant_gemm: x must be [rows, in_features]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_gemm: x must be float32 or bfloat16, got ", x.scalar_type());
  Activations a;
  a.contiguous = x.contiguous();
  a.rows = x.size(0);
  a.cols = x.size(1);
  if (x.scalar_type() == at::kFloat) {
    a.f32 = a.contiguous.data_ptr<float>();
    return a;
  }
  a.bf16 = reinterpret_cast<const uint16_t*>(a.contiguous.data_ptr());
  if (!widen) return a;
  a.widened.resize(a.rows * a.cols);
  at::parallel_for(0, a.rows * a.cols, 1 << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) a.widened[i] = to_f32(a.bf16[i]);
  });
  a.f32 = a.widened.data();
  return a;
}

// The output: `out` if given (contiguous [rows, out_features] of x's dtype), else a new tensor.
at::Tensor output(const at::Tensor& x, int64_t out_features, const c10::optional<at::Tensor>& out) {
  if (!out.has_value()) return at::empty({x.size(0), out_features}, x.options());
  const at::Tensor& y = *out;
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && y.is_contiguous() &&
                  y.sizes() == at::IntArrayRef({x.size(0), out_features}),
              "quant_gemm: out must be contiguous ", x.scalar_type(), " [", x.size(0), ", ",
              out_features, "]");
  return y;
}

// Rows [r0, r1) of x ([rows, k]) quantized for int8-activation path `isa` into the row-major
// buffers of all the rows: codes xq, scales xd, code sums xqsum (VNNI only), and with `xsum`
// the int4 groups' activation sums.
template <typename T>
void quantize_row_range(int64_t isa, const T* x, int64_t r0, int64_t r1, int64_t k, bool int4,
                        int8_t* xq, float* xd, int32_t* xqsum, float* xsum, int64_t group_size) {
  const int64_t num_chunks = k / kChunk;
  float* sums = xsum != nullptr ? xsum + r0 * (k / group_size) : nullptr;
  if (isa == kAvx2Int8)
    quantize_rows_avx2(x + r0 * k, r1 - r0, k, xq + r0 * k, xd + r0 * num_chunks, sums, group_size);
  else
    quantize_rows(x + r0 * k, r1 - r0, k, int4, xq + r0 * k, xd + r0 * num_chunks,
                  xqsum + r0 * num_chunks, sums, group_size);
}

// The VNNI path's int8 activations (quantize_rows), owned by the caller.
struct QuantizedActivations {
  std::vector<int8_t> xq;
  std::vector<float> xd;
  std::vector<int32_t> xqsum;

  // For path `isa` (an int8-activation one); `int4`: the VNNI path's int4 pair order. With
  // `xsum` (where sums_while_quantizing), the groups' activation sums too.
  // With `split_rows`, the rows are shared among torch's threads (not inside a parallel
  // region: the fused step's threads each prepare for themselves).
  template <typename T>
  void quantize(const T* x, int64_t rows, int64_t k, int64_t isa, bool int4, Problem& p,
                float* xsum = nullptr, int64_t group_size = 0, bool split_rows = false) {
    xq.resize(rows * k);
    xd.resize(rows * (k / kChunk));
    if (isa != kAvx2Int8) xqsum.resize(rows * (k / kChunk));
    auto some_rows = [&](int64_t r0, int64_t r1) {
      quantize_row_range(isa, x, r0, r1, k, int4, xq.data(), xd.data(), xqsum.data(), xsum,
                         group_size);
    };
    if (split_rows) at::parallel_for(0, rows, std::max<int64_t>(1, kSplitRowsElements / k), some_rows);
    else some_rows(0, rows);
    p.xqsum = isa == kAvx2Int8 ? nullptr : xqsum.data();
    p.xq = xq.data();
    p.xd = xd.data();
  }
};

// The VNNI path takes bf16 activations (fp32 ones asked for the reference's math), whole
// chunks of 32 inputs (int4 groups always are), and at least kVnniMinRows rows; otherwise the
// exact path of the same CPU. One row included: there the exact int4 path is bound by its
// instructions, not the memory (widening codes to bf16 costs ~4 instructions per 16 bytes
// against VNNI's ~1.5): SmolLM2's int4 layers at one row on the 2-core Zen 4 VM, in-process
// A/B, exact 12-14 GB/s, VNNI 15-29 GB/s (1.2-2.2x). It was 2 while the engine measured no gain
// at one row (on a shared machine); the accuracy figures were always the VNNI ones, since
// perplexity runs many rows a step (loadtest/JOURNAL.md).
constexpr int64_t kVnniMinRows = 1;

int64_t effective_isa(int64_t isa, bool x_is_bf16, int64_t in_features, int64_t rows) {
  if (!is_int8_activation(isa)) return isa;
  if (x_is_bf16 && in_features % kChunk == 0 && rows >= kVnniMinRows) return isa;
  if (isa == kAvx2Int8) return kAvx2;
  static const bool has_bf16 = __builtin_cpu_supports("avx512bf16");
  return x_is_bf16 && has_bf16 ? kAvx512Bf16 : kAvx512;
}

// Whether path `isa`'s quantization of the activations also makes the int4 groups' sums
// (quantize_rows' or quantize_rows_avx2's `xsum`), in place of group_sums' pass of its own.
bool sums_while_quantizing(int64_t isa, int64_t group_size) {
  return is_int8_activation(isa) && group_size % kChunk == 0;
}

// Whether path `isa` reads fp32 activations (the FMA paths); the others read the bf16 ones, or
// their int8 codes, directly.
bool reads_f32(int64_t isa, int64_t bits) {
  return !(is_int8_activation(isa) || (isa == kAvx512Bf16 && bits == 4));
}

// Group sums over rows shared among torch's threads.
template <typename T>
void group_sums_split(const T* x, int64_t rows, int64_t k, int64_t group_size, float* out) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kSplitRowsElements / k), [&](int64_t r0, int64_t r1) {
    group_sums(x + r0 * k, r1 - r0, k, group_size, out + r0 * (k / group_size));
  });
}

// Blocks per parallel task: at least ~32 KiB of weights, so tiny layers run on one thread.
int64_t grain(int64_t block_bytes) { return std::max<int64_t>(1, (32 << 10) / block_bytes); }

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_min,
                     int64_t group_size, int64_t out_features, int64_t isa,
                     const c10::optional<at::Tensor>& out) {
  check_isa(isa);
  Activations a = activations(x, false);
  const int64_t rows = a.rows, in_features = a.cols;
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && in_features % group_size == 0,
              "quant_gemm: in_features ", in_features, " must be a multiple of group_size ",
              group_size, " (a multiple of 8)");
  TORCH_CHECK(out_features > 0, "quant_gemm: out_features must be positive");
  const int64_t num_blocks = (out_features + kBlock - 1) / kBlock;
  const int64_t num_groups = in_features / group_size;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.sizes() == at::IntArrayRef({num_blocks, in_features / 2, kBlock}),
              "quant_gemm: int4 codes must be contiguous uint8 [", num_blocks, ", ",
              in_features / 2, ", 16], got ", codes.sizes());
  TORCH_CHECK(scale_min.scalar_type() == at::kHalf && scale_min.is_contiguous() &&
                  scale_min.sizes() == at::IntArrayRef({num_blocks, num_groups, 2, kBlock}),
              "quant_gemm: int4 scale_min must be contiguous float16 [", num_blocks, ", ",
              num_groups, ", 2, 16], got ", scale_min.sizes());
  at::Tensor y = output(x, out_features, out);
  // vdpbf16ps takes bf16 activations as they are; fp32 ones would have to be rounded (not the
  // reference's math), so they take the FMA path.
  if (isa == kAvx512Bf16 && a.bf16 == nullptr) isa = kAvx512;
  isa = effective_isa(isa, a.bf16 != nullptr, in_features, rows);
  if (a.f32 == nullptr && reads_f32(isa, 4)) a = activations(x, true);
  // Per-group activation sums (the minimum's term), once per call.
  std::vector<float> xsum(rows * num_groups);
  const bool fused_sums = sums_while_quantizing(isa, group_size);
  Problem p{rows, in_features, out_features, num_blocks, group_size, num_groups,
            a.f32, xsum.data(), a.bf16, y.data_ptr(), y.scalar_type() == at::kBFloat16};
  QuantizedActivations qa;
  auto prepare = [&](const auto* xs) {
    if (!fused_sums) group_sums_split(xs, rows, in_features, group_size, xsum.data());
    if (is_int8_activation(isa))
      qa.quantize(xs, rows, in_features, isa, true, p, fused_sums ? xsum.data() : nullptr,
                  group_size, true);
  };
  if (a.f32 != nullptr) prepare(a.f32);
  else prepare(a.bf16);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const auto* sm = reinterpret_cast<const uint16_t*>(scale_min.data_ptr());
  const int64_t block_bytes = in_features / 2 * kBlock + num_groups * 2 * kBlock * 2;
  at::parallel_for(0, num_blocks, grain(block_bytes), [&](int64_t b0, int64_t b1) {
    if (isa == kAvx512Vnni) int4_vnni(p, c, sm, b0, b1);
    else if (isa == kAvx512Bf16) int4_avx512bf16(p, c, sm, b0, b1);
    else if (isa == kAvx512) int4_avx512(p, c, sm, b0, b1);
    else if (isa == kAvx2Int8) int4_avx2_int8(p, c, sm, b0, b1);
    else if (isa == kAvx2) int4_avx2(p, c, sm, b0, b1);
    else int4_portable(p, c, sm, b0, b1);
  });
  return y;
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     int64_t out_features, int64_t isa, const c10::optional<at::Tensor>& out) {
  check_isa(isa);
  Activations a = activations(x, false);
  const int64_t rows = a.rows, in_features = a.cols;
  TORCH_CHECK(out_features > 0, "quant_gemm: out_features must be positive");
  const int64_t num_blocks = (out_features + kBlock - 1) / kBlock;
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  codes.sizes() == at::IntArrayRef({num_blocks, in_features, kBlock}),
              "quant_gemm: int8 codes must be contiguous int8 [", num_blocks, ", ", in_features,
              ", 16], got ", codes.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == num_blocks * kBlock,
              "quant_gemm: int8 scale must be contiguous float32 [", num_blocks * kBlock, "]");
  at::Tensor y = output(x, out_features, out);
  isa = effective_isa(isa, a.bf16 != nullptr, in_features, rows);
  if (a.f32 == nullptr && reads_f32(isa, 8)) a = activations(x, true);
  Problem p{rows, in_features, out_features, num_blocks, 0,      0,
            a.f32, nullptr,      nullptr,      y.data_ptr(), y.scalar_type() == at::kBFloat16};
  QuantizedActivations qa;
  if (is_int8_activation(isa)) {
    if (a.f32 != nullptr) qa.quantize(a.f32, rows, in_features, isa, false, p, nullptr, 0, true);
    else qa.quantize(a.bf16, rows, in_features, isa, false, p, nullptr, 0, true);
  }
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  at::parallel_for(0, num_blocks, grain(in_features * kBlock), [&](int64_t b0, int64_t b1) {
    if (isa == kAvx512Vnni) int8_vnni(p, c, s, b0, b1);
    else if (is_avx512(isa)) int8_avx512(p, c, s, b0, b1);  // no bf16 variant for int8
    else if (isa == kAvx2Int8) int8_avx2_int8(p, c, s, b0, b1);
    else if (isa == kAvx2) int8_avx2(p, c, s, b0, b1);
    else int8_portable(p, c, s, b0, b1);
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// One GEMV of a fused decode step (engine/kernels/cpu/decode_step.cpp runs it inside its one
// parallel region, each thread over its share of the blocks). The same block functions as the
// entry points above, on the same widened activations and group sums, so the bits are theirs.

struct GemvTask {
  int64_t bits;  // 4 or 8
  const void* codes;
  const void* scales;  // int4: scale_min (fp16); int8: per-channel scale (fp32)
  int64_t group_size, in_features, out_features, num_blocks, isa;
  const at::BFloat16* x;  // [rows, in_features], contiguous
  at::BFloat16* y;        // [rows, out_features], contiguous
  // Which task a thread's preparation is for: a task made where a freed one lay has its
  // address, never its serial.
  uint64_t serial;
  // From split_from_rows rows, an int8-activation path's activations are prepared once, the
  // rows shared out over the threads (gemv_prepare_task, then a barrier: decode_step.cpp's
  // kEveryThenSplit), into `scratch` (the plan's, shared by its GEMVs, which run one after
  // another); below it each thread prepares every row for itself, with no barrier.
  uint8_t* scratch = nullptr;
  int64_t scratch_bytes = 0, split_from_rows = 0;
};

// Where a shared preparation of `rows` rows lies in a task's scratch (64-byte aligned parts).
struct SharedActivations {
  int8_t* xq;
  float* xd;
  int32_t* xqsum;
  float* xsum;
  int64_t bytes;
};

SharedActivations shared_activations(const GemvTask& t, int64_t rows) {
  const int64_t k = t.in_features, num_chunks = k / kChunk;
  const int64_t num_groups = t.bits == 4 ? k / t.group_size : 0;
  int64_t offset = 0;
  auto take = [&](int64_t bytes) {
    uint8_t* at = t.scratch + offset;
    offset += (bytes + 63) / 64 * 64;
    return at;
  };
  SharedActivations a;
  a.xq = reinterpret_cast<int8_t*>(take(rows * k));
  a.xd = reinterpret_cast<float*>(take(rows * num_chunks * 4));
  a.xqsum = reinterpret_cast<int32_t*>(take(rows * num_chunks * 4));
  a.xsum = reinterpret_cast<float*>(take(rows * num_groups * 4));
  a.bytes = offset;
  return a;
}

// Whether a step of `rows` rows prepares this task's activations once, shared (see GemvTask).
bool shares_preparation(const GemvTask& t, int64_t rows) {
  if (t.scratch == nullptr || rows < t.split_from_rows) return false;
  const int64_t isa = effective_isa(t.isa, true, t.in_features, rows);
  if (!is_int8_activation(isa) || t.in_features % kChunk != 0) return false;
  if (t.bits == 4 && !sums_while_quantizing(isa, t.group_size)) return false;
  return shared_activations(t, rows).bytes <= t.scratch_bytes;
}

std::atomic<uint64_t> next_gemv_task_serial{1};

// The activations of one GEMV as this thread's kernels take them: widened, group sums and (VNNI)
// int8 codes. Prepared by each thread for itself (cheaper than a barrier at few rows), once per
// GEMV of a step (gemv_prepare_task), then used by every share of blocks the thread takes; from
// a task's split_from_rows, an int8-activation path's are prepared once, shared (GemvTask).
struct PreparedActivations {
  uint64_t task = 0;  // the serial of the GemvTask prepared for
  int64_t rows = 0, isa = 0;
  std::vector<float> widened, xsum;
  QuantizedActivations quantized;
  Problem problem{};
};

thread_local PreparedActivations prepared;

void prepare(const GemvTask& t, int64_t rows) {
  PreparedActivations& a = prepared;
  const int64_t k = t.in_features, num_groups = t.bits == 4 ? k / t.group_size : 0;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(t.x);
  a.isa = effective_isa(t.isa, true, k, rows);
  // Only the FMA paths read fp32 activations; the others read the bf16 ones (or their int8
  // codes) directly. Measured: widening all rows and summing the groups with a division per
  // input cost 14.8 of a 46.7 ms W2 step, every thread doing it for every GEMV.
  const bool needs_f32 = reads_f32(a.isa, t.bits);
  a.widened.resize(needs_f32 ? rows * k : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(a.widened.size()); ++i) a.widened[i] = to_f32(xb[i]);
  a.xsum.resize(rows * num_groups);
  const bool fused_sums = num_groups > 0 && sums_while_quantizing(a.isa, t.group_size);
  if (num_groups > 0 && !fused_sums) group_sums(xb, rows, k, t.group_size, a.xsum.data());
  a.problem = Problem{rows, k, t.out_features, t.num_blocks, t.group_size, num_groups,
                      needs_f32 ? a.widened.data() : nullptr, a.xsum.data(), xb, t.y, true};
  if (is_int8_activation(a.isa))
    a.quantized.quantize(xb, rows, k, a.isa, t.bits == 4, a.problem,
                         fused_sums ? a.xsum.data() : nullptr, t.group_size);
  a.task = t.serial;
  a.rows = rows;
}

void run_blocks(const GemvTask& t, const Problem& p, int64_t isa, int64_t b0, int64_t b1) {
  if (t.bits == 4) {
    const auto* c = static_cast<const uint8_t*>(t.codes);
    const auto* sm = static_cast<const uint16_t*>(t.scales);
    if (isa == kAvx512Vnni) int4_vnni(p, c, sm, b0, b1);
    else if (isa == kAvx512Bf16) int4_avx512bf16(p, c, sm, b0, b1);
    else if (isa == kAvx512) int4_avx512(p, c, sm, b0, b1);
    else if (isa == kAvx2Int8) int4_avx2_int8(p, c, sm, b0, b1);
    else if (isa == kAvx2) int4_avx2(p, c, sm, b0, b1);
    else int4_portable(p, c, sm, b0, b1);
  } else {
    const auto* c = static_cast<const int8_t*>(t.codes);
    const auto* s = static_cast<const float*>(t.scales);
    if (isa == kAvx512Vnni) int8_vnni(p, c, s, b0, b1);
    else if (is_avx512(isa)) int8_avx512(p, c, s, b0, b1);
    else if (isa == kAvx2Int8) int8_avx2_int8(p, c, s, b0, b1);
    else if (isa == kAvx2) int8_avx2(p, c, s, b0, b1);
    else int8_portable(p, c, s, b0, b1);
  }
}

// Rows [r0, r1) of a shared preparation (the same per-row work as prepare, so the same bits).
void prepare_shared_rows(const GemvTask& t, int64_t rows, int64_t r0, int64_t r1) {
  const SharedActivations a = shared_activations(t, rows);
  quantize_row_range(effective_isa(t.isa, true, t.in_features, rows),
                     reinterpret_cast<const uint16_t*>(t.x), r0, r1, t.in_features, t.bits == 4,
                     a.xq, a.xd, a.xqsum, t.bits == 4 ? a.xsum : nullptr, t.group_size);
}

// Task functions (fn(args, rows, begin, end)): gemv_prepare_task, then gemv_blocks_task (any
// shares of blocks, e.g. taken dynamically).

// Below the task's split_from_rows (items ignored) each thread prepares every row for itself;
// from it, the items are rows and the threads share them (a barrier follows).
void gemv_prepare_task(const void* raw, int64_t rows, int64_t r0, int64_t r1) {
  const GemvTask& t = *static_cast<const GemvTask*>(raw);
  if (shares_preparation(t, rows)) prepare_shared_rows(t, rows, r0, r1);
  else prepare(t, rows);
}

void gemv_blocks_task(const void* raw, int64_t rows, int64_t b0, int64_t b1) {
  const GemvTask& t = *static_cast<const GemvTask*>(raw);
  if (shares_preparation(t, rows)) {
    const SharedActivations a = shared_activations(t, rows);
    const int64_t isa = effective_isa(t.isa, true, t.in_features, rows);
    const int64_t num_groups = t.bits == 4 ? t.in_features / t.group_size : 0;
    Problem p{rows, t.in_features, t.out_features, t.num_blocks, t.group_size, num_groups,
              nullptr, a.xsum, reinterpret_cast<const uint16_t*>(t.x), t.y, true};
    p.xq = a.xq;
    p.xd = a.xd;
    p.xqsum = isa == kAvx2Int8 ? nullptr : a.xqsum;
    run_blocks(t, p, isa, b0, b1);
    return;
  }
  if (prepared.task != t.serial || prepared.rows != rows) prepare(t, rows);  // not prepared yet
  run_blocks(t, prepared.problem, prepared.isa, b0, b1);
}

// (task arguments capsule, number of blocks): y = x @ W^T for the rows of each run, x and y
// buffers of the step (bf16, contiguous, at least as many rows as any run uses).
py::tuple make_gemv_task(const at::Tensor& x, const at::Tensor& y, const at::Tensor& codes,
                         const at::Tensor& scales, int64_t bits, int64_t group_size,
                         int64_t out_features, int64_t isa,
                         const c10::optional<at::Tensor>& scratch, int64_t split_from_rows) {
  check_isa(isa);
  TORCH_CHECK(bits == 4 || bits == 8, "quant_gemm: bits must be 4 or 8");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && y.scalar_type() == at::kBFloat16 &&
                  x.is_contiguous() && y.is_contiguous() && x.dim() == 2 && y.dim() == 2 &&
                  y.size(1) == out_features && y.size(0) == x.size(0),
              "quant_gemm task: x, y must be contiguous bf16 [rows, in], [rows, out]");
  const int64_t in_features = x.size(1), num_blocks = (out_features + kBlock - 1) / kBlock;
  const int64_t code_width = bits == 4 ? in_features / 2 : in_features;
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() &&
                  codes.sizes() == at::IntArrayRef({num_blocks, code_width, kBlock}) &&
                  scales.scalar_type() == (bits == 4 ? at::kHalf : at::kFloat),
              "quant_gemm task: packed codes/scales do not match x and out_features");
  TORCH_CHECK(bits == 8 || (group_size > 0 && in_features % group_size == 0),
              "quant_gemm task: in_features must be a multiple of group_size");
  auto* task = new GemvTask{bits, codes.data_ptr(), scales.data_ptr(), group_size,
                            in_features, out_features, num_blocks, isa,
                            x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(),
                            next_gemv_task_serial.fetch_add(1)};
  if (scratch.has_value()) {
    TORCH_CHECK(scratch->scalar_type() == at::kByte && scratch->is_contiguous(),
                "quant_gemm task: the scratch must be a contiguous uint8 tensor");
    TORCH_CHECK(split_from_rows >= 1, "quant_gemm task: split_from_rows must be positive");
    task->scratch = scratch->data_ptr<uint8_t>();
    task->scratch_bytes = scratch->numel();
    task->split_from_rows = split_from_rows;
  }
  py::capsule args(task, "mini_infer.task_args",
                   [](void* p) { delete static_cast<GemvTask*>(p); });
  return py::make_tuple(args, num_blocks);
}

// Rows of what an int8 weight's codes stand for, from the packed layout (codes [blocks, K, 16],
// scale [blocks * 16]): out[r, k] = bf16(float(q[index[r], k]) * s[index[r]]), rounded to
// nearest even as torch's `.to(bfloat16)` rounds, so the bits are those of
// engine/quant/linear.py's `dequantized_rows` then that cast (a tied embedding looked up in the
// int8 lm_head's codes: engine/quant/embedding.py). One item per row; the indices are checked
// by the caller before the step runs (a task cannot raise).
struct GatherRowsTask {
  const int8_t* codes;
  const float* scales;
  const int64_t* index;  // [rows]
  at::BFloat16* out;     // [rows, K]
  int64_t in_features;
};

void gather_rows_task(const void* raw, int64_t rows, int64_t begin, int64_t end) {
  const GatherRowsTask& t = *static_cast<const GatherRowsTask*>(raw);
  const int64_t K = t.in_features;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t id = t.index[r];
    const int8_t* column = t.codes + (id / kBlock) * K * kBlock + id % kBlock;
    const float scale = t.scales[id];
    at::BFloat16* row = t.out + r * K;
    for (int64_t k = 0; k < K; ++k)
      row[k] = static_cast<at::BFloat16>(static_cast<float>(column[k * kBlock]) * scale);
  }
}

// codes int8 [blocks, K, 16] and scales float32 [blocks * 16] (an int8 QuantLinear's packed
// weight), index int64 [max_rows] and out bf16 [max_rows, K], contiguous: the step's buffers.
py::capsule make_gather_rows_task(const at::Tensor& codes, const at::Tensor& scales,
                                  const at::Tensor& index, const at::Tensor& out) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 3 && codes.size(2) == kBlock &&
                  codes.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && scales.numel() == codes.size(0) * kBlock,
              "gather rows task: codes int8 [blocks, K, 16] and scales float32 [blocks * 16]");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.is_contiguous() &&
                  out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.is_contiguous() &&
                  out.size(0) == index.size(0) && out.size(1) == codes.size(1),
              "gather rows task: index int64 [rows] and out bf16 [rows, K], contiguous");
  auto* task = new GatherRowsTask{codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                                  index.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(),
                                  codes.size(1)};
  return py::capsule(task, "mini_infer.task_args",
                     [](void* p) { delete static_cast<GatherRowsTask*>(p); });
}

// An int8-activation path's activation codes and scales, for the tests: (codes int8 [rows, K]
// in input order, scales float32 [rows, K / 32]).
py::tuple quantize_activations(const at::Tensor& x, int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(is_int8_activation(isa), "quant_gemm: isa ", isa, " keeps its activations");
  const Activations a = activations(x);
  TORCH_CHECK(a.cols % kChunk == 0, "quant_gemm: K must be a multiple of ", kChunk);
  at::Tensor codes = at::empty({a.rows, a.cols}, at::kChar);
  at::Tensor scales = at::empty({a.rows, a.cols / kChunk}, at::kFloat);
  std::vector<int32_t> sums(a.rows * (a.cols / kChunk));
  if (isa == kAvx2Int8)
    quantize_rows_avx2(a.f32, a.rows, a.cols, codes.data_ptr<int8_t>(), scales.data_ptr<float>());
  else
    quantize_rows(a.f32, a.rows, a.cols, false, codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                  sums.data());
  return py::make_tuple(codes, scales);
}

// The int4 groups' activation sums [rows, K / group_size] as path `isa` makes them for its
// GEMV (the tests hold every path's to group_sums' bits).
at::Tensor activation_group_sums(const at::Tensor& x, int64_t group_size, int64_t isa) {
  check_isa(isa);
  const Activations a = activations(x);
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && a.cols % group_size == 0,
              "quant_gemm: K must be a multiple of group_size, a multiple of 8");
  at::Tensor sums = at::empty({a.rows, a.cols / group_size}, at::kFloat);
  if (is_int8_activation(isa) && a.cols % kChunk == 0 && sums_while_quantizing(isa, group_size)) {
    Problem p{};
    QuantizedActivations qa;
    qa.quantize(a.f32, a.rows, a.cols, isa, true, p, sums.data_ptr<float>(), group_size);
  } else {
    group_sums(a.f32, a.rows, a.cols, group_size, sums.data_ptr<float>());
  }
  return sums;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("activation_group_sums", &activation_group_sums,
        "the int4 groups' activation sums as a path makes them", py::arg("x"),
        py::arg("group_size"), py::arg("isa"));
  m.def("int4_gemm", &int4_gemm, "y = x @ W^T, W int4 group-wise (blocked layout)",
        py::arg("x"), py::arg("codes"), py::arg("scale_min"), py::arg("group_size"),
        py::arg("out_features"), py::arg("isa"), py::arg("out") = py::none());
  m.def("int8_gemm", &int8_gemm, "y = x @ W^T, W int8 per output channel (blocked layout)",
        py::arg("x"), py::arg("codes"), py::arg("scale"), py::arg("out_features"),
        py::arg("isa"), py::arg("out") = py::none());
  m.def("quantize_activations", &quantize_activations, "an int8-activation path's activations",
        py::arg("x"), py::arg("isa"));
  m.def("gemv_prepare_task_fn", [] {
    return py::capsule(reinterpret_cast<void*>(&gemv_prepare_task), "mini_infer.task_fn");
  }, "a GEMV's activations prepared by each thread (run on every thread)");
  m.def("gemv_blocks_task_fn", [] {
    return py::capsule(reinterpret_cast<void*>(&gemv_blocks_task), "mini_infer.task_fn");
  }, "a GEMV's blocks, on the activations the thread prepared");
  m.def("make_gemv_task", &make_gemv_task, "(task arguments, blocks) for one GEMV of a fused step",
        py::arg("x"), py::arg("y"), py::arg("codes"), py::arg("scales"), py::arg("bits"),
        py::arg("group_size"), py::arg("out_features"), py::arg("isa"),
        py::arg("scratch") = py::none(), py::arg("split_from_rows") = 0);
  m.def("gather_rows_task_fn", [] {
    return py::capsule(reinterpret_cast<void*>(&gather_rows_task), "mini_infer.task_fn");
  });
  m.def("make_gather_rows_task", &make_gather_rows_task,
        "a fused step's lookup of rows of an int8 weight's codes, dequantized to bf16");
}
