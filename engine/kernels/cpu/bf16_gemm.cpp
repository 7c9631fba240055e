// bf16 GEMV / small GEMM (decode: 1..16 activation rows; any row count works) for unquantized
// bf16 linears, lm_head included: y = x W^T (+ b), fp32 accumulation, bf16 output.
//
// Weight layout (packed once at load by bf16_gemm.py): output channels in blocks of 16, input
// positions in pairs, and for each pair the 16 channels' two weights side by side:
//   packed bf16 [num_blocks, K2/2, 16, 2]: packed[b, p, j, i] = W[16b + j, 2p + i]
// (K2 = in_features rounded up to even; padded inputs and channels are zero). One 64-byte
// entry [16, 2] is one AVX-512 vector: lane j holds channel j's pair, which is what
// `vdpbf16ps` multiplies by a broadcast pair of activations (32 MACs per instruction). A
// thread's blocks are contiguous, so its weight stream is read in order, exactly once per call.
//
// Instruction sets, all compiled into one library (function-level target attributes) and chosen
// per call by the `isa` argument (numbered as quant_gemm.cpp's), so each is forced and tested on
// any CPU that can run it:
//   avx512bf16: vdpbf16ps on bf16 activation pairs;
//   avx512:     bf16 -> fp32 by shifts (even element: << 16, odd: & 0xffff0000) + FMA;
//   avx2:       the same on two 8-lane halves of a block;
//   portable:   scalar.
// Products of bf16 values are exact in fp32 and every sum is fp32 (torch's bf16 F.linear also
// accumulates in fp32); the output is rounded to nearest even once, after the bias is added.
//
// Threads: one OpenMP parallel region per call; each thread takes a contiguous, equal share of
// the output blocks (a static split: no scheduling, and each core streams its own part). A
// weight under ~32 KiB per thread runs on fewer threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv_prefetch.h"

namespace {

constexpr int64_t kBlock = 16;  // output channels per block (one AVX-512 vector of fp32)
enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };
constexpr int64_t kAvx2Rows = 4;  // rows per tile of the AVX2 path (and of its activations)

struct Problem {
  int64_t rows, num_pairs, out_features;
  // The activations pair-major, so that a step over one pair reads all rows' values from one
  // or two cache lines (row-major rows 4 KiB apart would alias in L1 at K = 2048):
  const uint32_t* xpairs;  // bf16 [num_pairs, rows], one uint32 per pair
  // The same widened to fp32 (FMA paths): [num_pairs, rows, 2], but for the AVX2 path in tiles
  // of kAvx2Rows rows (`widen_tiles`; it has no xpairs).
  const float* xf;
  const uint16_t* w;       // packed [num_blocks, num_pairs, 16, 2]
  const float* bias;       // fp32 [num_blocks * 16] (zero padded), or nullptr
  at::BFloat16* y;         // [rows, out_features]
};

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// y[row, col0 + j] = v[j] for j < lanes, rounded to nearest even.
inline void store_lanes(const Problem& p, int64_t row, int64_t col0, int64_t lanes,
                        const float* v) {
  for (int64_t j = 0; j < lanes; ++j)
    p.y[row * p.out_features + col0 + j] = static_cast<at::BFloat16>(v[j]);
}

inline const float* bias_of(const Problem& p, int64_t b) {
  return p.bias == nullptr ? nullptr : p.bias + b * kBlock;
}

// ---------------------------------------------------------------------------------------------
// Portable scalar path.

void block_portable(const Problem& p, int64_t b, int64_t row0, int64_t n) {
  const uint16_t* wb = p.w + b * p.num_pairs * 2 * kBlock;
  const int64_t lanes = std::min(kBlock, p.out_features - b * kBlock);
  const float* bias = bias_of(p, b);
  for (int64_t r = row0; r < row0 + n; ++r) {
    float acc[kBlock] = {};
    for (int64_t e = 0; e < p.num_pairs; ++e) {
      const uint16_t* we = wb + e * 2 * kBlock;
      const float* x = p.xf + (e * p.rows + r) * 2;
      for (int64_t j = 0; j < kBlock; ++j)
        acc[j] += bf16_to_float(we[2 * j]) * x[0] + bf16_to_float(we[2 * j + 1]) * x[1];
    }
    if (bias != nullptr)
      for (int64_t j = 0; j < kBlock; ++j) acc[j] += bias[j];
    store_lanes(p, r, b * kBlock, lanes, acc);
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512: R rows (R <= 16) over one block, U independent accumulators per row along the pairs
// so the dot-product / FMA latency does not serialise a row (R * U <= 16 registers).

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define AVX512BF16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

template <int R>
constexpr int unroll() { return R >= 8 ? 1 : (R >= 4 ? 2 : 4); }

// 16 fp32 lanes rounded to nearest-even bf16: add 0x7fff plus the lowest kept bit, keep the
// high half.
AVX512_TARGET __attribute__((always_inline)) inline __m256i round_bf16_avx512(__m512 a) {
  const __m512i bits = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_cvtepi32_epi16(rounded);
}

// Sum the U accumulators of each row, add the bias, round to bf16 and store (masked lanes).
template <int R, int U>
AVX512_TARGET __attribute__((always_inline)) inline void finish_avx512(const Problem& p, int64_t b, int64_t row0,
                                        __m512 (&acc)[R][U]) {
  const int64_t lanes = std::min(kBlock, p.out_features - b * kBlock);
  const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
  const float* bias = bias_of(p, b);
  const __m512 bias_v = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias);
  for (int r = 0; r < R; ++r) {
    __m512 a = acc[r][0];
    for (int u = 1; u < U; ++u) a = _mm512_add_ps(a, acc[r][u]);
    a = _mm512_add_ps(a, bias_v);
    _mm256_mask_storeu_epi16(p.y + (row0 + r) * p.out_features + b * kBlock, mask,
                             round_bf16_avx512(a));
  }
}

template <int R>
AVX512BF16_TARGET void block_avx512bf16(const Problem& p, int64_t b, int64_t row0) {
  constexpr int U = unroll<R>();
  const uint16_t* wb = p.w + b * p.num_pairs * 2 * kBlock;
  const uint32_t* x = p.xpairs + row0;
  __m512 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  const int64_t main_pairs = p.num_pairs - p.num_pairs % U;
  for (int64_t e = 0; e < main_pairs; e += U) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(wb + (e + u) * 2 * kBlock);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        acc[r][u] = _mm512_dpbf16_ps(
            acc[r][u], w, (__m512bh)_mm512_set1_epi32(x[(e + u) * p.rows + r]));
    }
  }
  for (int64_t e = main_pairs; e < p.num_pairs; ++e) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(wb + e * 2 * kBlock);
    for (int r = 0; r < R; ++r)
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w,
                                   (__m512bh)_mm512_set1_epi32(x[e * p.rows + r]));
  }
  finish_avx512<R, U>(p, b, row0, acc);
}

