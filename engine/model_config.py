"""The checkpoint's model config (config.json), without transformers where that is exact.

`AutoConfig.from_pretrained` imports transformers' model registry and, through it, sympy and
accelerate: measured on SmolLM2 (2-core Zen 4), +59 MiB of RSS on top of the ~30 MiB that
importing transformers costs, for a JSON file of 30 numbers (issue 17's memory target). For a
Llama checkpoint with default RoPE, `load_config` reads config.json itself and applies
`LlamaConfig`'s defaults and derived values (head_dim, num_key_value_heads, rope_parameters):
tests compare every attribute with transformers'. Anything else (another architecture, scaled
RoPE, remote code) goes through `AutoConfig` as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# transformers' LlamaConfig defaults (and PreTrainedConfig's for the fields the engine reads).
LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "hidden_act": "silu", "max_position_embeddings": 2048, "initializer_range": 0.02,
    "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
    "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": False,
    "rope_parameters": None, "attention_bias": False, "attention_dropout": 0.0,
    "mlp_bias": False, "head_dim": None, "architectures": None, "dtype": None,
}  # fmt: skip
DEFAULT_ROPE_THETA = 10000.0


class ModelConfig:
    """config.json's values as attributes (what the engine reads of a transformers config)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"ModelConfig({self.__dict__!r})"


def load_config(path: Path):
    """The model config of checkpoint directory `path`: a `ModelConfig` where `_llama` can
    build it exactly, else transformers' `AutoConfig`."""
    raw = json.loads((Path(path) / "config.json").read_text())
    config = _llama(raw)
    if config is not None:
        return config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _llama(raw: dict[str, Any]) -> ModelConfig | None:
    """LlamaConfig's values for a Llama config.json with default RoPE, or None for anything
    whose handling only transformers has."""
    if raw.get("model_type") != "llama" or "auto_map" in raw:
        return None
    rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})  # its priority
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or set(rope) - {"rope_type", "type", "rope_theta"}:
        return None
    values = {**LLAMA_DEFAULTS, **raw}
    for legacy in ("rope_scaling", "rope_theta", "torch_dtype"):
        values.pop(legacy, None)
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    values["rope_parameters"] = rope
    if values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    if dtype is not None:
        values["dtype"] = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        if not isinstance(values["dtype"], torch.dtype):
            return None  # "auto" or an unknown name: transformers' own handling
    return ModelConfig(values)
