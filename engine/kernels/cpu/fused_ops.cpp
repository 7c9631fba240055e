// Fused eager ops for the CPU decode step: residual add + RMSNorm, RoPE on q/k in place, and
// SiLU(gate) * up. Each replaces a chain of 2-9 torch calls (each a Python call, a dispatch and
// a fresh tensor) with one call, and each gives the same bits as that chain:
//
// - RMSNorm rounds as Hugging Face does (normalise in fp32, round to the model dtype, then
//   multiply by the weight), and sums the squares in the order of torch's own reduction
//   (ATen's cascade_sum: 4 interleaved vector accumulators of its sum kernel's width, merged
//   by level, then the lanes in order; `lanes` is that width), so bf16 outputs stay
//   bit-identical to `x.float().pow(2).mean(-1)`. The file is built with -ffp-contract=off: a fused
//   multiply-add would round once where torch rounds twice.
// - RoPE rounds after x * cos, after roll(x) * signed_sin and after their sum, as torch does.
// - SiLU uses torch's exp: SLEEF's expf (exported by libtorch_cpu) on the elements torch's
//   vectorised loop covers (whole pairs of vectors from the start of each row, or of each
//   thread's chunk where torch splits a large tensor), std::exp on the rest.
//
// Parallel: one at::parallel_for over rows per call, with a grain large enough that a decode
// step of a few rows runs inline (no OpenMP region, no thread wake-up).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);
#endif
#if defined(__AVX2__)
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

namespace {

constexpr int64_t kGrainElements = 32768;  // ATen's GRAIN_SIZE: below it torch runs serially

template <typename scalar_t>
inline float to_float(scalar_t v) { return static_cast<float>(v); }

template <typename scalar_t>
inline scalar_t from_float(float v) { return static_cast<scalar_t>(v); }  // c10: round to nearest even

// float -> scalar_t -> float, the rounding c10 does on a cast, in a form the vectoriser takes:
// for bf16, round to nearest even on the bits (NaN -> the canonical quiet NaN, as c10 does).
template <typename scalar_t>
inline float round_like(float v) { return to_float(from_float<scalar_t>(v)); }

inline float bf16_bits_to_float(uint32_t bits) {
  const uint32_t widened = bits << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

inline uint32_t float_to_bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return v != v ? 0x7FC0u : rounded;
}

template <>
inline float round_like<at::BFloat16>(float v) { return bf16_bits_to_float(float_to_bf16_bits(v)); }

// x[i] as float; bf16 through its bits, a form the vectoriser takes.
template <typename scalar_t>
inline float float_at(const scalar_t* x, int64_t i) { return to_float(x[i]); }

template <>
inline float float_at(const at::BFloat16* x, int64_t i) {
  return bf16_bits_to_float(reinterpret_cast<const uint16_t*>(x)[i]);
}

template <typename scalar_t>
inline void widen(const scalar_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = float_at(src, i);
}

template <typename scalar_t>
inline void narrow(const float* src, scalar_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<scalar_t>(src[i]);
}

template <>
inline void narrow(const float* src, at::BFloat16* dst, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) bits[i] = static_cast<uint16_t>(float_to_bf16_bits(src[i]));
}

int64_t ceil_log2(int64_t x) {  // c10::utils::CeilLog2
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x) - 1; v != 0; v >>= 1) ++bits;
  return bits;
}

// ATen's row_sum(multi_row_sum) over `num_vecs` vectors of L lanes: vector v is values[v*L..].
// Returns the 4 ILP accumulators merged into acc0 (L lanes).
template <int L>
void row_sum(const float* values, int64_t num_vecs, float* out) {
  constexpr int kIlp = 4, kLevels = 4;
  const int64_t size = num_vecs / kIlp;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  float acc[kLevels][kIlp][L] = {};
  auto add_row = [&](int64_t i) {
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] += values[(i * kIlp + k) * L + l];
  };
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i) add_row(i);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < L; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.0f;
        }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i) add_row(i);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t v = size * kIlp; v < num_vecs; ++v)
    for (int l = 0; l < L; ++l) acc[0][0][l] += values[v * L + l];
  for (int k = 1; k < kIlp; ++k)
    for (int l = 0; l < L; ++l) acc[0][0][l] += acc[0][k][l];
  for (int l = 0; l < L; ++l) out[l] = acc[0][0][l];
}

// torch.sum over a contiguous row of n floats, in torch's order (vectorized_inner_sum with L
// lanes; scalar_inner_sum when the row is shorter than one vector).
template <int L>
float torch_row_sum(const float* values, int64_t n) {
  if (n < L) {
    float sum;
    row_sum<1>(values, n, &sum);
    return 0.0f + sum;
  }
  const int64_t num_vecs = n / L;
  float lanes[L];
  row_sum<L>(values, num_vecs, lanes);
  float total = 0.0f;
  for (int64_t k = num_vecs * L; k < n; ++k) total += values[k];
  for (int l = 0; l < L; ++l) total += lanes[l];
  return total;
}