// From kWideMinRows rows, the avx512bf16 path's tiles are kWideRows rows over kWideBlocks blocks
// at once (`blocks_avx512bf16`): a pair's step loads 2 weight vectors and 8 broadcasts for 16
// dot products, where one block over 16 rows loads 17 for 16. There the GEMM is bound by the
// core, not the memory. On the 2-core Zen 5, SmolLM2's lm_head (576 -> 49152) at 32 and 64
// rows: 1.15-1.37x and 1.16-1.19x the one-block tiles, even with oneDNN; its other shapes
// 0.97-1.04x; at 8 and 16 rows, where the weights' bytes bound the call, two weight streams
// were slower (0.77-0.98x, `loadtest/JOURNAL.md`, fortieth session). Three or four blocks, or
// 12 rows, were 2-3x slower while the accumulators did not stay in registers (gemv_prefetch.h),
// and no faster once they did: 0.87-1.02x (forty-first session). One accumulator per row and
// block, as block_avx512bf16 keeps from 8 rows: the same sums.
constexpr int64_t kWideMinRows = 32;
constexpr int kWideRows = 8;
constexpr int kWideBlocks = 2;

template <int NB, int R>
AVX512BF16_TARGET void blocks_avx512bf16(const Problem& p, int64_t b, int64_t row0) {
  const int64_t stride = p.num_pairs * 2 * kBlock;  // bf16 values per block
  const uint16_t* wb = p.w + b * stride;
  const uint32_t* x = p.xpairs + row0;
  __m512 acc[NB][R][1];
#pragma GCC unroll 4
  for (int nb = 0; nb < NB; ++nb)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[nb][r][0] = _mm512_setzero_ps();
  for (int64_t e = 0; e < p.num_pairs; ++e) {
    __m512bh w[NB];
#pragma GCC unroll 4
    for (int nb = 0; nb < NB; ++nb) {
      gemv_prefetch::ahead(wb + nb * stride + e * 2 * kBlock, 2 * kBlock * sizeof(uint16_t));
      w[nb] = (__m512bh)_mm512_loadu_si512(wb + nb * stride + e * 2 * kBlock);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(x[e * p.rows + r]);
#pragma GCC unroll 4
      for (int nb = 0; nb < NB; ++nb) acc[nb][r][0] = _mm512_dpbf16_ps(acc[nb][r][0], w[nb], xr);
    }
  }
#pragma GCC unroll 4
  for (int nb = 0; nb < NB; ++nb) finish_avx512<R, 1>(p, b + nb, row0, acc[nb]);
}

// acc[r][u] += W's pair e (as fp32: even element << 16, odd & 0xffff0000) * x[r, 2e..2e+1].
template <int R, int U>
AVX512_TARGET __attribute__((always_inline)) inline void fma_pair_avx512(const uint16_t* wb, const float* x, int64_t x_stride,
                                          int64_t e, int u, __m512 (&acc)[R][U]) {
  const __m512i w = _mm512_loadu_si512(wb + e * 2 * kBlock);
  const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  const __m512 odd = _mm512_castsi512_ps(
      _mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc[r][u] = _mm512_fmadd_ps(even, _mm512_set1_ps(x[e * x_stride + 2 * r]), acc[r][u]);
    acc[r][u] = _mm512_fmadd_ps(odd, _mm512_set1_ps(x[e * x_stride + 2 * r + 1]), acc[r][u]);
  }
}

template <int R>
AVX512_TARGET void block_avx512(const Problem& p, int64_t b, int64_t row0) {
  constexpr int U = unroll<R>();
  const uint16_t* wb = p.w + b * p.num_pairs * 2 * kBlock;
  const int64_t x_stride = 2 * p.rows;  // floats per pair
  const float* x = p.xf + 2 * row0;
  __m512 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  const int64_t main_pairs = p.num_pairs - p.num_pairs % U;
  for (int64_t e = 0; e < main_pairs; e += U) {
    gemv_prefetch::ahead(wb + e * 2 * kBlock, U * 2 * kBlock * sizeof(uint16_t));
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) fma_pair_avx512<R, U>(wb, x, x_stride, e + u, u, acc);
  }
  for (int64_t e = main_pairs; e < p.num_pairs; ++e) fma_pair_avx512<R, U>(wb, x, x_stride, e, 0, acc);
  finish_avx512<R, U>(p, b, row0, acc);
}

// ---------------------------------------------------------------------------------------------
// AVX2: a block is two 8-lane halves (channels 0-7 and 8-15), both computed in one pass; at most
// 4 rows at a time (8 accumulators + 4 weight vectors + broadcasts in 16 ymm registers). Up to 3
// rows, two accumulators per half and row take alternate pairs, so that one row is not two
// chains of dependent FMAs (1.01-1.05x at one row on the Zen 3; the prefetch, 2 KiB ahead as on
// the AVX-512 paths, is most of that path's 1.08-1.16x on a 1B model's shapes). The same
// grouping at 1 to 3 rows, so a row gets the bits of the row alone (ROWS_ALIKE).

#define AVX2_TARGET __attribute__((target("avx2,fma")))

// acc[r][h][u] += W's pair e (as fp32: even element << 16, odd & 0xffff0000) * x[r, 2e..2e+1].
template <int R, int U>
AVX2_TARGET __attribute__((always_inline)) inline void fma_pair_avx2(
    const uint16_t* wb, const float* x, int64_t x_stride, int64_t e, int u,
    __m256 (&acc)[R][2][U]) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256i* we = reinterpret_cast<const __m256i*>(wb + e * 2 * kBlock);
  __m256 even[2], odd[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i w = _mm256_loadu_si256(we + h);
    even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    odd[h] = _mm256_castsi256_ps(_mm256_and_si256(w, high));
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256 x0 = _mm256_set1_ps(x[e * x_stride + 2 * r]);
    const __m256 x1 = _mm256_set1_ps(x[e * x_stride + 2 * r + 1]);
    for (int h = 0; h < 2; ++h)
      acc[r][h][u] = _mm256_fmadd_ps(odd[h], x1, _mm256_fmadd_ps(even[h], x0, acc[r][h][u]));
  }
}

