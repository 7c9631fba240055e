"""`TritonPagedAttention`: the attention backend interface (`forward(q, kv, kv_cache, meta)`,
as TorchPagedAttention) over the Triton kernels.

A step is three launches at most: the KV store, one decode launch for every single-token
request (plus its split reduction), one prefill launch for every multi-token chunk. With the
int8 KV cache (`Int8KVCache`, engine/quant/kv_int8.py; the type in attention_types.py) the store quantizes and the attention
kernels dequantize as they read: the same launches, half the bytes of bf16.

The kernels take plain tensors (block tables, context lengths, chunk offsets); this adapter
derives them from AttentionMetadata once per step (every layer sees the same `meta` object,
so the derived tensors are cached on its identity). Two of them the runner could hand over
directly instead: per-decode context lengths (`meta.decode_context_lens` is used when set;
otherwise they are counted from the additive decode mask, one small reduction per step), and
a padded prefill block table (chunks without a cached prefix carry no block ids, so their
blocks are read back from the slot mapping).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.attention_types import AttentionMetadata, Int8KVCache
from engine.kernels.triton import require_usable
from engine.kernels.triton.attention import paged_decode_attention, paged_prefill_attention
from engine.kernels.triton.kv_store import store_kv, store_kv_int8


@dataclass
class _StepTensors:
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64
    prefill_block_tables: torch.Tensor | None  # [num_chunks, max_num_blocks] int64
    cu_seqlens: torch.Tensor | None  # [num_chunks + 1], offsets into q[num_decodes:]
    prefix_lens: torch.Tensor | None  # [num_chunks]
    max_chunk_len: int


def step_tensors(meta: AttentionMetadata, block_size: int, device: torch.device) -> _StepTensors:
    """The kernels' plain-tensor view of one step's metadata."""
    context_lens = meta.decode_context_lens
    if meta.num_decodes and context_lens is None:
        # The mask is 0 where a key may be attended, -inf elsewhere: the count is the length.
        context_lens = (meta.decode_mask.view(meta.num_decodes, -1) == 0).sum(-1)
    tables = cu_seqlens = prefix_lens = None
    max_chunk_len = 0
    if meta.prefills:
        rows, offsets, prefixes = [], [0], []
        for chunk in meta.prefills:
            if chunk.block_ids is not None:
                rows.append(chunk.block_ids)
            else:  # positions 0..n-1: block k holds position k * block_size
                span = slice(chunk.token_start, chunk.token_start + chunk.num_tokens, block_size)
                rows.append(meta.slot_mapping[span] // block_size)
            offsets.append(offsets[-1] + chunk.num_tokens)
            prefixes.append(chunk.start_position)
            max_chunk_len = max(max_chunk_len, chunk.num_tokens)
        tables = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(device)
        cu_seqlens = torch.tensor(offsets, dtype=torch.int64).to(device)
        prefix_lens = torch.tensor(prefixes, dtype=torch.int64).to(device)
    return _StepTensors(context_lens, tables, cu_seqlens, prefix_lens, max_chunk_len)


class TritonPagedAttention:
    """Paged attention through the Triton kernels (CUDA, or the interpreter on CPU)."""

    name = "triton"
    needs_decode_mask = False  # reads meta.decode_context_lens, which the runner always fills

    def __init__(self) -> None:
        require_usable()
        self._meta: AttentionMetadata | None = None
        self._step: _StepTensors | None = None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], already rotated
        kv: torch.Tensor,  # [num_tokens, 2, num_kv_heads, head_dim] new K (rotated) and V
        kv_cache: torch.Tensor | Int8KVCache,  # [num_kv_blocks, block_size, 2, KVH, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        kv_scales = None
        if isinstance(kv_cache, Int8KVCache):  # quantized on store, dequantized as read
            kv_cache, kv_scales = kv_cache.codes, kv_cache.scales
            store_kv_int8(kv, kv_cache, kv_scales, meta.slot_mapping)
        else:
            store_kv(kv, kv_cache, meta.slot_mapping)
        if meta is not self._meta:
            self._meta, self._step = meta, step_tensors(meta, kv_cache.shape[1], q.device)
        step = self._step
        scale = q.shape[-1] ** -0.5
        num_decodes = meta.num_decodes
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if num_decodes:
            paged_decode_attention(
                q[:num_decodes], kv_cache, meta.decode_block_table, step.decode_context_lens,
                scale, out=out[:num_decodes], kv_scales=kv_scales,
            )  # fmt: skip
        if meta.prefills:
            paged_prefill_attention(
                q[num_decodes:], kv_cache, step.prefill_block_tables, step.cu_seqlens,
                step.prefix_lens, step.max_chunk_len, scale, out=out[num_decodes:],
                kv_scales=kv_scales,
            )  # fmt: skip
        return out
