"""The Hugging Face twin of a model the engine loads: the oracle every exactness test compares with."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engine.loader import gguf_source


def hf_model(path, dtype: torch.dtype = torch.float32):
    """transformers' model for `path`, in eval mode. A model the engine reads from a GGUF (the
    default one) is read by transformers from the same file, dequantized as the engine's
    unquantized path does."""
    gguf = gguf_source(Path(path))
    if gguf is not None:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def hf_greedy_continuation(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The tokens HF's greedy `generate` appends to `prompt_ids` (one unpadded sequence)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()