template <int R>
AVX2_TARGET void block_avx2(const Problem& p, int64_t b, int64_t row0) {
  constexpr int U = R <= 3 ? 2 : 1;
  const uint16_t* wb = p.w + b * p.num_pairs * 2 * kBlock;
  // This tile's activations (`widen_tiles`): R rows, the layout's tile from row0 on.
  const int64_t x_stride = 2 * R;  // floats per pair
  const float* x = p.xf + row0 * p.num_pairs * 2;
  // Every loop over acc is unrolled, so that it lives in registers: indexed at run time
  // anywhere (as the epilogue's loop once did), it lived on the stack, and every FMA of 2 to 4
  // rows loaded and stored its accumulator (1.14-1.58x the time at 16-64 rows on the Zen 3;
  // loadtest/JOURNAL.md, thirty-fifth session).
  __m256 acc[R][2][U];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      for (int u = 0; u < U; ++u) acc[r][h][u] = _mm256_setzero_ps();
  const int64_t main_pairs = p.num_pairs - p.num_pairs % U;
  for (int64_t e = 0; e < main_pairs; e += U) {
    gemv_prefetch::ahead(wb + e * 2 * kBlock, U * 2 * kBlock * sizeof(uint16_t));
    for (int u = 0; u < U; ++u) fma_pair_avx2<R, U>(wb, x, x_stride, e + u, u, acc);
  }
  for (int64_t e = main_pairs; e < p.num_pairs; ++e)
    fma_pair_avx2<R, U>(wb, x, x_stride, e, 0, acc);
  const int64_t lanes = std::min(kBlock, p.out_features - b * kBlock);
  const float* bias = bias_of(p, b);
  alignas(32) float out[R][kBlock];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      __m256 a = acc[r][h][0];
      for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[r][h][u]);
      if (bias != nullptr) a = _mm256_add_ps(a, _mm256_loadu_ps(bias + 8 * h));
      _mm256_store_ps(out[r] + 8 * h, a);
    }
  }
  for (int r = 0; r < R; ++r) store_lanes(p, row0 + r, b * kBlock, lanes, out[r]);
}

// ---------------------------------------------------------------------------------------------
// Row tiling: each block's weights are read from memory once; every tile of rows after the
// first finds them in L1/L2 (a block is K2 * 32 bytes: 64 KiB at K = 2048).

#define DISPATCH_ROWS_16(n, CALL)                                                       \
  switch (n) {                                                                          \
    case 1: CALL(1); break;   case 2: CALL(2); break;   case 3: CALL(3); break;         \
    case 4: CALL(4); break;   case 5: CALL(5); break;   case 6: CALL(6); break;         \
    case 7: CALL(7); break;   case 8: CALL(8); break;   case 9: CALL(9); break;         \
    case 10: CALL(10); break; case 11: CALL(11); break; case 12: CALL(12); break;       \
    case 13: CALL(13); break; case 14: CALL(14); break; case 15: CALL(15); break;       \
    default: CALL(16); break;                                                           \
  }

void run_blocks(const Problem& p, int64_t isa, int64_t b0, int64_t b1) {
  if (isa == kAvx512Bf16 && p.rows >= kWideMinRows) {
    // Tiles of kWideRows rows for every block (so a row's sums do not depend on its block),
    // kWideBlocks blocks at a time; the rows past the last whole tile, and the blocks past the
    // last whole group, one block at a time.
    const int64_t whole = p.rows - p.rows % kWideRows;
    int64_t b = b0;
    for (; b + kWideBlocks <= b1; b += kWideBlocks) {
      for (int64_t r0 = 0; r0 < whole; r0 += kWideRows)
        blocks_avx512bf16<kWideBlocks, kWideRows>(p, b, r0);
      if (whole < p.rows)
        for (int64_t nb = 0; nb < kWideBlocks; ++nb) {
#define CALL(R) block_avx512bf16<R>(p, b + nb, whole)
          DISPATCH_ROWS_16(p.rows - whole, CALL)
#undef CALL
        }
    }
    for (; b < b1; ++b)
      for (int64_t r0 = 0; r0 < p.rows; r0 += kWideRows) {
#define CALL(R) block_avx512bf16<R>(p, b, r0)
        DISPATCH_ROWS_16(std::min<int64_t>(kWideRows, p.rows - r0), CALL)
#undef CALL
      }
    return;
  }
  const int64_t max_tile = isa >= kAvx512 ? 16 : (isa == kAvx2 ? kAvx2Rows : 1);
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t r0 = 0; r0 < p.rows; r0 += max_tile) {
      const int64_t n = std::min(max_tile, p.rows - r0);
      if (isa == kAvx512Bf16) {
#define CALL(R) block_avx512bf16<R>(p, b, r0)
        DISPATCH_ROWS_16(n, CALL)
#undef CALL
      } else if (isa == kAvx512) {
#define CALL(R) block_avx512<R>(p, b, r0)
        DISPATCH_ROWS_16(n, CALL)
#undef CALL
      } else if (isa == kAvx2) {
        switch (n) {
          case 1: block_avx2<1>(p, b, r0); break;
          case 2: block_avx2<2>(p, b, r0); break;
          case 3: block_avx2<3>(p, b, r0); break;
          default: block_avx2<4>(p, b, r0); break;
        }
      } else {
        block_portable(p, b, r0, n);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Entry point.

void check_isa(int64_t isa) {
  TORCH_CHECK(isa >= kPortable && isa <= kAvx512Bf16, "bf16_gemm: unknown isa ", isa);
  if (isa == kAvx512Bf16) {
    TORCH_CHECK(__builtin_cpu_supports("avx512bf16"),
                "bf16_gemm: this CPU cannot run the avx512bf16 path");
  }
  if (isa >= kAvx512) {
    TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"),
                "bf16_gemm: this CPU cannot run the avx512 paths");
  } else if (isa == kAvx2) {
    TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
                "bf16_gemm: this CPU cannot run the avx2 path");
  }
}

// The activations pair-major (see Problem; an odd in_features gets a zero appended) and, for the
// FMA paths, widened to fp32: plain loops, since at one row an ATen op would cost more.
void pair_up(const uint16_t* bits, int64_t rows, int64_t k, int64_t num_pairs, uint32_t* pairs) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = bits + r * k;
    for (int64_t e = 0; e < num_pairs; ++e) {
      const uint32_t low = row[2 * e];
      const uint32_t high = 2 * e + 1 < k ? row[2 * e + 1] : 0;
      pairs[e * rows + r] = low | (high << 16);
    }
  }
}

// `pairs` as fp32 [num_pairs, rows, 2], pair-major: what the AVX-512 and portable paths read.
void widen(const uint32_t* pairs, int64_t rows, int64_t num_pairs, float* out) {
  for (int64_t i = 0; i < num_pairs * rows; ++i) {
    out[2 * i] = bf16_to_float(static_cast<uint16_t>(pairs[i] & 0xffffu));
    out[2 * i + 1] = bf16_to_float(static_cast<uint16_t>(pairs[i] >> 16));
  }
}

