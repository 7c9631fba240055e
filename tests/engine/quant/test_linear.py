"""Quantized linears: each kernel against its dequantizing reference, and a whole tiny model
quantized in the engine against Hugging Face running the dequantized weights.

Tolerances: the kernels and the reference compute the same sums of the same dequantized values
in a different order, so fp32 agrees to 1e-4 of the output scale; bf16 (the kernels round the
activations, weights and partial sums to bf16) to 2e-2.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.kernels.cpu import quant_gemm
from engine.layers.linear import Linear, make_linear, make_merged_linear
from engine.quant.config import KERNELS, QuantConfig
from engine.quant.linear import (
    W8A8_INT_MM_MIN_ROWS,
    QuantLinear,
    QuantMergedLinear,
)
from engine.quant.primitives import (
    dequantize_int4,
    dequantize_int8,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
)
from tests.hf_reference import hf_greedy_continuation
from tests.tiny_model import make_tiny_llama

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


@settings(max_examples=40, deadline=None)
@given(
    scheme=st.sampled_from(["int8", "int4", "w8a8"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    out_features=st.integers(1, 80),
    in_groups=st.integers(1, 4),
    group_size=st.sampled_from([32, 64, 128]),
    num_rows=st.sampled_from([1, 2, 7, 16, W8A8_INT_MM_MIN_ROWS, 33, 64, 300]),
    bias=st.booleans(),
    kernel=st.sampled_from(KERNELS),
    keep_torch_layout=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_dequantizing_reference(
    scheme, dtype, out_features, in_groups, group_size, num_rows, bias, kernel,
    keep_torch_layout, seed,
):  # fmt: skip
    torch.manual_seed(seed)
    in_features = in_groups * group_size
    quant = QuantConfig(scheme, group_size, kernel=kernel)
    layer = QuantLinear(in_features, out_features, bias, dtype, quant)
    layer.weight_loader(layer.weight, torch.randn(out_features, in_features), None)
    if bias:
        layer.weight_loader(layer.bias, torch.randn(out_features), None)
    x = torch.randn(num_rows, in_features).to(dtype)
    reference = layer.forward_reference(x)
    layer.pack(keep_torch_layout)
    y = layer(x)
    assert y.shape == (num_rows, out_features) and y.dtype == dtype
    assert _relative_error(y, reference) < TOLERANCE[dtype]


class _CountingExtension:
    """Stands in for the C++ extension: counts the calls, then makes them."""

    def __init__(self, extension):
        self.extension, self.calls = extension, 0

    def __getattr__(self, name):
        def call(*args):
            self.calls += 1
            return getattr(self.extension, name)(*args)

        return call


@pytest.mark.parametrize("scheme", ["int8", "int4", "w8a8"])
def test_one_layout_per_weight_the_cpp_kernel_at_every_row_count(scheme):
    """QuantConfig.kernel "auto": the C++ kernel (where it built) serves every row count and its
    layout is the only copy of the codes (w8a8 keeps the canonical codes for `_int_mm` from
    W8A8_INT_MM_MIN_ROWS rows); "torch" never loads it."""
    if quant_gemm.load() is None:
        pytest.skip("the C++ kernel did not build here (no compiler)")
    last = 300 if scheme != "w8a8" else W8A8_INT_MM_MIN_ROWS - 1
    cases = [(1, 1), (last, 1)] + ([(W8A8_INT_MM_MIN_ROWS, 0)] if scheme == "w8a8" else [])
    for rows, expected in cases:
        layer = QuantLinear(64, 24, False, torch.bfloat16, QuantConfig(scheme))
        layer.weight_loader(layer.weight, torch.randn(24, 64), None)
        layer.pack()
        assert layer.has_torch_layout is (scheme == "w8a8")
        if scheme != "w8a8":
            assert layer.weight is layer.cpp_codes or layer.weight.data_ptr() == (
                layer.cpp_codes.data_ptr()
            )
            assert not hasattr(layer, "scale") and not hasattr(layer, "scales_and_zeros")
        layer.cpp = counting = _CountingExtension(layer.cpp)
        layer(torch.randn(rows, 64).to(torch.bfloat16))
        assert counting.calls == expected, (scheme, rows)
    layer = QuantLinear(64, 24, False, torch.bfloat16, QuantConfig(scheme, kernel="torch"))
    layer.weight_loader(layer.weight, torch.randn(24, 64), None)
    layer.pack()
    assert layer.cpp is None and layer.has_torch_layout
    with pytest.raises(ValueError, match="quantized kernel"):
        QuantConfig("int8", kernel="fast")


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_error_is_within_half_a_step(group_size):
    torch.manual_seed(0)
    w = torch.randn(48, 256)
    codes, scale, minimum = quantize_int4_groupwise(w, group_size)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert scale.shape == (48, 256 // group_size)
    error = (dequantize_int4(codes, scale, minimum) - w).abs()
    half_step = scale.repeat_interleave(group_size, dim=1) / 2
    assert bool((error <= half_step * (1 + 1e-5)).all())


def test_int8_round_trip_error_is_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(40, 96)
    codes, scale = quantize_int8_per_channel(w)
    error = (dequantize_int8(codes, scale) - w).abs()
    assert bool((error <= scale[:, None] / 2 * (1 + 1e-5)).all())


def test_merged_shards_quantize_like_the_fused_weight():
    torch.manual_seed(0)
    quant = QuantConfig("int4", 32)
    shards = {"q": 32, "k": 16, "v": 16}
    merged = QuantMergedLinear(64, shards, False, torch.float32, quant)
    whole = QuantLinear(64, 64, False, torch.float32, quant)
    weights = {name: torch.randn(size, 64) for name, size in shards.items()}
    for name, w in weights.items():
        merged.weight_loader(merged.weight, w, name)
    whole.weight_loader(whole.weight, torch.cat(list(weights.values())), None)
    for key, tensor in merged.quantized_state().items():
        assert torch.equal(tensor, whole.quantized_state()[key])
    with pytest.raises(ValueError, match="unknown shard"):
        merged.weight_loader(merged.weight, weights["q"], "x")
    with pytest.raises(ValueError, match="shard 'k'"):
        merged.weight_loader(merged.weight, weights["q"], "k")


def test_seam_and_bad_input():
    assert type(make_linear(64, 32, False, torch.float32)) is Linear
    assert type(make_linear(64, 32, False, torch.float32, QuantConfig("int8"))) is QuantLinear
    merged = make_merged_linear(64, {"a": 16, "b": 16}, False, torch.float32, QuantConfig("w8a8"))
    assert type(merged) is QuantMergedLinear
    with pytest.raises(ValueError, match="divisible"):
        QuantLinear(48, 32, False, torch.float32, QuantConfig("int4", 32))
    with pytest.raises(ValueError, match="unknown quantization"):
        QuantConfig.parse("fp4")
    with pytest.raises(ValueError, match="group size"):
        QuantConfig.parse("int4-g16")
    assert QuantConfig.parse("int4-g64") == QuantConfig("int4", 64)
    assert QuantConfig.parse("INT8") == QuantConfig("int8") and QuantConfig.parse(None) is None
    assert QuantConfig.parse("int4-g64@torch") == QuantConfig("int4", 64, kernel="torch")
    with pytest.raises(ValueError, match="quantized kernel"):
        QuantConfig.parse("int8@fast")


# -- whole model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("quant-llama"), seed=3)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINI_INFER_CACHE_DIR", str(tmp_path / "cache"))


def _dequantized_hf(path, quant: QuantConfig):
    """HF's model with every projection (and an untied lm_head) replaced by what our quantized
    weights stand for: the oracle for weight-only schemes."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def fake_quant(w: torch.Tensor) -> torch.Tensor:
        if quant.scheme == "int4":
            return dequantize_int4(*quantize_int4_groupwise(w, quant.group_size))
        return dequantize_int8(*quantize_int8_per_channel(w))

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(fake_quant(module.weight))
        # lm_head is int8 weight-only under every scheme (QuantConfig.lm_head_config).
        head = dequantize_int8(*quantize_int8_per_channel(model.get_input_embeddings().weight))
        model.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
        if quant.embedding_from_head and getattr(model.config, "tie_word_embeddings", False):
            # A tied embedding is looked up in the head's codes (engine/quant/embedding.py):
            # the engine's CPU runs without the fused decode step (float32 here) do.
            model.get_input_embeddings().weight = model.lm_head.weight
    return model


@pytest.mark.parametrize("spec", ["int8", "int4", "int4-g64"])
def test_quantized_engine_greedy_equals_hf_on_dequantized_weights(tiny_dir, spec):
    quant = QuantConfig.parse(spec)
    llm = LLM(tiny_dir, dtype="float32", quantization=spec, num_kv_blocks=64)
    hf = _dequantized_hf(tiny_dir, quant)
    prompts = [[5, 9, 30, 41, 7], list(range(3, 40)), [11]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy_continuation(hf, prompt, 10)


def test_w8a8_engine_runs_both_kernels_close_to_fp32(tiny_dir):
    """w8a8 also quantizes activations, so there is no exact oracle: its logits must stay
    close to the float model's, at 1 row (weight-only kernel) and at >= 16 rows (_int_mm)."""
    float_llm = LLM(tiny_dir, num_kv_blocks=64)
    w8a8 = LLM(tiny_dir, dtype="float32", quantization="w8a8", num_kv_blocks=64)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prompts = [[3 + i, 20 + i, 7] for i in range(W8A8_INT_MM_MIN_ROWS + 2)]
    a = float_llm.generate(prompts, params)
    b = w8a8.generate(prompts, params)
    agreement = sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True)) / len(a)
    assert agreement >= 0.8
