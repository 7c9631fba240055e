"""Rotary position embeddings, computed by Hugging Face's own rope code.

The inverse frequencies and attention scaling come from transformers' rope functions for the
config (`ROPE_INIT_FUNCTIONS`, and the three-line default formula of its Llama rotary class),
so every `rope_parameters` type (default, linear, llama3, yarn, dynamic, longrope...) gives
HF's numbers; the cos/sin arithmetic is HF's, step for step (tests/engine/test_rotary.py
checks the tables bit for bit against HF's module). Static types are tabulated once per
position; "dynamic" and "longrope" change their frequencies with the longest position in a
forward pass, so for those HF's module is called on each step's positions (the same batch
dependence HF itself has).

Why not HF's module for every type: importing transformers' Llama modeling code pulls in its
whole modeling stack (torch._dynamo, sympy, Triton, accelerate: 1,300 modules and +167 MiB of
RSS in every worker, measured on the 2-core Zen 4 VM), for three lines of arithmetic. It is
imported only for the two dynamic types.
"""

from __future__ import annotations

import torch
from torch import nn

_SEQ_LEN_DEPENDENT = ("dynamic", "longrope")


class _StaticRope:
    """HF's LlamaRotaryEmbedding for the rope types whose frequencies do not depend on the
    positions in the batch: the same inverse frequencies, scaling and forward arithmetic."""

    def __init__(self, hf_config):
        self.rope_type = hf_config.rope_parameters["rope_type"]
        if self.rope_type == "default":
            base = hf_config.rope_parameters["rope_theta"]
            dim = getattr(hf_config, "head_dim", None) or (
                hf_config.hidden_size // hf_config.num_attention_heads
            )
            self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:  # transformers only here: importing it costs ~30 MiB of RSS (issue 17)
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            self.inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](hf_config)

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _make_rope(hf_config):
    if hf_config.rope_parameters["rope_type"] in _SEQ_LEN_DEPENDENT:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding(hf_config)
    return _StaticRope(hf_config)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_position: int, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.hf_rope = _make_rope(hf_config)
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
        heads), computed once per step for all layers; applied by `ops.rotary_`
        (engine/layers/ops.py)."""
        if self.is_seq_len_dependent:
            cos, sin = self._compute(positions)
        else:
            cos, sin = self.cos_table[positions], self.sin_table[positions]
        return cos.unsqueeze(1), sin.unsqueeze(1)