template <typename scalar_t, int L>
void rms_norm_rows(const scalar_t* x, scalar_t* residual, const scalar_t* weight, scalar_t* out,
                   int64_t rows, int64_t n, int64_t x_stride, int64_t out_stride, float eps) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> value(n), square(n);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * x_stride;
      scalar_t* rr = residual != nullptr ? residual + r * n : nullptr;
      widen(xr, value.data(), n);
      if (rr != nullptr) {  // x + residual, rounded to the model dtype, is the new residual
        widen(rr, square.data(), n);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) value[i] = round_like<scalar_t>(value[i] + square[i]);
        narrow(value.data(), rr, n);
      }
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) square[i] = value[i] * value[i];
      const float variance = torch_row_sum<L>(square.data(), n) / static_cast<float>(n);
      const float inv = 1.0f / std::sqrt(variance + eps);
      widen(weight, square.data(), n);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i)
        value[i] = round_like<scalar_t>(square[i] * round_like<scalar_t>(value[i] * inv));
      narrow(value.data(), out + r * out_stride, n);
    }
  });
}

void check_row_major(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, hidden], unit stride");
}

template <int L>
void rms_norm_dispatch(const torch::Tensor& x, const torch::Tensor* residual,
                       const torch::Tensor& weight, torch::Tensor& out, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "fused_rms_norm", [&] {
    rms_norm_rows<scalar_t, L>(
        x.data_ptr<scalar_t>(), residual ? residual->data_ptr<scalar_t>() : nullptr,
        weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n, x.stride(0),
        out.stride(0), static_cast<float>(eps));
  });
}

void rms_norm_impl(const torch::Tensor& x, const torch::Tensor* residual,
                   const torch::Tensor& weight, torch::Tensor& out, double eps, int64_t lanes) {
  check_row_major(x, "x");
  check_row_major(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [hidden]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && x.scalar_type() == out.scalar_type(),
              "x, weight and out must share a dtype");
  if (residual != nullptr)
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(),
                "residual must be contiguous and shaped like x");
  if (lanes == 16) {
    rms_norm_dispatch<16>(x, residual, weight, out, eps);
  } else {
    TORCH_CHECK(lanes == 8, "lanes must be 8 or 16");
    rms_norm_dispatch<8>(x, residual, weight, out, eps);
  }
}

// out = RMSNorm(x) (x untouched).
void rms_norm(torch::Tensor x, torch::Tensor weight, torch::Tensor out, double eps,
              int64_t lanes) {
  rms_norm_impl(x, nullptr, weight, out, eps, lanes);
}

// residual <- x + residual; x <- RMSNorm(residual): the pre-norm block's "add the branch
// output, then normalise", in place on both ([rows, hidden], x may have a row stride).
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps,
                   int64_t lanes) {
  rms_norm_impl(x, &residual, weight, x, eps, lanes);
}

template <typename scalar_t>
void rotary_rows(scalar_t* x, const scalar_t* cos, const scalar_t* sin, int64_t num_tokens,
                 int64_t num_heads, int64_t head_dim, int64_t token_stride, int64_t head_stride) {
  const int64_t half = head_dim / 2;
  const int64_t grain =
      std::max<int64_t>(1, kGrainElements / std::max<int64_t>(num_heads * head_dim, 1));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    // One head's values in fp32 and its result, rounded as torch rounds each of its three ops.
    // roll(x, half)[i] = x[(i + half) % head_dim], written as two loops: no division per
    // element, and loops the vectoriser takes (measured: 7 ns an element with the modulo and
    // c10's scalar rounding, 32 rows x 12 heads of 64 taking 170 us a layer).
    std::vector<float> row(head_dim), rolled(head_dim), cf(head_dim), sf(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      widen(cos + t * head_dim, cf.data(), head_dim);
      widen(sin + t * head_dim, sf.data(), head_dim);  // its first half negated already
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* xh = x + t * token_stride + h * head_stride;
        widen(xh, row.data(), head_dim);
        std::copy(row.begin() + half, row.end(), rolled.begin());
        std::copy(row.begin(), row.begin() + half, rolled.begin() + (head_dim - half));
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) {
          const float a = round_like<scalar_t>(row[i] * cf[i]);
          const float b = round_like<scalar_t>(rolled[i] * sf[i]);
          row[i] = round_like<scalar_t>(a + b);
        }
        narrow(row.data(), xh, head_dim);
      }
    }
  });
}

// x [num_tokens, num_heads, head_dim] (unit stride in head_dim) rotated in place; cos and
// signed sin [num_tokens, head_dim] or [num_tokens, 1, head_dim] (engine/layers/rotary.py's
// tables, rows gathered).
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim]");
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.numel() == x.size(0) * x.size(2) && cos.size(-1) == x.size(2),
              "cos/sin must be contiguous [tokens, (1,) head_dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "x, cos and sin must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_rotary", [&] {
    rotary_rows<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                          sin.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2),
                          x.stride(0), x.stride(1));
  });
}

// exp over n floats as torch's silu computes it: `vec_count` leading elements in SLEEF
// vectors of `lanes` (16: AVX-512, 8: AVX2), the rest with std::exp. lanes 0: all std::exp.
void torch_exp(float* v, int64_t n, int64_t vec_count, int64_t lanes) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (lanes == 16)
    for (; i + 16 <= vec_count; i += 16)
      _mm512_storeu_ps(v + i, Sleef_expf16_u10(_mm512_loadu_ps(v + i)));
#endif
#if defined(__AVX2__)
  if (lanes == 8)
    for (; i + 8 <= vec_count; i += 8)
      _mm256_storeu_ps(v + i, Sleef_expf8_u10(_mm256_loadu_ps(v + i)));
#endif
  for (; i < n; ++i) v[i] = std::exp(v[i]);
}

