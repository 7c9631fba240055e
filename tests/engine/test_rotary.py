"""Rotary tables against Hugging Face's LlamaRotaryEmbedding, bit for bit, for the static rope
types the engine computes itself (instead of importing HF's modeling stack); and the engine's
model code does not import that stack (it cost every worker 167 MiB of RSS)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig

from engine.layers.rotary import RotaryEmbedding

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 100000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    },  # fmt: skip
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 64},  # fmt: skip
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_tables_equal_hf(rope, dtype):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=512,
                         rope_parameters=ROPES[rope])  # fmt: skip
    ours = RotaryEmbedding(config, head_dim=64, max_position=512, dtype=dtype)
    positions = torch.arange(512)
    cos, sin = LlamaRotaryEmbedding(config)(torch.empty(0, dtype=dtype), positions[None, :])
    assert torch.equal(ours.cos_table, cos[0])
    half = 32
    assert torch.equal(ours.sin_table[:, half:], sin[0, :, half:])
    assert torch.equal(ours.sin_table[:, :half], -sin[0, :, :half])


def test_model_code_does_not_import_hf_modeling():
    code = (
        "import sys, engine.models.llama, engine.model_runner; "
        "print('transformers.models.llama.modeling_llama' in sys.modules, 'sympy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