// What the AVX2 path reads: x (bf16 [rows, k], row-major) as fp32 in tiles of kAvx2Rows rows, the
// path's tile. The tile of rows r0 .. r0 + n - 1 (n = kAvx2Rows, or the rows left) is
// [num_pairs, n, 2] from float r0 * num_pairs * 2 on; an odd k gets a zero appended. Tiles
// [t0, t1) only, so that threads can share the work. Each pass over a block then reads one
// sequential run: pair-major, at tens of rows, its reads strode across all of
// [num_pairs, rows, 2] (1.25 MB at 39 rows of K = 8192, past L2), and 39-row GEMMs of a 1B
// Llama's shapes took 1.1-1.3x as long. Built straight from x, without the pair-major copy
// (whose writes, a row apart by rows * 4 bytes, cost ~10 ns a pair at 1024 rows), and by the
// threads of the call: on one thread the preparation was a tenth of a 1024-row GEMM
// (loadtest/JOURNAL.md, thirty-sixth session). The values and the order of every sum are
// those of the pair-major layout: so are the bits.
void widen_tiles(const uint16_t* x, int64_t rows, int64_t k, int64_t num_pairs, float* out,
                 int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t r0 = t * kAvx2Rows, n = std::min(kAvx2Rows, rows - r0);
    float* o = out + r0 * num_pairs * 2;
    for (int64_t r = 0; r < n; ++r) {
      const uint16_t* row = x + (r0 + r) * k;
      for (int64_t e = 0; e < k / 2; ++e) {
        o[(e * n + r) * 2] = bf16_to_float(row[2 * e]);
        o[(e * n + r) * 2 + 1] = bf16_to_float(row[2 * e + 1]);
      }
      if (k % 2 != 0) {
        o[((num_pairs - 1) * n + r) * 2] = bf16_to_float(row[k - 1]);
        o[((num_pairs - 1) * n + r) * 2 + 1] = 0.f;
      }
    }
  }
}

int64_t num_tiles(int64_t rows) { return (rows + kAvx2Rows - 1) / kAvx2Rows; }

// The layouts every path but AVX2 reads: the pairs and, for the FMA paths (avx512, portable),
// their fp32 widening.
void lay_out_pair_major(const uint16_t* bits, int64_t rows, int64_t k, int64_t num_pairs,
                        int64_t isa, std::vector<uint32_t>& pairs, std::vector<float>& widened) {
  pairs.resize(num_pairs * rows);
  pair_up(bits, rows, k, num_pairs, pairs.data());
  if (isa != kAvx512Bf16) {
    widened.resize(num_pairs * rows * 2);
    widen(pairs.data(), rows, num_pairs, widened.data());
  }
}

// The activations as `isa` reads them: pairs (avx512bf16), pairs widened pair-major (avx512,
// portable) or, for the AVX2 path, room for `widen_tiles`, which the call's threads fill (left
// uninitialised: at 1024 rows a zero fill alone was a few percent of the call).
struct Activations {
  at::Tensor contiguous;
  std::vector<uint32_t> pairs;  // [num_pairs, rows]
  std::vector<float> widened;   // `widen`'s layout
  at::Tensor tiles;             // fp32, `widen_tiles`' layout (AVX2)
};

Activations activations(const at::Tensor& x, int64_t num_pairs, int64_t isa) {
  Activations a;
  a.contiguous = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  if (isa == kAvx2) {
    a.tiles = at::empty({num_pairs * rows * 2}, x.options().dtype(at::kFloat));
  } else {
    lay_out_pair_major(reinterpret_cast<const uint16_t*>(a.contiguous.data_ptr()), rows, k,
                       num_pairs, isa, a.pairs, a.widened);
  }
  return a;
}

at::Tensor output(const at::Tensor& x, int64_t out_features, const c10::optional<at::Tensor>& out) {
  if (!out.has_value()) return at::empty({x.size(0), out_features}, x.options());
  const at::Tensor& y = *out;
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.is_contiguous() &&
                  y.sizes() == at::IntArrayRef({x.size(0), out_features}),
              "bf16_gemm: out must be contiguous bfloat16 [", x.size(0), ", ", out_features, "]");
  return y;
}

// Threads for a weight of `bytes`: at least ~32 KiB each, at most torch's intra-op count.
int num_threads_for(int64_t bytes, int64_t num_blocks) {
  const int64_t by_size = std::max<int64_t>(1, bytes / (32 << 10));
  return static_cast<int>(std::min<int64_t>({by_size, num_blocks, at::get_num_threads()}));
}

at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t isa,
                     const c10::optional<at::Tensor>& out) {
  check_isa(isa);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "bf16_gemm: x must be bfloat16 [rows, in_features], got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(out_features > 0, "bf16_gemm: out_features must be positive");
  const int64_t rows = x.size(0), in_features = x.size(1);
  const int64_t num_pairs = (in_features + 1) / 2;
  const int64_t num_blocks = (out_features + kBlock - 1) / kBlock;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.sizes() == at::IntArrayRef({num_blocks, num_pairs, kBlock, 2}),
              "bf16_gemm: packed weight must be contiguous bfloat16 [", num_blocks, ", ",
              num_pairs, ", 16, 2] for in_features ", in_features, ", got ", packed.sizes());
  std::vector<float> bias_f32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features,
                "bf16_gemm: bias must be [", out_features, "], got ", bias->sizes());
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    bias_f32.assign(num_blocks * kBlock, 0.f);
    std::memcpy(bias_f32.data(), b.data_ptr<float>(), out_features * sizeof(float));
  }
  at::Tensor y = output(x, out_features, out);
  if (rows == 0) return y;
  const Activations a = activations(x, num_pairs, isa);
  float* tiles = a.tiles.defined() ? a.tiles.data_ptr<float>() : nullptr;
  const float* xf = tiles != nullptr ? tiles : a.widened.empty() ? nullptr : a.widened.data();
  const Problem p{rows, num_pairs, out_features, a.pairs.empty() ? nullptr : a.pairs.data(), xf,
                  reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                  bias_f32.empty() ? nullptr : bias_f32.data(),
                  y.data_ptr<at::BFloat16>()};
  // The AVX2 path's activations, laid out by the threads that read them, tiles shared out.
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(a.contiguous.data_ptr());
  const int64_t count = num_tiles(rows);
  const int num_threads = num_threads_for(packed.numel() * 2, num_blocks);
  if (num_threads == 1) {
    if (tiles != nullptr) widen_tiles(bits, rows, in_features, num_pairs, tiles, 0, count);
    run_blocks(p, isa, 0, num_blocks);
    return y;
  }
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    if (tiles != nullptr) {
      widen_tiles(bits, rows, in_features, num_pairs, tiles, count * t / n, count * (t + 1) / n);
#pragma omp barrier
    }
    run_blocks(p, isa, num_blocks * t / n, num_blocks * (t + 1) / n);
  }
  return y;
}

// ---------------------------------------------------------------------------------------------
// One linear of a fused decode step (engine/kernels/cpu/decode_step.cpp runs it inside its one
// parallel region, each thread over its share of the blocks): run_blocks on activations laid
// out as `activations` lays them out, so the bits are bf16_gemm's.

struct GemvTask {
  const uint16_t* w;  // packed [num_blocks, num_pairs, 16, 2]
  std::vector<float> bias;  // fp32 [num_blocks * 16], or empty
  int64_t in_features, out_features, num_pairs, num_blocks, isa;
  const uint16_t* x;  // bf16 [rows, in_features], contiguous
  at::BFloat16* y;    // [rows, out_features], contiguous
};