// The span of flat elements each thread of torch's elementwise loop gets (TensorIterator's
// for_each: serial below GRAIN_SIZE, else at::parallel_for's equal chunks): its vectorised
// loop restarts at every chunk start, so a chunk boundary inside a row moves where SLEEF stops.
int64_t torch_chunk(int64_t numel, int64_t num_threads) {
  if (numel < kGrainElements || num_threads == 1) return std::max<int64_t>(numel, 1);
  const int64_t used = std::min<int64_t>(num_threads, (numel + kGrainElements - 1) / kGrainElements);
  return (numel + used - 1) / used;
}

// SLEEF's exp on each of n floats, in vectors of `lanes` (a last partial vector padded): the
// function is elementwise, so which vector an element rides in does not change its bits.
void sleef_exp(float* v, int64_t n, int64_t lanes) {
  if (lanes == 0 || n <= 0) return;
  const int64_t whole = n / lanes * lanes;
  torch_exp(v, whole, whole, lanes);
  if (whole == n) return;
  float pad[16] = {};
  std::copy(v + whole, v + n, pad);
  torch_exp(pad, lanes, lanes, lanes);
  std::copy(pad, pad + (n - whole), v + whole);
}

// One row of silu(gate) * up, written over columns [c0, c1) of its n. torch's vectorised loop
// takes 2 Vectorized<scalar_t> per iteration (`step` floats) from the start of each of its
// pieces: it restarts at each row's start and at each thread's chunk of `chunk` flat elements
// of the whole tensor (`flat`: the row's first). An element is SLEEF's where its piece's whole
// iterations cover it, std::exp's after them, so every split of the columns writes the bits of
// the whole row. gate, denom: n floats of scratch.
template <typename scalar_t>
void silu_mul_row(const scalar_t* g, const scalar_t* u, scalar_t* o, int64_t n, int64_t flat,
                  int64_t chunk, int64_t step, int64_t lanes, int64_t c0, int64_t c1,
                  float* gate, float* denom) {
  for (int64_t i = c0; i < c1; ++i) {
    gate[i] = to_float(g[i]);
    denom[i] = -gate[i];
  }
  for (int64_t start = flat + c0, end = flat + c1; start < end;) {
    // The piece of torch's loop holding `start`: from the row's start or a chunk's, whichever
    // is later, to the row's end or the next chunk's start.
    const int64_t piece = std::max(flat, start / chunk * chunk);
    const int64_t piece_end = std::min(flat + n, (start / chunk + 1) * chunk);
    const int64_t stop = std::min(end, piece_end);
    const int64_t covered = lanes == 0 ? piece : piece + (piece_end - piece) / step * step;
    const int64_t sleef_end = std::clamp(covered, start, stop);
    sleef_exp(denom + (start - flat), sleef_end - start, lanes);
    for (int64_t i = sleef_end; i < stop; ++i) denom[i - flat] = std::exp(denom[i - flat]);
    start = stop;
  }
  for (int64_t i = c0; i < c1; ++i) {
    const scalar_t silu = from_float<scalar_t>(gate[i] / (1.0f + denom[i]));
    o[i] = from_float<scalar_t>(to_float(silu) * to_float(u[i]));
  }
}

// The floats one iteration of torch's vectorised loop takes: 2 Vectorized<scalar_t>, and a
// Vectorized of a 2-byte type holds twice the float lanes.
template <typename scalar_t>
constexpr int64_t loop_step(int64_t lanes) {
  return 2 * lanes * (sizeof(scalar_t) == 2 ? 2 : 1);
}

template <typename scalar_t>
void silu_mul_rows(const scalar_t* gate_up, scalar_t* out, int64_t rows, int64_t n,
                   int64_t in_stride, int64_t lanes, int64_t num_threads) {
  const int64_t step = loop_step<scalar_t>(lanes);
  const int64_t chunk = torch_chunk(rows * n, num_threads);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(n), denom(n);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gate_up + r * in_stride;
      silu_mul_row<scalar_t>(g, g + n, out + r * n, n, r * n, chunk, step, lanes, 0, n,
                             gate.data(), denom.data());
    }
  });
}

// The exp width asked for must be one this build can follow (torch's SLEEF width, or 0).
void check_exp_lanes(int64_t lanes) {
  TORCH_CHECK(lanes == 0 || lanes == 8 || lanes == 16, "lanes must be 0, 8 or 16");
#if !defined(__AVX512F__)
  TORCH_CHECK(lanes != 16, "built without AVX-512: cannot follow torch's 16-lane exp");
#endif
#if !defined(__AVX2__)
  TORCH_CHECK(lanes != 8, "built without AVX2: cannot follow torch's 8-lane exp");
#endif
}

// gate_up [rows, 2 * n] (gate | up, unit stride) -> out [rows, n] = silu(gate) * up.
void silu_mul(torch::Tensor gate_up, torch::Tensor out, int64_t lanes) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * n], unit stride");
  const int64_t n = gate_up.size(1) / 2;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == gate_up.size(0) &&
                  out.size(1) == n && out.scalar_type() == gate_up.scalar_type(),
              "out must be contiguous [rows, n] in gate_up's dtype");
  check_exp_lanes(lanes);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(),
                                  "fused_silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            gate_up.size(0), n, gate_up.stride(0), lanes,
                            at::get_num_threads());
  });
}

int64_t exp_lanes_built() {
#if defined(__AVX512F__)
  return 16;
#elif defined(__AVX2__)
  return 8;
#else
  return 0;
#endif
}

