"""engine/model_config.py against transformers' AutoConfig: every attribute of transformers'
config must read the same from ours, or ours must hand the checkpoint to transformers."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from engine import loader
from engine.model_config import ModelConfig, load_config

# transformers' bookkeeping, not model values.
IGNORED = {"transformers_version", "_name_or_path", "_model_name_or_path", "output_hidden_states",
           "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
           "id2label", "label2id", "problem_type"}  # fmt: skip


def _write(tmp_path, config: dict):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _assert_same_as_transformers(path):
    ours, theirs = load_config(path), AutoConfig.from_pretrained(path)
    assert isinstance(ours, ModelConfig)
    for key in theirs.to_dict():
        if key in IGNORED:
            continue
        assert getattr(ours, key) == getattr(theirs, key), key


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
         "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 384}  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True},
        {"rope_theta": 50000.0, "torch_dtype": "bfloat16"},
        {"rope_scaling": {"type": "default", "rope_theta": 123.0}, "dtype": "float16"},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}, "eos_token_id": [2, 3]},
        {
            "rms_norm_eps": 1e-5,
            "attention_bias": True,
            "mlp_bias": True,
            "max_position_embeddings": 64,
        },
    ],
)
def test_llama_configs_match_transformers(tmp_path, extra):
    _assert_same_as_transformers(_write(tmp_path, {**LLAMA, **extra}))


@settings(max_examples=25, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "num_key_value_heads": st.sampled_from([1, 2, 4]),
            "rope_theta": st.floats(1.0, 1e6),
            "tie_word_embeddings": st.booleans(),
            "rms_norm_eps": st.floats(1e-8, 1e-3),
            "intermediate_size": st.integers(1, 512),
            "pad_token_id": st.none() | st.integers(0, 383),
        },
    )
)
def test_generated_llama_configs_match_transformers(tmp_path_factory, extra):
    _assert_same_as_transformers(_write(tmp_path_factory.mktemp("c"), {**LLAMA, **extra}))


@pytest.mark.parametrize(
    "config",
    [
        {**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
        {**LLAMA, "model_type": "qwen3"},
    ],
)  # fmt: skip
def test_others_go_through_transformers(tmp_path, config):
    ours = load_config(_write(tmp_path, config))
    assert not isinstance(ours, ModelConfig)
    assert ours.to_dict() == AutoConfig.from_pretrained(tmp_path).to_dict()


def test_tiny_model_config_matches_transformers(tiny_model_dir):
    _assert_same_as_transformers(tiny_model_dir)


@pytest.mark.real_model
def test_default_model_config_matches_transformers():
    _assert_same_as_transformers(loader.fetch_default_model(progress=False))
