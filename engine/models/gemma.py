"""Gemma 2 and Gemma 3 (text): a Llama-like decoder with Gemma's own arithmetic.

What differs from Llama, each as HF's modeling_gemma2.py / modeling_gemma3.py computes it:
- embeddings scaled by sqrt(hidden_size), the scale rounded to the model dtype first;
- RMSNorm weights stored as offsets from 1 (x_normed * (1 + w), the product taken in float32
  before rounding) and four norms per layer: before and after attention, before and after the
  MLP, the residual added after the post-norms;
- GeGLU: gelu(gate, tanh approximation) * up;
- attention scores scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5, and
  for Gemma 2 soft-capped (cap * tanh(s / cap)) before the mask;
- final logits soft-capped the same way (Gemma 2);
- Gemma 3: q/k RMSNorm per head (with the +1 offset) and one rope per layer type (a local
  base for sliding layers, a global one, possibly scaled, for full layers);
- layers alternate between sliding-window and full attention (`layer_types`).

Attention runs on the torch reference backend, the one that applies the sliding window and
the soft-cap (engine/layers/sliding_window.py, engine/layers/attention.py): the C++ kernels do
neither, so "auto" and "cpu" fall back to it with a warning; the Triton backend (CUDA) and the
int8 KV cache, whose kernels lack them too, are refused, and `compile="on"` runs eagerly.
"""

from __future__ import annotations

import copy

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.attention_types import AttentionMetadata
from engine.layers.attention import TorchPagedAttention
from engine.layers.linear import make_linear, make_merged_linear
from engine.layers.rotary import RotaryEmbedding
from engine.layers.sliding_window import full_attention_metadata, sliding_window_metadata
from engine.models.llama import LlamaAttention, LlamaForCausalLM, _layer_quant, head_dim_of
from engine.models.qwen3 import Qwen3Attention

log = structlog.get_logger(__name__)

SLIDING = "sliding_attention"
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


class GemmaRMSNorm(nn.Module):
    """HF's Gemma RMSNorm: float32 throughout, weight + 1, rounded to the input dtype last."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> same
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(Qwen3Attention):
    """Qwen3's per-head q/k norm, with Gemma's +1 norm."""

    qk_norm_class = GemmaRMSNorm


class GemmaMLP(nn.Module):
    def __init__(self, hf_config, dtype: torch.dtype, quant=None):
        super().__init__()
        act = getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act
        if act not in _GELU_TANH:
            raise ValueError(f"unsupported hidden_activation {act!r}; only {_GELU_TANH}")
        size = hf_config.intermediate_size
        self.gate_up_proj = make_merged_linear(
            hf_config.hidden_size, {"gate": size, "up": size}, False, dtype,
            _layer_quant(quant, "gate_up_proj"),
        )  # fmt: skip
        self.down_proj = make_linear(
            size, hf_config.hidden_size, False, dtype, _layer_quant(quant, "down_proj")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))  # 2 x [num_tokens, intermediate]
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, hf_config, layer_type: str, bias: bool, backend, dtype, quant=None):
        super().__init__()
        self.layer_type = layer_type
        attention = Gemma3Attention if _has_qk_norm(hf_config) else LlamaAttention
        self.self_attn = attention(hf_config, bias, bias, backend, dtype, quant)
        self.mlp = GemmaMLP(hf_config, dtype, quant)
        size, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, meta)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, hf_config, qkv_bias, o_bias, backend, max_position: int, dtype, quant=None):
        super().__init__()
        size = (hf_config.vocab_size, hf_config.hidden_size)
        self.embed_tokens = nn.Embedding(
            *size, dtype=dtype, _freeze=True, _weight=torch.empty(size, dtype=dtype)
        )
        self.embed_scale = hf_config.hidden_size**0.5
        self.sliding_window = getattr(hf_config, "sliding_window", None)
        layer_types = getattr(hf_config, "layer_types", None)
        layer_types = layer_types or ["full_attention"] * hf_config.num_hidden_layers
        backend = _reference_backend(backend, hf_config)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(hf_config, layer_type, qkv_bias, backend, dtype, quant)
            for layer_type in layer_types
        )
        self.norm = GemmaRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)
        head_dim = head_dim_of(hf_config)
        self.rotary = nn.ModuleDict(
            {
                name: RotaryEmbedding(_rope_config(hf_config, name), head_dim, max_position, dtype)
                for name in sorted(set(layer_types))
            }
        )

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        block_size = self.layers[0].self_attn.kv_cache.shape[1]
        metas = {"full_attention": full_attention_metadata(meta, block_size, x.dtype)}
        if self.sliding_window is not None:
            metas[SLIDING] = sliding_window_metadata(meta, self.sliding_window, block_size, x.dtype)
        ropes = {name: rope(positions) for name, rope in self.rotary.items()}  # cos, sin
        for layer in self.layers:
            layer_meta = metas[layer.layer_type if layer.layer_type in metas else "full_attention"]
            x = layer(x, *ropes[layer.layer_type], layer_meta)
        return self.norm(x)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and Gemma 3 text checkpoints: the lm_head (tied or not, float or quantized) and
    the q/k/v and gate/up fusing are Llama's."""

    model_class = GemmaModel
    supports_sliding_window = True  # the runner need not cap max_model_len at the window
    supports_compile = False  # the compiled graph's attention op has no window or soft-cap

    def __init__(self, hf_config, dtype, max_position, backend, quant=None):
        super().__init__(hf_config, dtype, max_position, backend, quant)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [num_rows, vocab]
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _has_qk_norm(hf_config) -> bool:
    return hf_config.model_type.startswith("gemma3")


def _rope_config(hf_config, layer_type: str):
    """The config as RotaryEmbedding reads it for one layer type: Gemma 3 keeps one
    rope_parameters dict per layer type, Gemma 2 one for all."""
    params = hf_config.rope_parameters
    if layer_type not in params:
        return hf_config
    config = copy.copy(hf_config)
    config.rope_parameters = params[layer_type]
    return config


def _reference_backend(backend, hf_config) -> TorchPagedAttention:
    """The torch reference backend with Gemma's score scale and soft-cap."""
    if getattr(backend, "name", "torch").endswith("int8kv"):
        raise ValueError(
            f"{hf_config.architectures[0]} needs sliding-window and soft-capped attention, which "
            "the int8 KV cache does not have; use kv_cache_dtype='auto'"
        )
    if backend.name == "triton":  # the masks and tables below are built on the CPU
        raise ValueError(
            f"{hf_config.architectures[0]} needs sliding-window and soft-capped attention, which "
            "the Triton kernels do not have; run it on the CPU (attention_backend 'auto')"
        )
    if backend.name != "torch":
        log.warning(
            "gemma.attention_fallback", requested=backend.name, using="torch",
            detail="the C++ and Triton kernels have no sliding window or soft-capping",
        )  # fmt: skip
    return TorchPagedAttention(
        scale=hf_config.query_pre_attn_scalar**-0.5,
        softcap=getattr(hf_config, "attn_logit_softcapping", None),
    )