// ---------------------------------------------------------------------------------------------
// Tasks of a fused decode step (engine/kernels/cpu/decode_step.cpp calls them inside its one
// parallel region, where the at::parallel_for of the functions above runs inline): the same
// functions on a share of the rows, so the bits are those of the calls above. bf16 only.

using bf16 = at::BFloat16;

struct NormTask {
  bf16* x;         // [rows, n], row stride x_stride
  bf16* residual;  // [rows, n] contiguous, or null (plain RMSNorm)
  const bf16* weight;
  bf16* out;  // [rows, n], row stride out_stride (may be x)
  int64_t n, x_stride, out_stride, lanes;
  float eps;
};

void norm_task(const void* raw, int64_t rows, int64_t begin, int64_t end) {
  const NormTask& t = *static_cast<const NormTask*>(raw);
  if (begin >= end) return;
  auto* residual = t.residual != nullptr ? t.residual + begin * t.n : nullptr;
  auto* x = t.x + begin * t.x_stride;
  auto* out = t.out + begin * t.out_stride;
  if (t.lanes == 16)
    rms_norm_rows<bf16, 16>(x, residual, t.weight, out, end - begin, t.n, t.x_stride, t.out_stride, t.eps);
  else
    rms_norm_rows<bf16, 8>(x, residual, t.weight, out, end - begin, t.n, t.x_stride, t.out_stride, t.eps);
}

struct RotaryTask {
  bf16* x;  // [rows, heads, head_dim] at token_stride / head_stride
  const bf16* cos;  // [rows, head_dim]
  const bf16* sin;
  int64_t num_heads, head_dim, token_stride, head_stride;
};

void rotary_task(const void* raw, int64_t rows, int64_t begin, int64_t end) {
  const RotaryTask& t = *static_cast<const RotaryTask*>(raw);
  if (begin >= end) return;
  rotary_rows<bf16>(t.x + begin * t.token_stride, t.cos + begin * t.head_dim,
                    t.sin + begin * t.head_dim, end - begin, t.num_heads, t.head_dim,
                    t.token_stride, t.head_stride);
}

// SiLU * up's items are (row, part) pairs, `parts` a row: in steps of fewer than `split_below`
// rows a row's parts are its columns, shared by the step's threads, where one thread would do
// the whole row while its partners waited at the barrier after it (a 1B model's one-row step:
// 16 layers' rows of 8192, ~0.3 ms a step on one thread); from `split_below` rows on a row is
// done whole by whoever takes its first part (its other parts are nothing). f(row, p0, p1) does
// parts [p0, p1) of a row, once for each row the items [begin, end) touch. (The norms gain
// nothing split so: each part would read and sum the whole row, most of a norm's time.)
template <typename F>
void for_row_parts(int64_t rows, int64_t parts, int64_t split_below, int64_t begin, int64_t end,
                   F&& f) {
  if (rows >= split_below || parts == 1) {
    for (int64_t r = (begin + parts - 1) / parts; r * parts < end; ++r) f(r, int64_t{0}, parts);
    return;
  }
  for (int64_t item = begin; item < end;) {
    const int64_t r = item / parts, p0 = item % parts, p1 = std::min(parts, p0 + (end - item));
    f(r, p0, p1);
    item += p1 - p0;
  }
}

// Part p's first column of n in `parts` parts, on a multiple of 32 (a cache line of bf16: two
// threads never write one line) where the row is long enough.
inline int64_t part_start(int64_t n, int64_t parts, int64_t p) {
  if (p >= parts) return n;
  const int64_t align = n >= 32 * parts ? 32 : 1;
  return n * p / parts / align * align;
}

struct SiluMulTask {
  const bf16* gate_up;  // [rows, 2n] contiguous
  bf16* out;            // [rows, n] contiguous
  int64_t n, lanes, num_threads;  // torch's intra-op threads when the task was made
  int64_t parts, split_below;     // for_row_parts
};

// torch's exp pieces are placed by the whole step's element count (silu_mul_row).
void silu_mul_task(const void* raw, int64_t rows, int64_t begin, int64_t end) {
  const SiluMulTask& t = *static_cast<const SiluMulTask*>(raw);
  if (begin >= end) return;
  const int64_t step = loop_step<bf16>(t.lanes);
  const int64_t chunk = torch_chunk(rows * t.n, t.num_threads);
  std::vector<float> gate(t.n), denom(t.n);
  for_row_parts(rows, t.parts, t.split_below, begin, end, [&](int64_t r, int64_t p0, int64_t p1) {
    const int64_t c0 = part_start(t.n, t.parts, p0), c1 = part_start(t.n, t.parts, p1);
    if (c0 >= c1) return;
    const bf16* g = t.gate_up + r * 2 * t.n;
    silu_mul_row<bf16>(g, g + t.n, t.out + r * t.n, t.n, r * t.n, chunk, step, t.lanes, c0, c1,
                       gate.data(), denom.data());
  });
}

// Row gather (an embedding lookup, the rotary tables' rows of the step's positions): row r of
// `out` is row index[r] of `table`, copied bytewise, so the bits are those of index_select. The
// indices are checked by the caller before the step runs (a task cannot raise).
struct GatherTask {
  const char* table;
  const int64_t* index;  // [rows]
  char* out;
  int64_t row_bytes, table_stride, out_stride;  // bytes
};

void gather_task(const void* raw, int64_t rows, int64_t begin, int64_t end) {
  const GatherTask& t = *static_cast<const GatherTask*>(raw);
  for (int64_t r = begin; r < end; ++r)
    std::memcpy(t.out + r * t.out_stride, t.table + t.index[r] * t.table_stride, t.row_bytes);
}

