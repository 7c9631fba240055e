"""The benchmark model's GGUF holds the same tensors as its checkpoint: a tiny config written
by loadtest/make_bench_model.py's writer and read back by transformers' GGUF loader (which
undoes llama.cpp's q/k permutation) gives the original weights."""

from __future__ import annotations

import pytest
import torch

from loadtest import make_bench_model

pytestmark = pytest.mark.real_model  # the tokenizer metadata comes from SmolLM2's GGUF

TINY = {**make_bench_model.CONFIG, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 49152}  # fmt: skip


def test_gguf_round_trips_to_the_same_tensors(tmp_path):
    from transformers import AutoModelForCausalLM

    from engine.loader import DEFAULT_MODEL_GGUF, fetch_default_model

    tensors = make_bench_model.make_tensors(TINY, seed=3)
    path = tmp_path / "tiny-F16.gguf"
    make_bench_model.write_gguf(path, tensors, TINY, fetch_default_model() / DEFAULT_MODEL_GGUF)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                 dtype=torch.float32)  # fmt: skip
    assert model.config.num_key_value_heads == 2 and model.config.tie_word_embeddings
    state = model.state_dict()
    for name, tensor in tensors.items():
        # bf16 -> f16 is exact for normal f16 values; N(0, 0.02) has a few below f16's normal
        # range (6e-5), which keep an absolute error under 2^-24.
        torch.testing.assert_close(state[name], tensor.float(), rtol=0, atol=2**-24,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip
