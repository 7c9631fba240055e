"""Tiny random checkpoints of the non-Llama families (Qwen3, Phi-3, Gemma 2/3), written by HF's
own classes, for the oracle tests: same tokenizer and sharpened weights as tests/tiny_model.py."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.tiny_model import make_tokenizer

# Per model_type: what makes the tiny config exercise the family's own features.
_FAMILY_OPTIONS: dict[str, dict] = {
    "qwen3": dict(head_dim=32),  # head_dim != hidden / heads, as in the real Qwen3 models
    "phi3": dict(),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8),
    "gemma3_text": dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={  # a local rope for sliding layers, a scaled global one for full ones
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        },
    ),  # fmt: skip
}


def make_tiny_family(
    path: Path,
    model_type: str,
    *,
    seed: int = 0,
    vocab_size: int = 384,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    **config_overrides,
) -> Path:
    """Write a random `model_type` checkpoint + tokenizer to `path` and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab_size)
    options = {**_FAMILY_OPTIONS.get(model_type, {}), **config_overrides}
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **options,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Random init gives near-uniform logits; sharpen them so greedy argmax is far from ties.
    # Norm weights move too (HF initialises them to 1, or 0 where the norm adds 1 itself), so a
    # norm that ignored its weight would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
