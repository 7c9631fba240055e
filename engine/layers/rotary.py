"""Rotary position embeddings, computed by Hugging Face's own rope code.

The inverse frequencies and attention scaling come from transformers' rotary class for the
config, so every `rope_parameters` type (default, linear, llama3, yarn, dynamic, longrope...)
gives HF's numbers. Static types are tabulated once per position; "dynamic" and "longrope"
change their frequencies with the longest position in a forward pass, so for those HF's module
is called on each step's positions (the same batch dependence HF itself has).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

_SEQ_LEN_DEPENDENT = ("dynamic", "longrope")


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_position: int, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.hf_rope = LlamaRotaryEmbedding(hf_config)
        if self.hf_rope.inv_freq.numel() * 2 != head_dim:
            raise ValueError("partial rotary embeddings are not supported")
        self.is_seq_len_dependent = self.hf_rope.rope_type in _SEQ_LEN_DEPENDENT
        self.cos_table: torch.Tensor | None = None
        self.sin_table: torch.Tensor | None = None
        if not self.is_seq_len_dependent:
            # [max_position, head_dim // 2]: HF's cos/sin are cat(freqs, freqs); half suffices.
            self.cos_table, self.sin_table = self._compute(torch.arange(max_position))

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(0, dtype=self.dtype)
        cos, sin = self.hf_rope(probe, positions[None, :])  # [1, n, head_dim]
        half = cos.shape[-1] // 2
        return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> cos, sin [num_tokens, 1, head_dim // 2] (broadcast over heads)."""
        if self.is_seq_len_dependent:
            cos, sin = self._compute(positions)
        else:
            cos, sin = self.cos_table[positions], self.sin_table[positions]
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by cos/sin [num_tokens, 1, head_dim // 2].

    Same arithmetic as HF's `q * cos + rotate_half(q) * sin`, so fp32 results are bit-identical.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
