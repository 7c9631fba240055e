"""The C++ paged decode attention (paged_attention.cpp): build once per machine, load, dispatch.

Why a kernel: the torch reference gathers every decoding request's whole context out of the
block pool (`index_select`) before SDPA, in every layer of every step, a copy that grows with
context length. The kernel walks each request's block table and reads K/V in place, the query
heads of one KV head together (GQA), with an online softmax across blocks and, for contexts
longer than one partition (`PARTITION_TOKENS`), a split across threads with a final merge.

Measured (AMD EPYC Zen 4 VM, SmolLM2 shapes: 9 heads, 3 KV heads, head_dim 64, block 16;
one thread, CPU time, so that the other tenants of this 2-core machine do not count; 31
alternating calls each; the reference's time over the kernel's, min / median):

    fp32  1 seq x 256: 1.83 / 1.70   32 x 256: 1.35 / 1.32   64 x 512: 1.48 / 1.47
          1 x 2048:    1.51 / 1.44
    bf16  1 x 256:     1.91 / 2.30   32 x 256: 2.68 / 2.34   64 x 512: 2.02 / 2.00
          1 x 2048:    1.26 / 1.30

Two things made it: head_dim fixed at compile time for 64 and 128 (straight vector code, no
remainder loops: bf16 32 x 256 went from 0.93x to 2.7x), and a software prefetch of the next
block's rows (blocks are scattered over the pool, so the hardware prefetcher cannot follow the
table: fp32 32 x 256 0.92x -> 1.18x before the specialisation). In the engine (SmolLM2, 2
threads, context ~230, 32 new tokens, 3 alternating rounds, medians), tok/s of the kernel over
the reference: bf16 0.96 at 1 stream and 1.27 at 16; fp32 0.91 and 1.20 (at 1 stream
attention is a small part of the step and the difference is within this machine's noise). It also drops the gather buffer that grows with context length and the
decode mask. Next levers: bf16 dot products with avx512_bf16 (vdpbf16ps) instead of widening,
and a K layout transposed per block so a block's scores are one broadcast-FMA loop.

Build: `torch.utils.cpp_extension.load` with flags chosen from the running CPU (`-mavx512f ...`
on AVX-512, `-mavx2 -mfma` on AVX2, none otherwise), into a directory under the cache dir named
by the instruction set and a hash of the source: compiled once (40 s of CPU on the 2-core Zen 4
VM; 1.5-4 minutes of wall time while other jobs share it), then loaded in about a second by
every later start; a changed source or another CPU gets its own directory (shared with the other
kernels: engine/kernels/cpu/extension.py). No C++ compiler (or a failed build) means the torch
reference, with one warning; the engine never fails for want of it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from engine.kernels.cpu import extension
from engine.kernels.cpu.extension import compiler  # noqa: F401  (re-exported)
from engine.kernels.cpu.extension import remove_stale_lock as _remove_stale_lock  # noqa: F401
from engine.layers.attention import AttentionMetadata, TorchPagedAttention, decode_mask
from engine.platform import cpu_info

SOURCE = Path(__file__).with_name("paged_attention.cpp")
PARTITION_TOKENS = 512  # context tokens per work item before a long context is split
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


def decode(
    extension: ModuleType,
    q: torch.Tensor,  # [num_decodes, num_heads, head_dim], head_dim contiguous
    kv_cache: torch.Tensor,  # [num_kv_blocks, block_size, 2, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_decodes, max_num_blocks] int64
    context_lens: torch.Tensor,  # [num_decodes] int64
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    partition_blocks = max(1, PARTITION_TOKENS // kv_cache.shape[1])
    extension.paged_attention_decode(
        q, kv_cache, block_table, context_lens, q.shape[-1] ** -0.5, partition_blocks, out
    )
    return out


class CpuPagedAttention(TorchPagedAttention):
    """The C++ kernel on the decode rows; prefill chunks (and dtypes the kernel lacks, fp16)
    go through the torch reference it subclasses. Needs no decode mask: the kernel stops at
    each request's context length."""

    name = "cpu"
    needs_decode_mask = False

    def __init__(self, extension: ModuleType):
        super().__init__()
        self.extension = extension

    def _decode(self, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        if q.dtype not in SUPPORTED_DTYPES:
            if meta.decode_mask is None:
                meta.decode_mask = decode_mask(
                    meta.decode_context_lens, meta.decode_block_table.shape[1] * kv_cache.shape[1],
                    q.dtype,
                )  # fmt: skip
            return super()._decode(q, kv_cache, meta)
        args = (self.extension, q, kv_cache, meta.decode_block_table, meta.decode_context_lens)
        if torch.autograd._profiler_enabled():  # a pybind call is invisible to the profiler
            with torch.profiler.record_function("mini_infer::paged_attention_decode"):
                return decode(*args)
        return decode(*args)
