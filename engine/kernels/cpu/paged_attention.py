"""The C++ paged attention (paged_attention.cpp), decode and extend: build once per machine,
load, dispatch.

Why a kernel: the torch reference gathers every decoding request's whole context out of the
block pool (`index_select`) before SDPA, in every layer of every step, a copy that grows with
context length. The kernel walks each request's block table and reads K/V in place, the query
heads of one KV head together (GQA), with an online softmax across blocks and, for contexts
longer than one partition (`PARTITION_TOKENS`), a split across threads with a final merge; a
step with fewer (sequence, KV head) pairs than two per thread splits shorter contexts too, so
every thread has work (`partition_blocks_for`).

It runs 1.3-2.3x the reference's decode attention at SmolLM2 shapes (one thread; the table:
loadtest/JOURNAL.md, "Kernel measurements moved out of the code").

Two things made it: head_dim fixed at compile time for 64 and 128 (straight vector code, no
remainder loops: bf16 32 x 256 went from 0.93x to 2.7x), and a software prefetch of the next
block's rows (blocks are scattered over the pool, so the hardware prefetcher cannot follow the
table: fp32 32 x 256 0.92x -> 1.18x before the specialisation). In the engine (SmolLM2, 2
threads, context ~230, 32 new tokens, 3 alternating rounds, medians), tok/s of the kernel over
the reference: bf16 0.96 at 1 stream and 1.27 at 16; fp32 0.91 and 1.20 (at 1 stream
attention is a small part of the step and the difference is within this machine's noise). It
also drops the gather buffer that grows with context length and the decode mask.

Decode prefetches the next block a row per token while it computes this one. The 64
prefetches of a block (bf16, head_dim 64) used to go out at once: they filled the core's miss
buffers and stalled it until the first returned, so the memory time added to the compute. At
one SmolLM2 row on the Zen 4 VM (`loadtest/JOURNAL.md`, "Decode attention at long contexts"):
30 layers of decode attention from memory 1.4-1.7x faster from 256 tokens of context on (the
AVX2 build 1.2-1.5x), an int4 step at 1.5-2K tokens 1.35-1.4x. A register path (rows widened
and accumulators kept in AVX-512 registers for a whole partition, the same bits) was level
with this one in the engine and from memory, 1.1-1.2x only with the cache in L2/L3: removed.
Next levers: more rows in flight per thread (from memory the kernel reads ~10 GB/s, against 26
with the data in L2/L3), and a K layout transposed per block so a block's scores are one
broadcast-FMA loop.

Extend (a prefill chunk after cached tokens: a prefix-cache hit, the next chunk of a chunked
prefill, a resumed request) reads the cache in place too: `paged_attention_extend` takes all such
chunks of a step in one call, work items (chunk, query tile of up to 16 tokens, KV head), each
walking the block table up to its last query's position with a causal online softmax (the
chunk's own K/V are written to the cache before attention, in TorchPagedAttention.forward).
Per block, the head's K rows are widened to fp32 and transposed once ([head_dim, block]), so
scores are broadcast-FMAs over the block's 16 tokens (four query rows at a time), the
exponentials are one AVX-512 polynomial, and the value sums stay in registers. The first
version (a dot product per query row and key, scalar expf) ran at 0.3-0.7x the reference for
32+ new tokens; this one runs 0.77-1.75x the reference (the table by prefix and new tokens:
loadtest/JOURNAL.md, "Kernel measurements moved out of the code").

Hence the rule (`use_extend_kernel`), measured on the AMD EPYC: bf16 chunks after a cached
prefix always take the kernel (it never lost by more than that machine's noise); fp32 chunks
only up to 16 new tokens (EXTEND_MAX_TOKENS_FP32): beyond that MKL's fp32 GEMMs inside SDPA win
once the prefix is long (0.77-0.87 at 2048). Fresh prompts (no cached prefix) stay on SDPA's
causal kernel: there is nothing in the cache to avoid copying. In the engine (SmolLM2 bf16, 2
threads, 16 requests hitting a cached prefix, one new token each; `bench_extend_attention
--engine`, load average 4-5): reference / kernel 1.23 with a 2048-token prefix and 8 new
tokens each, 0.97 with 512 and 24. On the 2-core Xeon the kernel loses from 16 new tokens on
(0.25-0.9x), so the CPU backend now measures the limit on the running machine
(engine/kernels/cpu/extend_choice.py) and the static rule is what applies without one.
Next lever: bf16 dot products
(avx512_bf16) for the scores instead of widening K.

Build: `torch.utils.cpp_extension.load` with flags chosen from the running CPU (`-mavx512f ...`
on AVX-512, `-mavx2 -mfma` on AVX2, none otherwise), into a directory under the cache dir named
by the instruction set and a hash of the source: compiled once (40 s of CPU on the 2-core Zen 4
VM; 1.5-4 minutes of wall time while other jobs share it), then loaded in about a second by
every later start; a changed source or another CPU gets its own directory (shared with the other
kernels: engine/kernels/cpu/extension.py). No C++ compiler (or a failed build): `load()` is
None, with one warning; attention_backend "auto" then takes the torch reference, an explicit
"cpu" is an error (engine/attention_backends.py).

The backend adapters over these calls (`CpuPagedAttention`, `CpuInt8PagedAttention`) live in
engine/layers/cpu_attention.py, beside the torch reference they fall back to per step.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from engine.kernels.attention_types import Int8KVCache, PrefillChunk
from engine.kernels.cpu import extension
from engine.kernels.cpu.extension import compiler  # noqa: F401  (re-exported)
from engine.kernels.cpu.extension import remove_stale_lock as _remove_stale_lock  # noqa: F401
from engine.platform import cpu_info

if TYPE_CHECKING:
    from engine.kernels.cpu.extend_choice import ExtendLimits

SOURCE = Path(__file__).with_name("paged_attention.cpp")
PARTITION_TOKENS = 512  # context tokens per work item before a long context is split
# A step with fewer (sequence, KV head) items than two per thread splits contexts of at least
# 2 x this many tokens into partitions anyway (see partition_blocks_for).
MIN_SPLIT_TOKENS = 32
MAX_QUERY_TILE = 16  # extend: query tokens per work item (see choose_query_tile)
# extend: longest new chunk sent to the kernel in fp32 (bf16: any length); see the docstring
EXTEND_MAX_TOKENS_FP32 = 16
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
_ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "portable": [],
}


def extension_name(isa: str) -> str:
    return f"mini_infer_paged_attention_{isa}_{extension.source_digest(SOURCE)}"


def build(build_root: Path | None = None, isa: str | None = None) -> ModuleType | None:
    """Compile (or reuse) and import the extension; None, with a warning, if that fails."""
    isa = isa or cpu_info().vector_isa
    return extension.build(
        extension_name(isa), SOURCE, _ISA_FLAGS[isa], build_root, event="paged_attention"
    )


@functools.cache
def load() -> ModuleType | None:
    """The extension for this machine, built at most once per process (and once per machine)."""
    return build()


def partition_blocks_for(
    num_seqs: int, num_kv_heads: int, table_blocks: int, block_size: int, threads: int
) -> int:
    """Blocks per partition of a decode step (`table_blocks`: its block table's width).

    Partitions of PARTITION_TOKENS, unless the step has fewer (sequence, KV head) items than
    two per thread: then contexts are cut in as many partitions as give every thread about two
    items, of at least MIN_SPLIT_TOKENS. One W1 row of SmolLM2 is 3 KV heads: on 2 threads one
    thread did two heads and the other one (attention 0.39 ms a step on the slower thread
    against 0.33 on average); in 2 partitions each does 3 half-heads and a merge.
    The fused decode step and the per-operator decode both take this, so their partitions,
    and bits, are the same."""
    default = max(1, PARTITION_TOKENS // block_size)
    pairs = num_seqs * num_kv_heads
    wanted = -(-2 * threads // max(pairs, 1))  # partitions per (sequence, KV head)
    smallest = max(1, MIN_SPLIT_TOKENS // block_size)
    if threads <= 1 or wanted <= 1 or table_blocks < 2 * smallest:
        return default
    return min(default, max(smallest, -(-table_blocks // wanted)))


def decode(
    kernels: ModuleType,  # the built extension (load())
    q: torch.Tensor,  # [num_decodes, num_heads, head_dim], head_dim contiguous
    kv_cache: torch.Tensor,  # [num_kv_blocks, block_size, 2, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_decodes, max_num_blocks] int64
    context_lens: torch.Tensor,  # [num_decodes] int64
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    partition_blocks = partition_blocks_for(
        q.shape[0], kv_cache.shape[3], block_table.shape[1], kv_cache.shape[1],
        torch.get_num_threads(),
    )  # fmt: skip
    kernels.paged_attention_decode(
        q, kv_cache, block_table, context_lens, q.shape[-1] ** -0.5, partition_blocks, out
    )
    return out


def decode_int8(
    kernels: ModuleType,  # the built extension (load())
    q: torch.Tensor,  # [num_decodes, num_heads, head_dim], head_dim contiguous
    kv_cache: Int8KVCache,  # codes [num_kv_blocks, block_size, 2, KVH, head_dim], scales
    block_table: torch.Tensor,  # [num_decodes, max_num_blocks] int64
    context_lens: torch.Tensor,  # [num_decodes] int64
) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
    """Decode over the int8 KV cache: each K/V row dequantized (codes x scale) as it is read."""
    out = torch.empty(q.shape, dtype=q.dtype)
    codes = kv_cache.codes
    partition_blocks = partition_blocks_for(
        q.shape[0], codes.shape[3], block_table.shape[1], codes.shape[1], torch.get_num_threads()
    )
    kernels.paged_attention_decode_int8(
        q, codes, kv_cache.scales, block_table, context_lens, q.shape[-1] ** -0.5,
        partition_blocks, out,
    )  # fmt: skip
    return out


def store_int8(
    kernels: ModuleType,  # the built extension (load())
    kv: torch.Tensor,  # [num_tokens, 2, num_kv_heads, head_dim] new K (rotated) and V
    kv_cache: Int8KVCache,
    slots: torch.Tensor,  # [num_tokens] int64, each a slot of the pool
) -> None:
    """The new rows quantized into the int8 cache at their slots, with
    engine/quant/kv_int8.quantize_kv's bits; a slot outside the pool raises before any write."""
    kernels.store_kv_int8(kv.contiguous(), slots.contiguous(), kv_cache.codes, kv_cache.scales)


def extend(
    kernels: ModuleType,  # the built extension (load())
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], the whole step's q (head_dim contiguous)
    kv_cache: torch.Tensor,  # [num_kv_blocks, block_size, 2, num_kv_heads, head_dim]
    chunks: list[PrefillChunk],  # each with block_ids covering [0, start_position + num_tokens)
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim] contiguous: the chunks' rows written
    query_tile: int | None = None,
) -> torch.Tensor:
    """Causal attention of prefill chunks that follow cached tokens, reading the cache in place
    (their own K/V written to the cache already). All chunks in one kernel call."""
    block_table = torch.nn.utils.rnn.pad_sequence(
        [chunk.block_ids for chunk in chunks], batch_first=True
    )
    query_starts = torch.tensor([chunk.token_start for chunk in chunks], dtype=torch.int64)
    query_lens = torch.tensor([chunk.num_tokens for chunk in chunks], dtype=torch.int64)
    start_positions = torch.tensor([chunk.start_position for chunk in chunks], dtype=torch.int64)
    if query_tile is None:
        query_tile = choose_query_tile(int(query_lens.sum()), kv_cache.shape[3])
    kernels.paged_attention_extend(
        q, kv_cache, block_table, query_starts, query_lens, start_positions,
        q.shape[-1] ** -0.5, query_tile, out,
    )  # fmt: skip
    return out