// Row-wise argmax as torch.max(x, dim=-1).indices gives it: the first index of the largest
// value, -0.0 equal to +0.0, a NaN above everything (the first NaN wins). Values are compared
// as integer keys that order as the floats do, in two vectorised passes (the largest key, then
// the first index holding it): torch's bf16 reduction took 0.7-1.4 ms for [32, 49152] logits,
// a greedy W2 step's sampling.
inline uint32_t order_key(uint32_t bits) {
  if (bits == 0x80000000u) bits = 0;  // -0.0 is +0.0
  const uint32_t key = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFFFFFu : key;
}

inline uint32_t float_bits(const float* row, int64_t i) {
  uint32_t bits;
  std::memcpy(&bits, row + i, sizeof(bits));
  return bits;
}

inline uint32_t float_bits(const at::BFloat16* row, int64_t i) {
  return static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(row)[i]) << 16;
}

// The largest key of row[begin, end) and the first index holding it (begin < end).
template <typename scalar_t>
int64_t argmax_range(const scalar_t* row, int64_t begin, int64_t end, uint32_t* key) {
  uint32_t best = 0;
#pragma omp simd reduction(max : best)
  for (int64_t i = begin; i < end; ++i) best = std::max(best, order_key(float_bits(row, i)));
  *key = best;
  constexpr int64_t kChunk = 256;
  for (int64_t c = begin; c < end; c += kChunk) {
    const int64_t c_end = std::min(end, c + kChunk);
    int found = 0;
#pragma omp simd reduction(| : found)
    for (int64_t i = c; i < c_end; ++i) found |= order_key(float_bits(row, i)) == best;
    if (!found) continue;
    for (int64_t i = c; i < c_end; ++i)
      if (order_key(float_bits(row, i)) == best) return i;
  }
  return begin;  // not reached: some element holds the largest key
}

template <typename scalar_t>
int64_t argmax_row(const scalar_t* row, int64_t n) {
  uint32_t key;
  return argmax_range(row, 0, n, &key);
}

// x [rows, n] (unit last stride), float32 or bfloat16, n >= 1 -> int64 [rows].
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= 1,
              "argmax_rows: x must be [rows, n >= 1] with a unit last stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "argmax_rows: float32 or bfloat16");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows}, torch::kLong);
  int64_t* indices = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / n);
  if (x.scalar_type() == at::kFloat) {
    const float* base = x.data_ptr<float>();
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) indices[r] = argmax_row(base + r * stride, n);
    });
  } else {
    const at::BFloat16* base = x.data_ptr<at::BFloat16>();
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) indices[r] = argmax_row(base + r * stride, n);
    });
  }
  return out;
}

// The greedy ids of a fused decode step (decode_step.cpp), argmax_rows' indices: each row's
// logits in `parts` slices (items row * parts + part, shared between the threads), then a
// merge per row that keeps the first slice holding the largest key, so the first index wins
// as in one pass.
struct ArgmaxTask {
  const at::BFloat16* logits;  // [max_rows, n], row stride `stride`
  int64_t n, stride, parts;
  uint32_t* keys;      // [max_rows, parts]
  int64_t* partial;    // [max_rows, parts]
  int64_t* out;        // [max_rows]
};

void argmax_parts_task(const void* raw, int64_t /*rows*/, int64_t begin, int64_t end) {
  const ArgmaxTask& t = *static_cast<const ArgmaxTask*>(raw);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t r = item / t.parts, part = item % t.parts;
    const int64_t lo = t.n * part / t.parts, hi = t.n * (part + 1) / t.parts;
    if (lo == hi) {  // an empty slice (n < parts) loses to every other
      t.keys[item] = 0;
      t.partial[item] = -1;
      continue;
    }
    t.partial[item] = argmax_range(t.logits + r * t.stride, lo, hi, &t.keys[item]);
  }
}

void argmax_merge_task(const void* raw, int64_t /*rows*/, int64_t begin, int64_t end) {
  const ArgmaxTask& t = *static_cast<const ArgmaxTask*>(raw);
  for (int64_t r = begin; r < end; ++r) {
    int64_t best = -1;
    uint32_t best_key = 0;
    for (int64_t part = 0; part < t.parts; ++part) {
      const int64_t item = r * t.parts + part;
      if (t.partial[item] < 0) continue;
      if (best < 0 || t.keys[item] > best_key) {
        best = t.partial[item];
        best_key = t.keys[item];
      }
    }
    t.out[r] = best;
  }
}

template <typename T>
py::capsule task_args(T* task) {
  return py::capsule(task, "mini_infer.task_args", [](void* p) { delete static_cast<T*>(p); });
}

void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.dim() >= 1 && t.stride(-1) == 1,
              "fused_ops task: ", name, " must be bfloat16 with a unit last stride");
}

// x, residual (None: plain norm), out: [max_rows, n] buffers of the step.
py::capsule make_norm_task(torch::Tensor x, c10::optional<torch::Tensor> residual,
                           torch::Tensor weight, torch::Tensor out, double eps, int64_t lanes) {
  check_bf16(x, "x");
  check_bf16(out, "out");
  check_bf16(weight, "weight");
  TORCH_CHECK(lanes == 8 || lanes == 16, "lanes must be 8 or 16");
  if (residual.has_value()) {
    check_bf16(*residual, "residual");
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(),
                "residual must be contiguous and shaped like x");
  }
  return task_args(new NormTask{x.data_ptr<bf16>(),
                                residual.has_value() ? residual->data_ptr<bf16>() : nullptr,
                                weight.data_ptr<bf16>(), out.data_ptr<bf16>(), x.size(1),
                                x.stride(0), out.stride(0), lanes, static_cast<float>(eps)});
}

