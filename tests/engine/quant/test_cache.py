"""The quantized cache: written at first load, used at the next, rebuilt when it is corrupt,
partial or stale, never used then."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from engine.layers.attention import TorchPagedAttention
from engine.models import get_model_class
from engine.quant import load_model_weights
from engine.quant.cache import cache_paths, quant_modules
from engine.quant.config import QuantConfig
from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("cache-llama"), seed=4)


def _load(path, quant, root):
    hf_config = AutoConfig.from_pretrained(path)
    model = get_model_class(hf_config)(
        hf_config, torch.float32, 64, TorchPagedAttention(), quant=quant
    )
    origin = load_model_weights(model, path, quant, cache_root=root, pack=False)
    state = {
        f"{name}.{key}": t.clone()
        for name, m in quant_modules(model).items()
        for key, t in m.quantized_state().items()
    }
    floats = {n: p.clone() for n, p in model.named_parameters() if p.is_floating_point()}
    return origin, state, floats


@pytest.mark.parametrize("spec", ["int8", "int4", "int4-g64", "w8a8"])
def test_quantize_save_load_gives_identical_tensors(tiny_dir, tmp_path, spec):
    quant = QuantConfig.parse(spec)
    origin, state, floats = _load(tiny_dir, quant, tmp_path)
    assert origin == "quantized"
    assert "lm_head.weight" in state  # the tied head is quantized from the embedding table
    origin2, state2, floats2 = _load(tiny_dir, quant, tmp_path)
    assert origin2 == "cache"
    assert state.keys() == state2.keys()
    assert all(torch.equal(state[k], state2[k]) for k in state)
    assert all(torch.equal(floats[k], floats2[k]) for k in floats)


def _flip_byte(path, offset_from_end=100):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    ["flip", "truncate", "no_manifest", "stale_source", "bad_manifest"],
)
def test_damaged_cache_is_rebuilt_not_used(tiny_dir, tmp_path, damage):
    quant = QuantConfig("int8")
    _, state, _ = _load(tiny_dir, quant, tmp_path)
    tensor_path, manifest_path = cache_paths(tmp_path, tiny_dir, quant)
    if damage == "flip":
        _flip_byte(tensor_path)
    elif damage == "truncate":
        tensor_path.write_bytes(tensor_path.read_bytes()[:-1000])
    elif damage == "no_manifest":
        manifest_path.unlink()
    elif damage == "stale_source":
        manifest = json.loads(manifest_path.read_text())
        manifest["source"][0][1] += 1
        manifest_path.write_text(json.dumps(manifest))
    else:
        manifest_path.write_text("{not json")
    origin, rebuilt, _ = _load(tiny_dir, quant, tmp_path)
    assert origin == "quantized"
    assert all(torch.equal(state[k], rebuilt[k]) for k in state)
    origin, _, _ = _load(tiny_dir, quant, tmp_path)
    assert origin == "cache"


def test_schemes_have_separate_cache_files(tiny_dir, tmp_path):
    paths = {cache_paths(tmp_path, tiny_dir, QuantConfig.parse(s))[0] for s in
             ("int8", "w8a8", "int4", "int4-g64")}  # fmt: skip
    assert len(paths) == 4
