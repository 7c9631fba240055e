"""Sliding-window attention on the torch reference backend: the step's metadata with masks
that also hide keys more than `window - 1` positions behind each query.

HF's rule (masking_utils.sliding_window_overlay): query position p sees key position k when
p - window < k <= p. The cache keeps every position (the window only masks), so blocks are
never freed early; what changes is the additive masks, built once per step for all the
sliding layers of a model (Gemma 2 and 3 alternate sliding and full layers).
The C++ and Triton kernels take no mask, so models with sliding layers run on this backend.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.kernels.attention_types import (
    AttentionMetadata,
    PrefillChunk,
    additive_mask,
    decode_mask,
)


def full_attention_metadata(
    meta: AttentionMetadata, block_size: int, dtype: torch.dtype
) -> AttentionMetadata:
    """`meta` with the decode mask the torch backend reads (the runner builds it only for a
    backend that asks; a model that falls back to this backend may not have it)."""
    if not meta.num_decodes or meta.decode_mask is not None:
        return meta
    width = meta.decode_block_table.shape[1] * block_size
    mask = decode_mask(meta.decode_context_lens, width, dtype)
    return dataclasses.replace(meta, decode_mask=mask)


def sliding_window_metadata(
    meta: AttentionMetadata, window: int, block_size: int, dtype: torch.dtype
) -> AttentionMetadata:
    """A copy of `meta` whose decode mask and prefill masks apply the window."""
    windowed = dataclasses.replace(meta, prefills=[_chunk(c, window, dtype) for c in meta.prefills])
    if meta.num_decodes:
        lens = meta.decode_context_lens  # [num_decodes]; the query sits at position len - 1
        keys = torch.arange(meta.decode_block_table.shape[1] * block_size)[None, :]
        allowed = (keys < lens[:, None]) & (keys > lens[:, None] - 1 - window)
        windowed.decode_mask = additive_mask(allowed, dtype)[:, None, None]  # [rows, 1, 1, ctx]
    return windowed


def _chunk(chunk: PrefillChunk, window: int, dtype: torch.dtype) -> PrefillChunk:
    """The chunk's [num_tokens, start + num_tokens] mask, causal and windowed."""
    queries = torch.arange(chunk.num_tokens)[:, None] + chunk.start_position
    keys = torch.arange(chunk.start_position + chunk.num_tokens)[None, :]
    allowed = (keys <= queries) & (keys > queries - window)
    return dataclasses.replace(chunk, mask=additive_mask(allowed, dtype), causal=False)
