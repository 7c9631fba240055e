"""What attention reads each step, as plain data: the step's metadata and the int8 cache type.

These sit below both the attention backends (engine/layers) and the kernels (engine/kernels), so
a kernel adapter can take them without importing the layers that call it: nothing under
engine/kernels imports from engine/layers or engine/quant (tests/engine/kernels/test_kernel_imports.py).
Torch only; no kernel, no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    """One multi-token chunk of a request, tokens [token_start, token_start + num_tokens) of the
    flattened batch, at positions [start_position, start_position + num_tokens)."""

    token_start: int
    num_tokens: int
    start_position: int
    # [num_blocks] blocks covering positions [0, start_position + num_tokens); None when
    # start_position == 0, where the chunk attends to its own fresh K/V with a plain causal mask.
    block_ids: torch.Tensor | None = None
    # [num_tokens, start_position + num_tokens], 0 = may attend, -inf = may not; None when
    # a plain causal mask suffices.
    mask: torch.Tensor | None = None
    # The mask is the plain causal one after the cached tokens (every cached position, then the
    # chunk's own causally), as engine/step_batch.py builds it; False for any other (a window).
    causal: bool = False

    @property
    def causal_prefix(self) -> int:
        """The cached tokens before the chunk where its mask is the plain causal one (the part
        attention may take with no mask at all); 0 where it is not, or nothing is cached."""
        return self.start_position if self.causal else 0


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once per step by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot written by each new token
    num_decodes: int = 0  # the first num_decodes tokens are single-token requests
    decode_block_table: torch.Tensor | None = None  # [num_decodes, max_num_blocks] int64
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64, >= 1
    # [num_decodes, 1, 1, max_num_blocks * block_size] additive (0 / -inf), model dtype; built
    # only for backends that ask for it (`needs_decode_mask`)
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


@dataclass
class Int8KVCache:
    """One layer's view of the int8 pool (engine/quant/kv_int8.py)."""

    codes: torch.Tensor  # [num_kv_blocks, block_size, 2, num_kv_heads, head_dim] int8
    scales: torch.Tensor  # [num_kv_blocks, block_size, 2, num_kv_heads] float32


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (True = may attend) -> 0 / -inf in `dtype`, what SDPA adds to the scores."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def causal_chunk_mask(start_position: int, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """The plain causal mask of a chunk after `start_position` cached tokens: [num_tokens,
    start_position + num_tokens], every cached position allowed, the chunk's own causally."""
    num_ctx = start_position + num_tokens
    allowed = torch.arange(num_ctx)[None, :] <= torch.arange(start_position, num_ctx)[:, None]
    return additive_mask(allowed, dtype)


def decode_mask(context_lens: torch.Tensor, max_context: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_decodes] lengths -> additive mask [num_decodes, 1, 1, max_context] (0 where a key
    position is inside the context, -inf past it), broadcast over KV heads and query rows."""
    allowed = torch.arange(max_context)[None, :] < context_lens[:, None]
    return additive_mask(allowed, dtype)[:, None, None]
