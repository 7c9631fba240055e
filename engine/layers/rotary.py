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
            # [max_position, head_dim], in the model dtype like HF's
            self.cos_table, self.sin_table = self._compute(torch.arange(max_position))

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's cos, and its sin with the first half negated: rotate_half(x) * sin is then
        roll(x, head_dim // 2) * signed_sin, one op fewer per layer."""
        probe = torch.empty(0, dtype=self.dtype)
        cos, sin = self.hf_rope(probe, positions[None, :])  # [1, n, head_dim] each
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        return cos[0].contiguous(), signed_sin

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> cos, signed sin [num_tokens, 1, head_dim] (broadcast over
        heads), computed once per step for all layers."""
        if self.is_seq_len_dependent:
            cos, sin = self._compute(positions)
        else:
            cos, sin = self.cos_table[positions], self.sin_table[positions]
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] in place (x may be a view into the fused
    q/k/v projection output); cos/signed_sin [num_tokens, 1, head_dim] from forward().

    HF computes x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1); here
    roll(x) = cat(x2, x1) meets the negated first half of sin instead. (-a) * b == -(a * b)
    exactly, so fp32 and bf16 results are bit-identical to HF's. On CUDA one Triton kernel
    does the same arithmetic with the same roundings.
    """
    if x.is_cuda:
        from engine.kernels.triton.pointwise import rotary_

        return rotary_(x, cos, signed_sin)
    rotated = x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
    if torch.compiler.is_compiling():  # dynamo has no out= into a strided view; Inductor fuses
        return x.copy_(x * cos + rotated)  # the copy into the same single loop anyway
    return torch.add(x * cos, rotated, out=x)