// x [max_rows, heads, head_dim] view (the q and k heads of the qkv buffer); cos, sin
// [max_rows, head_dim] contiguous buffers.
py::capsule make_rotary_task(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_bf16(x, "x");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.size(-1) == x.size(2) && sin.sizes() == cos.sizes(),
              "rotary task: x [rows, heads, head_dim], cos/sin [rows, head_dim]");
  return task_args(new RotaryTask{x.data_ptr<bf16>(), cos.data_ptr<bf16>(), sin.data_ptr<bf16>(),
                                  x.size(1), x.size(2), x.stride(0), x.stride(1)});
}

py::capsule make_silu_mul_task(torch::Tensor gate_up, torch::Tensor out, int64_t lanes,
                               int64_t parts, int64_t split_below) {
  check_bf16(gate_up, "gate_up");
  check_bf16(out, "out");
  TORCH_CHECK(gate_up.is_contiguous() && out.is_contiguous() &&
                  gate_up.size(1) == 2 * out.size(1),
              "silu_mul task: gate_up [rows, 2n], out [rows, n], contiguous");
  check_exp_lanes(lanes);
  TORCH_CHECK(parts >= 1 && split_below >= 0,
              "silu_mul task: parts must be positive and split_below not negative");
  return task_args(new SiluMulTask{gate_up.data_ptr<bf16>(), out.data_ptr<bf16>(), out.size(1),
                                   lanes, static_cast<int64_t>(at::get_num_threads()), parts,
                                   split_below});
}

// table [n, width...] and out [max_rows, width...] of one dtype, rows unit-strided inside;
// index int64 [max_rows] contiguous: the step's buffers.
py::capsule make_gather_task(torch::Tensor table, torch::Tensor index, torch::Tensor out) {
  TORCH_CHECK(table.dim() == 2 && out.dim() == 2 && table.size(1) == out.size(1) &&
                  table.scalar_type() == out.scalar_type() && table.stride(1) == 1 &&
                  out.stride(1) == 1,
              "gather task: table [n, width] and out [rows, width] of one dtype, unit last stride");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.is_contiguous() &&
                  index.size(0) == out.size(0),
              "gather task: index int64 [rows], contiguous");
  const int64_t item = table.element_size();
  return task_args(new GatherTask{static_cast<const char*>(table.data_ptr()),
                                  index.data_ptr<int64_t>(), static_cast<char*>(out.data_ptr()),
                                  table.size(1) * item, table.stride(0) * item,
                                  out.stride(0) * item});
}

// logits [max_rows, n] bf16 (unit last stride), keys int32 and partial int64 [max_rows,
// parts], out int64 [max_rows]: the step's buffers.
py::capsule make_argmax_task(torch::Tensor logits, torch::Tensor keys, torch::Tensor partial,
                             torch::Tensor out) {
  check_bf16(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1, "argmax task: logits [rows, n >= 1]");
  const int64_t rows = logits.size(0);
  TORCH_CHECK(keys.scalar_type() == at::kInt && partial.scalar_type() == at::kLong &&
                  keys.is_contiguous() && partial.is_contiguous() && keys.dim() == 2 &&
                  keys.sizes() == partial.sizes() && keys.size(0) == rows && keys.size(1) >= 1,
              "argmax task: keys int32 and partial int64, both [rows, parts], contiguous");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.dim() == 1 &&
                  out.size(0) == rows,
              "argmax task: out int64 [rows], contiguous");
  return task_args(new ArgmaxTask{logits.data_ptr<at::BFloat16>(), logits.size(1),
                                  logits.stride(0), keys.size(1),
                                  reinterpret_cast<uint32_t*>(keys.data_ptr<int32_t>()),
                                  partial.data_ptr<int64_t>(), out.data_ptr<int64_t>()});
}

py::capsule task_fn(void (*fn)(const void*, int64_t, int64_t, int64_t)) {
  return py::capsule(reinterpret_cast<void*>(fn), "mini_infer.task_fn");
}

}  // namespace

// The k largest values of a row, sorted: value descending, then index ascending (of equal
// values the one met first ranks first). The row is read in chunks of 16: once k values are
// kept, a chunk with no value above the smallest kept one is skipped on one vector compare, so
// a row of probabilities costs about one read past its first few hundred values. False where
// the row holds a NaN (the caller then takes torch's topk, which ranks NaN first).
bool topk_row(const float* x, int64_t n, int64_t k, float* values, int64_t* indices) {
  using Entry = std::pair<float, int64_t>;
  auto before = [](const Entry& a, const Entry& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::vector<Entry> kept;
  kept.reserve(2 * k + 16);
  bool full = false;  // kept holds the k first in order so far: only a larger value enters
  float smallest = 0.0f;  // the k-th kept value once full
  auto compact = [&] {
    if (static_cast<int64_t>(kept.size()) < 2 * k) return;
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), before);
    kept.resize(k);
    smallest = kept[k - 1].first;  // nth_element: the k-th in order, the smallest value kept
    full = true;
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    uint32_t pass = 0xffff;  // the chunk's values that may enter
#if defined(__AVX512F__)
    const __m512 v = _mm512_loadu_ps(x + i);
    if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return false;
    if (full) pass = _mm512_cmp_ps_mask(v, _mm512_set1_ps(smallest), _CMP_GT_OQ);
#elif defined(__AVX2__)
    const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + i + 8);
    if (_mm256_movemask_ps(_mm256_cmp_ps(lo, lo, _CMP_UNORD_Q)) |
        _mm256_movemask_ps(_mm256_cmp_ps(hi, hi, _CMP_UNORD_Q)))
      return false;
    if (full) {
      const __m256 t = _mm256_set1_ps(smallest);
      pass = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(lo, t, _CMP_GT_OQ))) |
             (static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(hi, t, _CMP_GT_OQ))) << 8);
    }