// The step's activations as `activations` lays them out, in this thread's buffers: the Problem
// of task `t` for `rows` rows.
Problem lay_out(const GemvTask& t, int64_t rows) {
  const int64_t k = t.in_features, num_pairs = t.num_pairs;
  thread_local std::vector<uint32_t> pairs;  // each thread lays out the few rows itself
  thread_local std::vector<float> widened;
  if (t.isa == kAvx2) {
    widened.resize(num_pairs * rows * 2);
    widen_tiles(t.x, rows, k, num_pairs, widened.data(), 0, num_tiles(rows));
  } else {
    lay_out_pair_major(t.x, rows, k, num_pairs, t.isa, pairs, widened);
  }
  return Problem{rows, num_pairs, t.out_features, t.isa == kAvx2 ? nullptr : pairs.data(),
                 t.isa != kAvx512Bf16 ? widened.data() : nullptr, t.w,
                 t.bias.empty() ? nullptr : t.bias.data(), t.y};
}

void gemv_task(const void* raw, int64_t rows, int64_t b0, int64_t b1) {
  const GemvTask& t = *static_cast<const GemvTask*>(raw);
  run_blocks(lay_out(t, rows), t.isa, b0, b1);
}

// ---------------------------------------------------------------------------------------------
// A greedy step's lm_head, screened (engine/fused_decode.py, `HeadScreen`): the argmax of the
// bf16 logits y = round_bf16(x W^T) without reading all of W. A screen A ~ x W'^T from a
// quantized copy W' of W (screen_gemv_task below: exact integer sums, bf16 output)
// bounds every logit: with b_j >= max_k |W_jk - W'_jk| plus both GEMVs' fp32 slack (the
// caller's `bounds`) and c_j d the activations' rounding in the screen's GEMV (`rounding`),
//   |A_j - y_j| <= e_j = b_j |x|_1 + c_j d + 2^-7 (|A_j| + b_j |x|_1 + c_j d),
// the 2^-7 term covering the rounding of A and y to bf16 (2^-9 each; A's three fp32 roundings
// before, 2^-24 each, fit in the room left). So the row's largest
// logit is at least L = max_j (A_j - e_j), and a channel with A_j + e_j < L cannot hold it; the
// channels that can are computed exactly, block by block, by this library's kernel on the
// step's rows (the same calls, the same bits as the full GEMV), and their first largest value
// is torch.max's index over the full logits. A row whose activations or screen are not finite
// is computed whole. Items: rows.

// The screen's GEMV: A_j = (fl(sum_k q_jk r_k) * d) * s_j, the int8 codes q times the row's
// activations as integers r_k = round(x_k / d), d = max|x| / Q, and the sum exact in int32 (Q,
// at most 32767, keeps 127 Q K2 within it: 29356 at K = 576). So each product is one integer
// multiply-add of two int16 (`vpdpwssd` with AVX-512 VNNI, `vpmaddwd` without): the exact-math
// int8 path's fp32 conversion and FMA per weight made it compute-bound (25 GB/s a thread from
// L2 on the Xeon, ~20 from memory in the step). The activations' rounding adds at most
// c_j d to channel j's error, c_j = 0.51 s_j sum_k |q_jk| (`HeadScreen.rounding`; 0.5 for
// the rounding to an integer, 0.01 for x_k * (1 / d)'s own), which the screen task adds to
// its bound. The codes are packed as the bf16 weights are: [blocks, K2 / 2, 16, 2], lane j's
// pair of inputs side by side.
constexpr int64_t kAvx512Vnni = 4;  // quant_gemm.cpp's number for the VNNI path

struct ScreenGemvTask {
  const int8_t* codes;  // [num_blocks, num_pairs, 16, 2]
  const float* scales;  // [num_blocks * 16], zero padded
  int64_t in_features, out_features, num_pairs, num_blocks, isa;
  const uint16_t* x;  // bf16 [rows, in_features]
  at::BFloat16* y;    // bf16 [rows, out_features]
};

// Q for num_pairs pairs of inputs: 127 * Q * 2 * num_pairs <= 2^31 - 1.
inline int32_t screen_range(int64_t num_pairs) {
  return static_cast<int32_t>(
      std::min<int64_t>(32767, int64_t{2147483647} / (127 * 2 * std::max<int64_t>(num_pairs, 1))));
}

// d for a row of k bf16 activations: max|x| / Q; 0 where that is 0 or not finite (the screen
// task computes such a row whole, whatever the screen says). Both tasks call this.
inline float screen_step(const uint16_t* x, int64_t k, int64_t num_pairs) {
  float m = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < k; ++i) {
    const float v = std::fabs(bf16_to_float(x[i]));
    finite = finite && std::isfinite(v);
    m = std::max(m, v);
  }
  const float d = m / static_cast<float>(screen_range(num_pairs));
  return finite && d > 0.f && std::isfinite(d) ? d : 0.f;
}

// The row's r_k as int16 pairs, one int32 per pair (the even input in the low half); returns d.
float quantize_int16(const uint16_t* x, int64_t k, int64_t num_pairs, int32_t* pairs) {
  const float d = screen_step(x, k, num_pairs);
  const float inv = d > 0.f ? 1.f / d : 0.f, range = static_cast<float>(screen_range(num_pairs));
  for (int64_t e = 0; e < num_pairs; ++e) {
    uint32_t halves[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t i = 2 * e + h;
      float q = i < k ? std::nearbyint(bf16_to_float(x[i]) * inv) : 0.f;  // to nearest even
      q = std::isnan(q) ? 0.f : std::clamp(q, -range, range);
      halves[h] = static_cast<uint32_t>(static_cast<int32_t>(q)) & 0xffffu;
    }
    pairs[e] = static_cast<int32_t>(halves[0] | (halves[1] << 16));
  }
  return d;
}

void screen_block_portable(const ScreenGemvTask& t, const int32_t* xp, float d, int64_t row,
                           int64_t b) {
  const int8_t* cb = t.codes + b * t.num_pairs * 2 * kBlock;
  const int64_t lanes = std::min(kBlock, t.out_features - b * kBlock);
  for (int64_t j = 0; j < lanes; ++j) {
    int32_t sum = 0;
    for (int64_t e = 0; e < t.num_pairs; ++e) {
      const int32_t r0 = static_cast<int16_t>(xp[e] & 0xffff);
      const int32_t r1 = static_cast<int16_t>(xp[e] >> 16);
      sum += cb[(e * kBlock + j) * 2] * r0 + cb[(e * kBlock + j) * 2 + 1] * r1;
    }
    t.y[row * t.out_features + b * kBlock + j] =
        static_cast<at::BFloat16>(static_cast<float>(sum) * d * t.scales[b * kBlock + j]);
  }
}

