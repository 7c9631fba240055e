"""QuantConfig per projection: under w8a8 the projections in `w8a8_weight_only` (qkv_proj by
default: the smallest change that brought w8a8's perplexity within its +3% budget) quantize
only their weights; "w8a8-all" quantizes every projection's activations."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.quant.config import QuantConfig

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def test_for_layer():
    w8a8 = QuantConfig.parse("w8a8")
    assert w8a8.for_layer("qkv_proj").scheme == "int8"
    assert [w8a8.for_layer(n).scheme for n in PROJECTIONS[1:]] == ["w8a8"] * 3
    every = QuantConfig.parse("w8a8-all@torch")
    assert every.kernel == "torch" and every.w8a8_weight_only == ()
    assert {every.for_layer(n).scheme for n in PROJECTIONS} == {"w8a8"}
    int4 = QuantConfig.parse("int4")
    assert all(int4.for_layer(n) is int4 for n in PROJECTIONS)


@pytest.mark.parametrize("spec", ["w8a8", "w8a8-all"])
def test_model_layers_follow_for_layer(tiny_model_dir, spec):
    llm = LLM(str(tiny_model_dir), dtype="bfloat16", quantization=spec)
    layer = llm.engine.runner.model.model.layers[0]
    schemes = {
        "qkv_proj": layer.self_attn.qkv_proj.scheme,
        "o_proj": layer.self_attn.o_proj.scheme,
        "gate_up_proj": layer.mlp.gate_up_proj.scheme,
        "down_proj": layer.mlp.down_proj.scheme,
    }
    expected = QuantConfig.parse(spec)
    assert schemes == {n: expected.for_layer(n).scheme for n in PROJECTIONS}
