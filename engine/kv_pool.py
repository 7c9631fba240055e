"""The KV-cache pool: sized, allocated and handed to the attention layers in one place.

One tensor [num_layers, num_kv_blocks, block_size, 2, num_kv_heads, head_dim] (K and V of a
slot side by side; zero-filled, so padded reads are finite), each layer's attention holding a
view of its slice. The int8 cache keeps codes of that shape plus float32 scales
[num_layers, num_kv_blocks, block_size, 2, num_kv_heads] (engine/quant/kv_int8.py). On the
CPU the pool is a lazy anonymous mapping (`lazy_zeros`); on a GPU, `torch.zeros`.

Its size is one rule for every device and dtype (`default_num_kv_blocks`): what the configured
sequences can use, capped by the memory budget, unless the config pins a block count.
"""

from __future__ import annotations

import functools
import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.config import EngineConfig
from engine.kv_cache_manager import cdiv
from engine.quant import kv_int8


@dataclass(frozen=True)
class KVPoolShape:
    """The per-block geometry of a model's pool (from its HF config and the block size)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_block(self, dtype: torch.dtype, kv_cache_dtype: str) -> int:
        """One block of every layer: K and V in `dtype`, or int8 codes plus float32 scales."""
        if kv_cache_dtype == "int8":
            return kv_int8.bytes_per_block(
                self.num_layers, self.block_size, self.num_kv_heads, self.head_dim
            )
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_dim * dtype.itemsize
        return self.num_layers * per_layer


@dataclass
class KVPool:
    cache: torch.Tensor  # float K/V, or the int8 codes: [num_layers, num_kv_blocks, ...]
    scales: torch.Tensor | None  # the int8 cache's scales, else None
    layer_caches: list  # what each attention layer holds: a tensor, or an Int8KVCache
    num_kv_blocks: int
    num_bytes: int


def lazy_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False
) -> torch.Tensor:
    """Zeros whose memory the OS commits page by page on first write.

    `torch.zeros` writes every byte, so a 512 MiB KV pool costs 512 MiB of RSS before the first
    request. A private anonymous mapping is zero already and its pages count only once a block
    is used: a worker's memory follows its load, while the pool (and so the scheduler's limit)
    keeps its configured size. Zero, not garbage, matters: a decode reads whole blocks, and
    masked-out slots must not hold NaN bit patterns (0 * NaN in the attention sum is NaN).

    Without `huge_pages` the mapping is marked MADV_NOHUGEPAGE: a block is a few KiB in each
    layer's slice ([num_layers, num_kv_blocks, ...]), and with transparent huge pages (numpy
    asks for them on its large allocations) its first write commits 2 MiB in every layer.
    Measured (SmolLM2 int4 + int8 KV, 30 layers): one 43-token request committed 87 MiB of
    the pool, 0.5 MiB without."""
    num_bytes = max(1, math.prod(shape) * dtype.itemsize)
    if not hasattr(mmap, "MAP_PRIVATE"):  # not a Unix: calloc, through numpy
        raw = np.zeros(num_bytes + 64, dtype=np.uint8)
        start = -raw.ctypes.data % 64  # cache-line aligned, like torch's own allocations
        return torch.from_numpy(raw[start : start + num_bytes]).view(dtype).view(shape)
    buffer = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        buffer.madvise(advice)
    # The tensor holds a reference to `buffer`: the mapping lives (and is unmapped) with it.
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def default_num_kv_blocks(config: EngineConfig, max_model_len: int, bytes_per_block: int) -> int:
    """What the configured sequences can use (max_num_seqs full-length sequences), capped
    by the memory budget: a pool past that is never written. On the CPU its pages are
    committed on first write either way (`lazy_zeros`)."""
    usable = config.max_num_seqs * cdiv(max_model_len, config.block_size)
    return max(1, min(usable, config.kv_cache_memory_bytes // bytes_per_block))


def allocate(
    shape: KVPoolShape,
    config: EngineConfig,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVPool:
    """The pool for `config` (its kv_cache_dtype, block count or budget, prefault) on `device`."""
    bytes_per_block = shape.bytes_per_block(dtype, config.kv_cache_dtype)
    num_blocks = config.num_kv_blocks or default_num_kv_blocks(
        config, max_model_len, bytes_per_block
    )
    is_prefault = config.kv_cache_prefault and device.type == "cpu"
    if device.type == "cpu":
        zeros = functools.partial(lazy_zeros, huge_pages=is_prefault)  # committed whole anyway
    else:
        zeros = functools.partial(_device_zeros, device=device)
    if config.kv_cache_dtype == "int8":  # codes + scales; the kernels' store quantizes
        cache, scales = kv_int8.allocate(
            shape.num_layers, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim,
            zeros,
        )  # fmt: skip
        layer_caches = [kv_int8.Int8KVCache(cache[i], scales[i]) for i in range(shape.num_layers)]
    else:
        cache_shape = (shape.block_size, 2, shape.num_kv_heads, shape.head_dim)
        cache, scales = zeros((shape.num_layers, num_blocks, *cache_shape), dtype), None
        layer_caches = [cache[i] for i in range(shape.num_layers)]
    if is_prefault:  # commits every page now (they are zero already)
        for tensor in (cache, scales):
            if tensor is not None:
                tensor.fill_(0)
    return KVPool(cache, scales, layer_caches, num_blocks, num_blocks * bytes_per_block)


def _device_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    return torch.zeros(shape, dtype=dtype, device=device)


def attach(model: nn.Module, pool: KVPool) -> None:
    """Hand each attention layer (a module with a `kv_cache` attribute) its slice, in order."""
    attention_layers = [m for m in model.modules() if hasattr(m, "kv_cache")]
    for attention, layer_cache in zip(attention_layers, pool.layer_caches, strict=True):
        attention.kv_cache = layer_cache