AVX2_TARGET void screen_block_avx2(const ScreenGemvTask& t, const int32_t* xp, float d,
                                   int64_t row, int64_t b) {
  const int8_t* cb = t.codes + b * t.num_pairs * 2 * kBlock;
  __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int64_t e = 0; e < t.num_pairs; ++e) {
    const __m256i x = _mm256_set1_epi32(xp[e]);
    for (int h = 0; h < 2; ++h) {
      const __m256i w = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + e * 2 * kBlock + 16 * h)));
      acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(w, x));
    }
  }
  alignas(32) int32_t sums[kBlock];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums), acc[0]);
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums + 8), acc[1]);
  const int64_t lanes = std::min(kBlock, t.out_features - b * kBlock);
  for (int64_t j = 0; j < lanes; ++j)
    t.y[row * t.out_features + b * kBlock + j] =
        static_cast<at::BFloat16>(static_cast<float>(sums[j]) * d * t.scales[b * kBlock + j]);
}

#define SCREEN_VNNI_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

// One block's sums for one row, four accumulators along the pairs (vpdpwssd's latency is 5
// cycles: with two, a thread ran ~30 GB/s from L2): acc += the pair's products, by
// STEP(acc, w, x) (VNNI: vpdpwssd; else vpmaddwd and an add, the same integers).
#define SCREEN_SUMS(STEP)                                                                     \
  __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),  \
                    _mm512_setzero_si512()};                                                 \
  int64_t e = 0;                                                                             \
  for (; e + 4 <= num_pairs; e += 4) {                                                       \
    gemv_prefetch::ahead(cb + e * 2 * kBlock, 8 * kBlock);                                   \
    for (int u = 0; u < 4; ++u) {                                                            \
      const __m512i w = _mm512_cvtepi8_epi16(                                                \
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + (e + u) * 2 * kBlock)));  \
      acc[u] = STEP(acc[u], w, _mm512_set1_epi32(xp[e + u]));                                \
    }                                                                                        \
  }                                                                                          \
  for (; e < num_pairs; ++e) {                                                               \
    const __m512i w = _mm512_cvtepi8_epi16(                                                  \
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + e * 2 * kBlock)));          \
    acc[0] = STEP(acc[0], w, _mm512_set1_epi32(xp[e]));                                      \
  }                                                                                          \
  return _mm512_add_epi32(_mm512_add_epi32(acc[0], acc[1]), _mm512_add_epi32(acc[2], acc[3]));

AVX512_TARGET __attribute__((always_inline)) inline __m512i madd_step(__m512i acc, __m512i w,
                                                                      __m512i x) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
}

AVX512_TARGET __attribute__((always_inline)) inline __m512i screen_sums_avx512(
    const int8_t* cb, const int32_t* xp, int64_t num_pairs) {
  SCREEN_SUMS(madd_step)
}

SCREEN_VNNI_TARGET __attribute__((always_inline)) inline __m512i screen_sums_vnni(
    const int8_t* cb, const int32_t* xp, int64_t num_pairs) {
  SCREEN_SUMS(_mm512_dpwssd_epi32)
}
#undef SCREEN_SUMS

// (float(sum) * d) * s, rounded to nearest-even bf16, the block's lanes stored.
AVX512_TARGET __attribute__((always_inline)) inline void screen_store_avx512(
    const ScreenGemvTask& t, __m512i sums, float d, int64_t row, int64_t b) {
  const int64_t lanes = std::min(kBlock, t.out_features - b * kBlock);
  const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
  const __m512 a = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(d)),
                                 _mm512_loadu_ps(t.scales + b * kBlock));
  _mm256_mask_storeu_epi16(t.y + row * t.out_features + b * kBlock, mask, round_bf16_avx512(a));
}

AVX512_TARGET void screen_block_avx512(const ScreenGemvTask& t, const int32_t* xp, float d,
                                       int64_t row, int64_t b) {
  screen_store_avx512(
      t, screen_sums_avx512(t.codes + b * t.num_pairs * 2 * kBlock, xp, t.num_pairs), d,
      row, b);
}

SCREEN_VNNI_TARGET void screen_block_vnni(const ScreenGemvTask& t, const int32_t* xp, float d,
                                          int64_t row, int64_t b) {
  screen_store_avx512(
      t, screen_sums_vnni(t.codes + b * t.num_pairs * 2 * kBlock, xp, t.num_pairs), d,
      row, b);
}

// Blocks [b0, b1) of the screen for every row of the step; each call quantizes the rows for
// itself (a thread's share is one call: the task is split statically).
void screen_gemv_task(const void* raw, int64_t rows, int64_t b0, int64_t b1) {
  const ScreenGemvTask& t = *static_cast<const ScreenGemvTask*>(raw);
  thread_local std::vector<int32_t> pairs;
  thread_local std::vector<float> steps;
  pairs.resize(rows * t.num_pairs);
  steps.resize(rows);
  for (int64_t r = 0; r < rows; ++r)
    steps[r] = quantize_int16(t.x + r * t.in_features, t.in_features, t.num_pairs,
                              pairs.data() + r * t.num_pairs);
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* xp = pairs.data() + r * t.num_pairs;
      if (t.isa == kAvx512Vnni) screen_block_vnni(t, xp, steps[r], r, b);
      else if (t.isa >= kAvx512) screen_block_avx512(t, xp, steps[r], r, b);
      else if (t.isa == kAvx2) screen_block_avx2(t, xp, steps[r], r, b);
      else screen_block_portable(t, xp, steps[r], r, b);
    }
}

// 2^-7: the rounding of A and of y to bf16 (2^-9 each), with room, relative to |A_j| + e_j.
constexpr float kRoundingBound = 0.0078125f;

struct ScreenTask {
  const GemvTask* head;      // the bf16 lm_head's GEMV task (its weight and x)
  const at::BFloat16* screen;  // [max_rows, vocab]: A, from the int8 copy (screen_gemv_task)
  const float* bounds;       // [vocab]: b_j
  const float* rounding;     // [vocab]: c_j, the activations' rounding per unit of d
  int64_t* ids;              // [max_rows]: each row's argmax
  int64_t* candidates;       // [max_rows]: channels computed exactly (a measure of the screen)
};

// The screen's two passes over a row's vocabulary: the lower bound L (false where a screen value
// is not finite), then which blocks of 16 channels can hold the argmax. Scalar, and AVX-512 for
// a head whose kernel is AVX-512 (16 channels a vector: the same arithmetic, in the same order;
// with a 49152-channel vocabulary the scalar passes took ~0.2 ms of a W1 step, on one thread).
// e_j before the rounding term: b_j |x|_1 + c_j d.
inline float screen_error(const float* bounds, const float* rounding, int64_t j, float norm,
                          float d) {
  return bounds[j] * norm + rounding[j] * d;
}

bool screen_lower_scalar(const at::BFloat16* a, const float* bounds, const float* rounding,
                         int64_t vocab, float norm, float d, float* lower) {
  float low = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < vocab; ++j) {
    const float aj = static_cast<float>(a[j]), ej = screen_error(bounds, rounding, j, norm, d);
    if (!std::isfinite(aj)) return false;
    low = std::max(low, aj - ej - kRoundingBound * (std::fabs(aj) + ej));
  }
  *lower = low;
  return true;
}

