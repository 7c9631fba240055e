"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a flattened token batch.

Module and parameter names follow the Hugging Face checkpoint keys, so loading is a name match;
the one exception is the fused projections listed in `packed_modules_mapping` (q/k/v -> qkv_proj,
gate/up -> gate_up_proj), which the loader copies shard by shard.

Every step is one flat batch of all scheduled tokens of all requests: embeddings, projections,
norms and the MLP see [num_tokens, hidden], so 32 decodes make one [32, hidden] GEMM per
projection. Only attention knows which tokens belong to which request (via AttentionMetadata).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.attention_types import AttentionMetadata
from engine.layers.attention import TorchPagedAttention
from engine.layers.linear import make_linear, make_merged_linear
from engine.layers.norm import RMSNorm
from engine.layers.ops import TORCH_OPS, PointwiseOps
from engine.layers.rotary import RotaryEmbedding


def head_dim_of(hf_config) -> int:
    return (
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )


def _layer_quant(quant, name: str):
    """The quantization of one projection (engine/quant/config.py: QuantConfig.for_layer)."""
    return quant.for_layer(name) if quant is not None else None


class LlamaAttention(nn.Module):
    def __init__(
        self, hf_config, qkv_bias: bool, o_bias: bool, backend, dtype: torch.dtype, quant=None
    ):
        super().__init__()
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = head_dim_of(hf_config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = make_merged_linear(
            hf_config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, qkv_bias, dtype,
            _layer_quant(quant, "qkv_proj"),
        )  # fmt: skip
        self.o_proj = make_linear(
            q_size, hf_config.hidden_size, o_bias, dtype, _layer_quant(quant, "o_proj")
        )
        self.backend = backend
        # This layer's view of the runner's pool: [num_kv_blocks, block_size, 2, kv, head_dim].
        self.kv_cache: torch.Tensor | None = None
        self.ops: PointwiseOps = TORCH_OPS  # RoPE's implementation (engine/layers/ops.py)

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        heads = qkv.view(num_tokens, -1, self.head_dim)
        # q and k are rotated together and in place, leaving k next to v for the cache write.
        self.ops.rotary_(heads[:, : self.num_heads + self.num_kv_heads], cos, sin)
        q = heads[:, : self.num_heads]
        kv = heads[:, self.num_heads :].view(num_tokens, 2, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, kv, self.kv_cache, meta)
        return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, hf_config, dtype: torch.dtype, quant=None):
        super().__init__()
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r}; only 'silu'")
        bias = bool(getattr(hf_config, "mlp_bias", False))
        size = hf_config.intermediate_size
        self.gate_up_proj = make_merged_linear(
            hf_config.hidden_size, {"gate": size, "up": size}, bias, dtype,
            _layer_quant(quant, "gate_up_proj"),
        )  # fmt: skip
        self.down_proj = make_linear(
            size, hf_config.hidden_size, bias, dtype, _layer_quant(quant, "down_proj")
        )
        self.intermediate_size = size
        self.ops: PointwiseOps = TORCH_OPS  # SiLU * up's implementation (engine/layers/ops.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, 2 * intermediate] (gate, then up) -> [num_tokens, intermediate]
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention  # a family's own attention layer (engine/models/qwen3.py)

    def __init__(
        self, hf_config, qkv_bias: bool, o_bias: bool, backend, dtype: torch.dtype, quant=None
    ):
        super().__init__()
        self.self_attn = self.attention_class(hf_config, qkv_bias, o_bias, backend, dtype, quant)
        self.mlp = LlamaMLP(hf_config, dtype, quant)
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)

    def forward(self, x, residual, cos, sin, meta):
        # The residual stream is carried separately so each norm fuses the preceding add.
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    layer_class = LlamaDecoderLayer

    def __init__(self, hf_config, qkv_bias, o_bias, backend, max_position: int, dtype, quant=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(
            hf_config.vocab_size,
            hf_config.hidden_size,
            dtype=dtype,
            _freeze=True,
            _weight=torch.empty(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype),
        )
        self.layers = nn.ModuleList(
            self.layer_class(hf_config, qkv_bias, o_bias, backend, dtype, quant)
            for _ in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(hf_config, head_dim_of(hf_config), max_position, dtype)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        cos, sin = self.rotary_emb(positions)  # shared by all layers
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    model_class = LlamaModel
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(
        self,
        hf_config,
        dtype: torch.dtype,
        max_position: int,
        backend: TorchPagedAttention,
        quant=None,  # engine.quant.QuantConfig or None
    ):
        super().__init__()
        qkv_bias, o_bias = self.attention_biases(hf_config)
        self.model = self.model_class(
            hf_config, qkv_bias, o_bias, backend, max_position, dtype, quant
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        head_quant = quant.lm_head_config() if quant is not None else None
        self.lm_head = make_linear(
            hf_config.hidden_size, hf_config.vocab_size, False, dtype, head_quant
        )
        # A quantized lm_head holds its own codes; the loader quantizes them from the tied
        # embedding table (engine/loader.py).
        if self.tie_word_embeddings and head_quant is None:
            # Shared, not copied: the untouched empty buffer is freed here.
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def attention_biases(hf_config) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias) as the HF class builds them."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden] -> logits [num_rows, vocab] in the model dtype (greedy
        sampling needs no float32 copy of them)."""
        return self.lm_head(hidden)


class MistralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(hf_config) -> tuple[bool, bool]:
        return False, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(hf_config) -> tuple[bool, bool]:
        return True, False
