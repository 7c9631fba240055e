"""Qwen3: the Llama decoder plus an RMSNorm over each head of q and k, before the rotary.

Everything else (fused q/k/v and gate/up, the residual-fused norms, GQA, tied embeddings,
`attention_bias` on all four projections) is Llama's, so only the attention layer differs;
the rest is built by LlamaModel with this layer plugged in.
"""

from __future__ import annotations

import torch

from engine.kernels.attention_types import AttentionMetadata
from engine.layers.norm import RMSNorm
from engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class Qwen3Attention(LlamaAttention):
    qk_norm_class = RMSNorm  # Gemma 3 plugs in its own (engine/models/gemma.py)

    def __init__(self, hf_config, qkv_bias, o_bias, backend, dtype: torch.dtype, quant=None):
        super().__init__(hf_config, qkv_bias, o_bias, backend, dtype, quant)
        # One weight [head_dim] shared by every head (HF's q_norm / k_norm).
        self.q_norm = self.qk_norm_class(self.head_dim, hf_config.rms_norm_eps, dtype)
        self.k_norm = self.qk_norm_class(self.head_dim, hf_config.rms_norm_eps, dtype)

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, num_heads, num_kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        heads = qkv.view(num_tokens, -1, self.head_dim)
        # Normalised in place per head ([num_tokens * heads, head_dim] rows), so k stays next
        # to v for the cache write, as in LlamaAttention.
        q, k = heads[:, :num_heads], heads[:, num_heads : num_heads + num_kv_heads]
        q.copy_(self.q_norm(q.reshape(-1, self.head_dim)).view_as(q))
        k.copy_(self.k_norm(k.reshape(-1, self.head_dim)).view_as(k))
        self.ops.rotary_(heads[:, : num_heads + num_kv_heads], cos, sin)
        kv = heads[:, num_heads:].view(num_tokens, 2, num_kv_heads, self.head_dim)
        out = self.backend.forward(heads[:, :num_heads], kv, self.kv_cache, meta)
        return self.o_proj(out.view(num_tokens, num_heads * self.head_dim))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model