def choose_query_tile(num_queries: int, num_kv_heads: int) -> int:
    """Query rows per work item: up to MAX_QUERY_TILE (each tile reads the context's K/V once
    per KV head, so bigger tiles read less), but small enough that every thread gets about two
    items (a chunk of 8 tokens over 3 KV heads on 2 threads: tiles of 6, not one of 8 that
    leaves a thread a third of the work)."""
    per_thread = -(-num_queries * num_kv_heads // (2 * torch.get_num_threads()))
    return max(1, min(MAX_QUERY_TILE, per_thread))


def use_extend_kernel(
    chunk: PrefillChunk, dtype: torch.dtype, limits: ExtendLimits | None = None
) -> bool:
    """Whether a prefill chunk goes to the extend kernel rather than gather + SDPA: only chunks
    that follow cached tokens (a fresh prompt has no cache to read: SDPA's causal kernel on
    its own K/V), of at most the limit for the chunk's context where this machine's calibration
    gave `limits` (engine/kernels/cpu/extend_choice.py); without it, in bf16 always and in fp32
    up to EXTEND_MAX_TOKENS_FP32 new tokens (measured on the EPYC: see the module docstring)."""
    if chunk.block_ids is None or dtype not in SUPPORTED_DTYPES:
        return False
    if limits is not None:
        return chunk.num_tokens <= limits.for_context(chunk.start_position)
    return dtype == torch.bfloat16 or chunk.num_tokens <= EXTEND_MAX_TOKENS_FP32
