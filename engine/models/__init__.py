"""Architecture registry: Hugging Face `architectures` names -> our model classes.

Entries are (module, class) strings so that checking whether a checkpoint is supported (the
loader does it before converting or loading anything) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("engine.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("engine.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("engine.models.qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("engine.models.phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("engine.models.gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("engine.models.gemma", "GemmaForCausalLM"),
}

# Checkpoints without `architectures` fall back on `model_type`.
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def resolve_architecture(config: Any) -> str:
    """The registry name for a HF config (object or config.json dict); ValueError if unsupported."""
    architectures = list(_get(config, "architectures") or [])
    for name in architectures:
        if name in _MODELS:
            return name
    model_type = _get(config, "model_type")
    if not architectures and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    found = ", ".join(architectures) or f"model_type={model_type!r}"
    raise ValueError(
        f"unsupported model architecture {found}; supported: {', '.join(supported_architectures())}"
    )


def get_model_class(config: Any) -> type:
    module_name, class_name = _MODELS[resolve_architecture(config)]
    return getattr(importlib.import_module(module_name), class_name)