#else
    for (int64_t j = 0; j < 16; ++j)
      if (x[i + j] != x[i + j]) return false;
    if (full) {
      pass = 0;
      for (int64_t j = 0; j < 16; ++j) pass |= static_cast<uint32_t>(x[i + j] > smallest) << j;
    }
#endif
    if (!pass) continue;
    for (int64_t j = 0; j < 16; ++j) {
      if ((pass >> j) & 1u) kept.emplace_back(x[i + j], i + j);
    }
    compact();
  }
  for (; i < n; ++i) {  // the last values, fewer than 16
    if (x[i] != x[i]) return false;
    if (!full || x[i] > smallest) kept.emplace_back(x[i], i);
    compact();
  }
  const int64_t m = std::min<int64_t>(k, static_cast<int64_t>(kept.size()));
  std::partial_sort(kept.begin(), kept.begin() + m, kept.end(), before);
  for (int64_t j = 0; j < m; ++j) {
    values[j] = kept[j].first;
    indices[j] = kept[j].second;
  }
  return true;
}

// topk_row over the rows of x [rows, n] (float32, unit last stride): values [rows, k], indices
// [rows, k] and, per row, whether it was taken (false: the row holds a NaN; its outputs unset).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> topk_rows(const torch::Tensor& x,
                                                                  int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "topk_rows: x must be float32 [rows, n] with a unit last stride");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  TORCH_CHECK(k >= 1 && k <= n, "topk_rows: k must be in [1, n], got ", k);
  auto values = torch::empty({rows, k}, torch::kFloat);
  auto indices = torch::empty({rows, k}, torch::kLong);
  auto taken = torch::empty({rows}, torch::kBool);
  const float* base = x.data_ptr<float>();
  float* v = values.data_ptr<float>();
  int64_t* ix = indices.data_ptr<int64_t>();
  bool* ok = taken.data_ptr<bool>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) ok[r] = topk_row(base + r * stride, n, k, v + r * k, ix + r * k);
  });
  return {values, indices, taken};
}

// ---------------------------------------------------------------------------------------------
// The sampler's probabilities (engine/sampler.py): probs[r] = softmax(float(logits[r]) / t[r]),
// the bits of `torch.softmax(logits.float() / t[:, None], -1)` in one call. The division is one
// IEEE division an element, as torch's div; the softmax follows ATen's over the last dim
// (_vec_softmax_lastdim) on this machine's dispatch width, which `exp_lanes` names as for SiLU:
// 16 (AVX-512: 16 float lanes, SLEEF's 16-lane expf), 8 (AVX2: 8 lanes, the 8-lane expf) or 0
// (DEFAULT: the generic vector of 8 lanes, std::exp). Its steps: m = max (exact in any order),
// e = exp(x - m), s = sum e (reduce_all: one accumulator of a vector's lanes over the row's whole
// vectors, a partial last vector added to its first lanes only, then the lanes by halves with
// AVX (lane i + lane i + W/2, ..., then + 1), in order on DEFAULT; a row shorter than a vector
// adds its values in order), then e * (1 / s). Element-wise steps are vectorised here in any
// width (each element's result is one IEEE operation, or SLEEF's, whatever the vector); only
// the sum keeps torch's lanes. A row whose scaled values hold a NaN or whose maximum is not
// finite is reported (false): its softmax is NaN or undefined, and the caller takes torch's
// chain for the call.
//
// A row is computed on one thread, the same way whatever else is in the call. Rows split across
// at::parallel_for only where a call has many: one row runs inline, where torch's chain (a cast,
// a division, a softmax, each over more than ATen's grain) woke the second thread for each.
constexpr int64_t kRowsInline = 4;  // fewer rows run inline (a 49k row: ~30 us)

// out = float(x) / t (one IEEE division an element, in vectors of whatever width the build
// has: the same bits at any); the largest value into *max (exact in any order); false where a
// value is NaN.
template <typename scalar_t>
bool scale_row(const scalar_t* x, float t, int64_t n, float* out, float* max) {
  float m = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    const float v = float_at(x, i) / t;
    out[i] = v;
    nan |= v != v;
    m = v > m ? v : m;
  }
  *max = m;
  return !nan;
}

// v = exp(v - m) in place over n floats, as torch's map computes it (SLEEF's expf of
// `exp_lanes` lanes on whole vectors and on the zero-padded last one, or std::exp), and their
// sum in reduce_all's order.
float exp_and_sum(float* v, int64_t n, float m, int64_t exp_lanes) {
  const int64_t width = exp_lanes == 0 ? 8 : exp_lanes;
  alignas(64) float acc[16] = {};  // e >= 0: a zero start adds nothing (no -0 to lose)
  int64_t i = 0;
#if defined(__AVX512F__)
  if (exp_lanes == 16) {
    const __m512 mv = _mm512_set1_ps(m);
    __m512 a = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(v + i), mv));
      _mm512_storeu_ps(v + i, e);
      a = _mm512_add_ps(a, e);
    }
    if (i < n) {
      const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1u);
      const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, v + i), mv));
      _mm512_mask_storeu_ps(v + i, k, e);
      a = _mm512_mask_add_ps(a, k, a, e);
      i = n;
    }
    _mm512_store_ps(acc, a);
  }