void screen_wanted_scalar(const at::BFloat16* a, const float* bounds, const float* rounding,
                          int64_t vocab, float norm, float d, float lower,
                          std::vector<uint8_t>& wanted) {
  for (int64_t b = 0; b * kBlock < vocab; ++b) {
    bool any = false;
    for (int64_t j = b * kBlock; j < std::min(vocab, (b + 1) * kBlock) && !any; ++j) {
      const float aj = static_cast<float>(a[j]), ej = screen_error(bounds, rounding, j, norm, d);
      any = aj + ej + kRoundingBound * (std::fabs(aj) + ej) >= lower;
    }
    wanted[b] = any;
  }
}

// 16 bf16 values (the first `mask` lanes; the rest 0) as fp32.
AVX512_TARGET inline __m512 load_bf16x16(const at::BFloat16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

AVX512_TARGET inline __mmask16 lanes_of(int64_t vocab, int64_t j) {
  const int64_t n = std::min(kBlock, vocab - j);
  return static_cast<__mmask16>((1u << n) - 1u);
}

// screen_error for the 16 channels from j (the first `m` lanes).
AVX512_TARGET inline __m512 screen_error_avx512(const float* bounds, const float* rounding,
                                                int64_t j, __mmask16 m, __m512 norm, __m512 d) {
  return _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, bounds + j), norm),
                       _mm512_mul_ps(_mm512_maskz_loadu_ps(m, rounding + j), d));
}

AVX512_TARGET bool screen_lower_avx512(const at::BFloat16* a, const float* bounds,
                                       const float* rounding, int64_t vocab, float norm,
                                       float d, float* lower) {
  const __m512 n = _mm512_set1_ps(norm), k = _mm512_set1_ps(kRoundingBound);
  const __m512 dv = _mm512_set1_ps(d);
  __m512 low = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 not_finite = 0;
  for (int64_t j = 0; j < vocab; j += kBlock) {
    const __mmask16 m = lanes_of(vocab, j);
    const __m512 aj = load_bf16x16(a + j, m);
    const __m512 ej = screen_error_avx512(bounds, rounding, j, m, n, dv);
    not_finite |= _mm512_fpclass_ps_mask(aj, 0x99);  // QNaN, SNaN, +inf, -inf
    const __m512 v = _mm512_sub_ps(_mm512_sub_ps(aj, ej),
                                   _mm512_mul_ps(k, _mm512_add_ps(_mm512_abs_ps(aj), ej)));
    low = _mm512_mask_max_ps(low, m, low, v);
  }
  if (not_finite) return false;
  *lower = _mm512_reduce_max_ps(low);
  return true;
}

AVX512_TARGET void screen_wanted_avx512(const at::BFloat16* a, const float* bounds,
                                        const float* rounding, int64_t vocab, float norm,
                                        float d, float lower, std::vector<uint8_t>& wanted) {
  const __m512 n = _mm512_set1_ps(norm), k = _mm512_set1_ps(kRoundingBound);
  const __m512 dv = _mm512_set1_ps(d);
  const __m512 low = _mm512_set1_ps(lower);
  for (int64_t j = 0; j < vocab; j += kBlock) {
    const __mmask16 m = lanes_of(vocab, j);
    const __m512 aj = load_bf16x16(a + j, m);
    const __m512 ej = screen_error_avx512(bounds, rounding, j, m, n, dv);
    const __m512 u = _mm512_add_ps(_mm512_add_ps(aj, ej),
                                   _mm512_mul_ps(k, _mm512_add_ps(_mm512_abs_ps(aj), ej)));
    wanted[j / kBlock] = _mm512_mask_cmp_ps_mask(m, u, low, _CMP_GE_OQ) != 0;
  }
}

void screen_argmax_task(const void* raw, int64_t rows, int64_t begin, int64_t end) {
  const ScreenTask& t = *static_cast<const ScreenTask*>(raw);
  const GemvTask& head = *t.head;
  const int64_t vocab = head.out_features, k = head.in_features;
  const int64_t num_blocks = (vocab + kBlock - 1) / kBlock;
  const bool vector = head.isa >= kAvx512;
  thread_local std::vector<at::BFloat16> exact;  // [rows, 16]: one block's logits, every row
  thread_local std::vector<uint8_t> wanted;      // [num_blocks]: the row's blocks computed
  exact.resize(rows * kBlock);
  wanted.resize(num_blocks);
  Problem block = lay_out(head, rows);
  block.out_features = kBlock;  // rows of `exact` are 16 wide
  block.y = exact.data();
  for (int64_t r = begin; r < end; ++r) {
    const uint16_t* x = head.x + r * k;
    float norm = 0.f;
    for (int64_t i = 0; i < k; ++i) norm += std::fabs(bf16_to_float(x[i]));
    norm *= 1.0f + 1e-5f;  // the sum's own rounding, K terms
    const at::BFloat16* a = t.screen + r * vocab;
    // (Tiny activations too: the bf16 kernel flushes subnormal products, which the bound
    // does not cover.)
    float lower = 0.f;
    bool finite = std::isfinite(norm) && norm > 1e-30f;
    const float d = screen_step(x, k, head.num_pairs);  // as the screen's GEMV took it
    if (finite)
      finite = vector ? screen_lower_avx512(a, t.bounds, t.rounding, vocab, norm, d, &lower)
                      : screen_lower_scalar(a, t.bounds, t.rounding, vocab, norm, d, &lower);
    if (!finite) std::fill(wanted.begin(), wanted.end(), uint8_t{1});
    else if (vector) screen_wanted_avx512(a, t.bounds, t.rounding, vocab, norm, d, lower, wanted);
    else screen_wanted_scalar(a, t.bounds, t.rounding, vocab, norm, d, lower, wanted);
    int64_t best = -1, num_exact = 0;
    float best_value = 0.f;
    for (int64_t b = 0; b < num_blocks; ++b) {
      if (!wanted[b]) continue;
      const int64_t lanes = std::min(kBlock, vocab - b * kBlock);
      // Block b alone: the weight from its first pair on, the bias from its first channel.
      Problem one = block;
      one.w = head.w + b * head.num_pairs * 2 * kBlock;
      one.bias = head.bias.empty() ? nullptr : head.bias.data() + b * kBlock;
      run_blocks(one, head.isa, 0, 1);
      num_exact += lanes;
      for (int64_t lane = 0; lane < lanes; ++lane) {
        const float value = static_cast<float>(exact[r * kBlock + lane]);
        // torch.max's order: the first of equal values; a NaN above everything, the first.
        const bool nan = std::isnan(value), best_nan = best >= 0 && std::isnan(best_value);
        if (best < 0 || (nan && !best_nan) || (!best_nan && value > best_value)) {
          best = b * kBlock + lane;
          best_value = value;
        }
      }
    }
    t.ids[r] = best;
    t.candidates[r] = num_exact;
  }
}

