"""The attention backends over the C++ paged-attention kernels (engine/kernels/cpu/
paged_attention.py): `CpuPagedAttention` for the float pool, `CpuInt8PagedAttention` for the
int8 one. Each subclasses its torch reference and hands it what the kernels do not cover (fresh
prompts, fp16, int8 prefill chunks), so a step never fails for want of a kernel path."""

from __future__ import annotations

from types import ModuleType

import torch

from engine.kernels.attention_types import (
    AttentionMetadata,
    Int8KVCache,
    PrefillChunk,
    decode_mask,
)
from engine.kernels.cpu import (
    extend_choice,
    paged_attention,  # its functions looked up per call (tests patch)
)
from engine.layers.attention import TorchPagedAttention
from engine.quant.kv_int8 import Int8PagedAttention


class CpuPagedAttention(TorchPagedAttention):
    """The C++ kernels on the decode rows and on prefill chunks that follow cached tokens
    (`use_extend_kernel`, up to the length `calibrate` measured the kernel faster for); fresh
    prompts (and dtypes the kernels lack, fp16) go through the torch reference it subclasses.
    Needs no decode mask: the kernels stop at each request's context length."""

    name = "cpu"
    needs_decode_mask = False

    def __init__(self, extension: ModuleType):
        super().__init__()
        self.extension = extension
        # The most new tokens a chunk after cached tokens takes the kernel with, per context,
        # measured on this machine (`calibrate`); None: paged_attention's static rule alone.
        self.extend_limit: extend_choice.ExtendLimits | None = None

    def calibrate(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype) -> None:  # fmt: skip
        """Set `extend_limit` for the model's attention shape (engine/kernels/cpu/
        extend_choice.py: measured once per machine, then read from the cache)."""
        if dtype not in paged_attention.SUPPORTED_DTYPES:
            return
        self.extend_limit = extend_choice.extend_limit(
            self.extension, lambda q, kv_cache, chunk: self._prefill(q, None, kv_cache, chunk),
            num_heads, num_kv_heads, head_dim, block_size, dtype,
        )  # fmt: skip

    def _decode(self, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        if q.dtype not in paged_attention.SUPPORTED_DTYPES:
            _ensure_decode_mask(meta, kv_cache.shape[1], q.dtype)
            return super()._decode(q, kv_cache, meta)
        args = (self.extension, q, kv_cache, meta.decode_block_table, meta.decode_context_lens)
        return _profiled("mini_infer::paged_attention_decode", paged_attention.decode, *args)

    def _prefills(self, q, kv, kv_cache, chunks: list[PrefillChunk], out: torch.Tensor) -> None:
        in_place, gathered = [], []
        for chunk in chunks:
            kernel = paged_attention.use_extend_kernel(chunk, q.dtype, self.extend_limit)
            (in_place if kernel else gathered).append(chunk)
        if gathered:
            super()._prefills(q, kv, kv_cache, gathered, out)
        if not in_place:
            return
        _profiled("mini_infer::paged_attention_extend", paged_attention.extend, self.extension, q,
                  kv_cache, in_place, out)  # fmt: skip


class CpuInt8PagedAttention(Int8PagedAttention):
    """The int8 KV cache with the C++ decode kernel reading codes and scales in place (no
    gather, no dequantized copy); prefill chunks go through the torch reference it subclasses
    (the extend kernel reads float caches only)."""

    name = "cpu-int8kv"
    needs_decode_mask = False

    def __init__(self, extension: ModuleType):
        self.extension = extension

    def _store(self, kv: torch.Tensor, kv_cache: Int8KVCache, slots: torch.Tensor) -> None:
        """In C++, the reference's bits (`quantize_kv` was ten torch ops a layer: 19 us for one
        row, 30 us for 32, every step)."""
        if kv.dtype not in paged_attention.SUPPORTED_DTYPES:
            return super()._store(kv, kv_cache, slots)
        args = (self.extension, kv, kv_cache, slots)
        _profiled("mini_infer::store_kv_int8", paged_attention.store_int8, *args)

    def _decode(self, q, kv_cache: Int8KVCache, meta: AttentionMetadata) -> torch.Tensor:
        if q.dtype not in paged_attention.SUPPORTED_DTYPES:
            _ensure_decode_mask(meta, kv_cache.codes.shape[1], q.dtype)
            return super()._decode(q, kv_cache, meta)
        args = (self.extension, q, kv_cache, meta.decode_block_table, meta.decode_context_lens)
        return _profiled(
            "mini_infer::paged_attention_decode_int8", paged_attention.decode_int8, *args
        )


def _ensure_decode_mask(meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> None:
    """The reference's decode mask, which the kernels do not need (so the runner skips it),
    built here for a step that falls back to the reference (a dtype the kernels lack)."""
    if meta.decode_mask is None:
        width = meta.decode_block_table.shape[1] * block_size
        meta.decode_mask = decode_mask(meta.decode_context_lens, width, dtype)


def _profiled(name: str, kernel, *args):
    """kernel(*args), under a named profiler range when one records: a pybind call is
    invisible to the profiler otherwise."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            return kernel(*args)
    return kernel(*args)