#endif
#if defined(__AVX2__)
  if (exp_lanes == 8) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 a = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_loadu_ps(v + i), mv));
      _mm256_storeu_ps(v + i, e);
      a = _mm256_add_ps(a, e);
    }
    _mm256_store_ps(acc, a);
    if (i < n) {
      alignas(32) float tail[8] = {};
      for (int64_t l = 0; l < n - i; ++l) tail[l] = v[i + l] - m;
      _mm256_store_ps(tail, Sleef_expf8_u10(_mm256_load_ps(tail)));
      for (int64_t l = 0; l < n - i; ++l) {
        v[i + l] = tail[l];
        acc[l] += tail[l];
      }
      i = n;
    }
  }
#endif
  for (int64_t l = 0; i < n; ++i, l = (l + 1) % width) {  // std::exp, the lanes in turn
    v[i] = std::exp(v[i] - m);
    acc[l] += v[i];
  }
  if (n < width) {  // no whole vector: the values in order
    float total = v[0];
    for (int64_t j = 1; j < n; ++j) total += v[j];
    return total;
  }
  if (exp_lanes == 0) {
    float total = acc[0];
    for (int64_t l = 1; l < width; ++l) total += acc[l];
    return total;
  }
  for (int64_t h = width / 2; h >= 1; h /= 2)
    for (int64_t l = 0; l < h; ++l) acc[l] = acc[l] + acc[l + h];
  return acc[0];
}

void scale_by(float* v, int64_t n, float s) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) v[i] = v[i] * s;
}

template <typename scalar_t>
bool softmax_row(const scalar_t* x, float t, int64_t n, int64_t exp_lanes, float* out) {
  float m;
  if (!scale_row(x, t, n, out, &m) || !std::isfinite(m)) return false;
  scale_by(out, n, 1.0f / exp_and_sum(out, n, m, exp_lanes));
  return true;
}

// logits [rows, n] float32 or bfloat16 (unit last stride), temperatures float32 [rows] ->
// (probs float32 [rows, n], per row whether it was computed).
std::tuple<torch::Tensor, torch::Tensor> softmax_rows(const torch::Tensor& logits,
                                                      const torch::Tensor& temperatures,
                                                      int64_t exp_lanes) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1 && logits.stride(1) == 1 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "softmax_rows: logits must be float32 or bfloat16 [rows, n >= 1], unit last stride");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat && temperatures.dim() == 1 &&
                  temperatures.size(0) == rows && temperatures.is_contiguous(),
              "softmax_rows: temperatures must be float32 [rows], contiguous");
  check_exp_lanes(exp_lanes);
  auto probs = torch::empty({rows, n}, torch::kFloat);
  auto done = torch::empty({rows}, torch::kBool);
  const float* t = temperatures.data_ptr<float>();
  float* out = probs.data_ptr<float>();
  bool* ok = done.data_ptr<bool>();
  const int64_t stride = logits.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, logits.scalar_type(), "softmax_rows", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsInline, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        ok[r] = softmax_row<scalar_t>(x + r * stride, t[r], n, exp_lanes, out + r * n);
    });
  });
  return {probs, done};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "out = RMSNorm(x), HF's rounding, torch's summation order");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = RMSNorm(residual), in place");
  m.def("rotary_", &rotary_, "RoPE on [tokens, heads, head_dim] in place (rolled signed sin)");
  m.def("silu_mul", &silu_mul, "out = silu(gate) * up from [rows, 2n], torch's exp");
  m.def("argmax_rows", &argmax_rows, "torch.max(x, -1).indices for float32/bfloat16 rows");
  m.def("topk_rows", &topk_rows, "each row's k largest, value descending then index ascending");
  m.def("softmax_rows", &softmax_rows, "softmax(float(logits) / t) per row, torch's bits");
  m.def("exp_lanes_built", &exp_lanes_built, "widest SLEEF exp this build can call (0, 8, 16)");
  m.def("norm_task_fn", [] { return task_fn(&norm_task); });
  m.def("rotary_task_fn", [] { return task_fn(&rotary_task); });
  m.def("silu_mul_task_fn", [] { return task_fn(&silu_mul_task); });
  m.def("gather_task_fn", [] { return task_fn(&gather_task); });
  m.def("argmax_parts_task_fn", [] { return task_fn(&argmax_parts_task); });
  m.def("argmax_merge_task_fn", [] { return task_fn(&argmax_merge_task); });
  m.def("make_argmax_task", &make_argmax_task, "a fused decode step's greedy ids (argmax_rows)");
  m.def("make_gather_task", &make_gather_task, "a fused decode step's row gather (index_select)");
  m.def("make_norm_task", &make_norm_task, "a fused decode step's (add +) RMSNorm over rows");
  m.def("make_rotary_task", &make_rotary_task, "a fused decode step's RoPE over rows");
  m.def("make_silu_mul_task", &make_silu_mul_task, "a fused decode step's SiLU * up over rows");
}
