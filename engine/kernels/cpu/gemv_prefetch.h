// Software prefetch for the GEMVs (quant_gemm.cpp, bf16_gemm.cpp): the weights a GEMV streams
// lie in order (the next blocks follow in memory), and on the 2-core Intel Xeon VM (AVX-512
// VNNI, no avx512_bf16) the hardware prefetcher alone left a GEMV streamed from memory at 16-19
// GB/s of the 23-26 a plain read makes; fetching 2 KiB ahead took it to 20-26
// (loadtest/JOURNAL.md). The exact int8 path too (running a bf16 lm_head's 28 MB int8 screen,
// as it did before the screen's own GEMV: 2.0 ms of a W1 bf16 step, 1.4 with the prefetch), and
// the screen's GEMV (bf16_gemm.cpp); on the AVX2-only Zen 3 the bf16 GEMV's AVX2 path (one row,
// a 1B model's gate_up: 29.8 -> 34.5 GB/s with it). MINI_INFER_GEMV_PREFETCH_BYTES
// overrides the distance (0: none), read once per library, to measure it on another CPU.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>

namespace gemv_prefetch {

constexpr int64_t kDefaultBytes = 2048;

static inline int64_t read_distance() {
  const char* e = std::getenv("MINI_INFER_GEMV_PREFETCH_BYTES");
  return e != nullptr && *e != '\0' ? std::max<int64_t>(0, std::atoll(e)) : kDefaultBytes;
}

// Read once, when the library loads. static: each library keeps its own (no symbol shared
// between the two libraries). Not a function-local static: its first-use guard has a call on
// its slow path, and the kernels call `ahead` inside their loops, so GCC kept their
// accumulators in memory around it (every zmm register is caller-saved): on the 2-core Zen 5
// the int4 VNNI GEMV took 1.05-1.26x this one's time at 4-64 rows, the bf16 GEMM's two-block
// tiles 1.03-1.13x at 32-64 (loadtest/JOURNAL.md, fortieth session).
static const int64_t kDistance = read_distance();

static inline int64_t distance() { return kDistance; }

// One prefetch per cache line of the `bytes` that lie distance() past `p`.
static inline void ahead(const void* p, int64_t bytes) {
  const int64_t d = distance();
  if (d <= 0) return;
  const char* c = static_cast<const char*>(p) + d;
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(c + offset);
}

}  // namespace gemv_prefetch
