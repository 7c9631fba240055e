"""Checkpoints that store fused projections whole (Phi-3's qkv_proj, gate_up_proj) load split
shard by shard; a fused tensor of the wrong size is a clear error, not a silent mis-slice."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM
from engine.loader import load_weights
from engine.models.phi3 import Phi3ForCausalLM
from tests.tiny_archs import make_tiny_family


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return make_tiny_family(tmp_path_factory.mktemp("phi3"), "phi3", max_position_embeddings=64)


def test_fused_tensors_land_in_their_shards(phi3_dir):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from engine.layers.attention import TorchPagedAttention

    model = Phi3ForCausalLM(AutoConfig.from_pretrained(phi3_dir), torch.float32, 64,
                            TorchPagedAttention())  # fmt: skip
    load_weights(model, phi3_dir)
    state = load_file(str(phi3_dir / "model.safetensors"))
    for key in (
        "model.layers.1.self_attn.qkv_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
    ):
        assert torch.equal(model.get_parameter(key), state[key])


def test_a_fused_tensor_of_the_wrong_size_is_refused(phi3_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in phi3_dir.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    config["num_key_value_heads"] = 1  # the engine now expects 96 qkv rows; the file has 128
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"qkv_proj.weight: checkpoint has 128 rows"):
        LLM(broken, dtype="float32", num_kv_blocks=8)