struct TaskShape {
  int64_t in_features, num_pairs, num_blocks;
};

// A task's step buffers, x bf16 [rows, in] and y bf16 [rows, out_features], both contiguous,
// checked; their inputs, pairs of inputs and blocks of outputs.
TaskShape task_shape(const at::Tensor& x, const at::Tensor& y, int64_t out_features,
                     const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && y.scalar_type() == at::kBFloat16 &&
                  x.is_contiguous() && y.is_contiguous() && x.dim() == 2 && y.dim() == 2 &&
                  y.size(0) == x.size(0) && y.size(1) == out_features,
              what, " task: x, y must be contiguous bf16 [rows, in], [rows, out]");
  return {x.size(1), (x.size(1) + 1) / 2, (out_features + kBlock - 1) / kBlock};
}

// (task arguments capsule, number of blocks) for y = x @ W^T (+ b) on the step's x and y
// buffers (bf16, contiguous).
py::tuple make_gemv_task(const at::Tensor& x, const at::Tensor& y, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias, int64_t out_features,
                         int64_t isa) {
  check_isa(isa);
  const auto [in_features, num_pairs, num_blocks] = task_shape(x, y, out_features, "bf16_gemm");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.sizes() == at::IntArrayRef({num_blocks, num_pairs, kBlock, 2}),
              "bf16_gemm task: the packed weight does not match x and out_features");
  auto* task = new GemvTask{reinterpret_cast<const uint16_t*>(packed.data_ptr()), {},
                            in_features, out_features, num_pairs, num_blocks, isa,
                            reinterpret_cast<const uint16_t*>(x.data_ptr()),
                            y.data_ptr<at::BFloat16>()};
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, "bf16_gemm task: bias shape");
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    task->bias.assign(num_blocks * kBlock, 0.f);
    std::memcpy(task->bias.data(), b.data_ptr<float>(), out_features * sizeof(float));
  }
  py::capsule args(task, "mini_infer.task_args",
                   [](void* p) { delete static_cast<GemvTask*>(p); });
  return py::make_tuple(args, num_blocks);
}

// (task arguments capsule, number of blocks) for the screen's GEMV A = x W'^T on the step's x
// (bf16 [rows, in]) into y (bf16 [rows, out_features]): codes int8 [blocks, K2 / 2, 16, 2],
// scales float32 [blocks * 16]; isa: 0 portable, 1 avx2, 2 avx512 (vpmaddwd), 4 avx512vnni.
py::tuple make_screen_gemv_task(const at::Tensor& x, const at::Tensor& y, const at::Tensor& codes,
                                const at::Tensor& scales, int64_t out_features, int64_t isa) {
  TORCH_CHECK(isa == kPortable || isa == kAvx2 || isa == kAvx512 || isa == kAvx512Vnni,
              "screen gemv: unknown isa ", isa);
  if (isa != kPortable) check_isa(std::min<int64_t>(isa, kAvx512));
  if (isa == kAvx512Vnni)
    TORCH_CHECK(__builtin_cpu_supports("avx512vnni"), "screen gemv: this CPU has no AVX-512 VNNI");
  const auto [in_features, num_pairs, num_blocks] = task_shape(x, y, out_features, "screen gemv");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  codes.sizes() == at::IntArrayRef({num_blocks, num_pairs, kBlock, 2}),
              "screen gemv: the codes do not match x and out_features");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == num_blocks * kBlock,
              "screen gemv: scales float32 [blocks * 16]");
  auto* task = new ScreenGemvTask{codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                                  in_features, out_features, num_pairs, num_blocks, isa,
                                  reinterpret_cast<const uint16_t*>(x.data_ptr()),
                                  y.data_ptr<at::BFloat16>()};
  py::capsule args(task, "mini_infer.task_args",
                   [](void* p) { delete static_cast<ScreenGemvTask*>(p); });
  return py::make_tuple(args, num_blocks);
}

// head: make_gemv_task's arguments for the bf16 lm_head (kept alive by the caller); screen bf16
// [max_rows, vocab] (make_screen_gemv_task's output), bounds and rounding float32 [vocab] (b_j
// and c_j, see ScreenTask), ids and candidates int64 [max_rows].
py::capsule make_screen_task(const py::capsule& head, const at::Tensor& screen,
                             const at::Tensor& bounds, const at::Tensor& rounding,
                             const at::Tensor& ids, const at::Tensor& candidates) {
  TORCH_CHECK(std::string(head.name() ? head.name() : "") == "mini_infer.task_args",
              "screen task: head must be make_gemv_task's arguments");
  const auto* h = static_cast<const GemvTask*>(head.get_pointer());
  TORCH_CHECK(screen.scalar_type() == at::kBFloat16 && screen.dim() == 2 &&
                  screen.is_contiguous() && screen.size(1) == h->out_features,
              "screen task: screen bf16 [rows, vocab], contiguous");
  for (const auto* v : {&bounds, &rounding})
    TORCH_CHECK(v->scalar_type() == at::kFloat && v->is_contiguous() &&
                    v->numel() >= h->out_features,
                "screen task: bounds and rounding float32 [vocab]");
  for (const auto* v : {&ids, &candidates})
    TORCH_CHECK(v->scalar_type() == at::kLong && v->is_contiguous() &&
                    v->numel() >= screen.size(0),
                "screen task: ids and candidates int64 [rows]");
  auto* task = new ScreenTask{h, screen.data_ptr<at::BFloat16>(), bounds.data_ptr<float>(),
                              rounding.data_ptr<float>(), ids.data_ptr<int64_t>(),
                              candidates.data_ptr<int64_t>()};
  return py::capsule(task, "mini_infer.task_args",
                     [](void* p) { delete static_cast<ScreenTask*>(p); });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_gemm", &bf16_gemm, "y = x @ W^T (+ b), W bf16 packed in pairs along K",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"),
        py::arg("isa"), py::arg("out") = py::none());
  m.def("gemv_task_fn", [] {
    return py::capsule(reinterpret_cast<void*>(&gemv_task), "mini_infer.task_fn");
  });
  m.def("make_gemv_task", &make_gemv_task, "(task arguments, blocks) for one linear of a fused step");
  m.def("screen_gemv_task_fn", [] {
    return py::capsule(reinterpret_cast<void*>(&screen_gemv_task), "mini_infer.task_fn");
  });
  m.def("make_screen_gemv_task", &make_screen_gemv_task,
        "(task arguments, blocks) for an lm_head screen's GEMV: int8 codes, int16 activations");
  m.def("screen_argmax_task_fn", [] {
    return py::capsule(reinterpret_cast<void*>(&screen_argmax_task), "mini_infer.task_fn");
  });
  m.def("make_screen_task", &make_screen_task,
        "a greedy step's lm_head argmax from an int8 screen and the channels it cannot rule out");
}
