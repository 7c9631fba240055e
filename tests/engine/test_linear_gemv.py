"""The bf16 linear layer on our GEMV (engine/layers/linear.py `pack("gemv")`): results, the one
resident copy, the oneDNN path beyond GEMV_MAX_ROWS, fallbacks, and the calibrated choice.

The kernel itself is checked path by path in tests/engine/kernels/test_bf16_gemm.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.kernels.cpu.linear_choice as linear_choice
from engine.config import EngineConfig
from engine.kernels.cpu import bf16_gemm
from engine.layers.linear import Linear, MergedLinear
from engine.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    bf16_gemm.load() is None, reason="the C++ kernel did not build here (no compiler)"
)


def _layer(in_features: int, out_features: int, bias: bool, seed: int = 0) -> Linear:
    generator = torch.Generator().manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)
    layer.weight.data.copy_(torch.randn(out_features, in_features, generator=generator))
    if bias:
        layer.bias.data.copy_(torch.randn(out_features, generator=generator))
    return layer


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 80),
    in_features=st.integers(1, 200),
    out_features=st.integers(1, 70),
    bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_gemv_layer_matches_the_plain_layer(rows, in_features, out_features, bias, seed):
    """Up to the layer's limit (GEMV_MAX_ROWS, or none on a CPU without oneDNN bf16) within bf16
    rounding of torch (our kernel); beyond, bit-identical to the plain layer (oneDNN on a
    transient unpacked copy, as Hugging Face computes it)."""
    layer = _layer(in_features, out_features, bias, seed)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed + 1))
    x = x.to(torch.bfloat16)
    expected = layer(x)
    layer.pack("gemv")
    assert layer.kernel == "gemv" and layer.is_packed
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    limit = bf16_gemm.layer_max_rows()
    if limit is not None and rows > limit:
        assert torch.equal(got, expected)
    else:
        magnitude = x.float().abs() @ layer_weight(layer).float().abs().t()
        if bias:
            magnitude += layer.bias.float().abs()
        bound = 1e-5 * magnitude + 2.0**-7 * expected.float().abs() + 1e-6
        assert ((got.float() - expected.float()).abs() <= bound).all()


@pytest.mark.parametrize("onednn_bf16", [True, False])
def test_past_the_gemv_rows_a_layer_takes_onednn_only_where_it_has_bf16(monkeypatch, onednn_bf16):
    """A 40-row batch (a prefill chunk) on a gemv layer: oneDNN's F.linear on an unpacked copy
    (the plain layer's bits) where oneDNN has a bf16 GEMM, our kernel's bits where it has none
    (AVX2-only CPUs, where torch's bf16 F.linear is 4-8x slower than our kernel). The path is
    read from the unpacking it needs, not only from the bits: whether oneDNN's bf16 sums group
    differently from ours depends on the CPU (on a Zen 5 its kernel adds along K in our order)."""
    monkeypatch.setattr(bf16_gemm, "can_pack_onednn", lambda dtype: onednn_bf16)
    assert bf16_gemm.layer_max_rows() == (bf16_gemm.GEMV_MAX_ROWS if onednn_bf16 else None)
    layer = _layer(64, 16, bias=False, seed=3)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    plain = layer(x)
    layer.pack("gemv")
    unpacked = []
    real_unpack = bf16_gemm.unpack
    monkeypatch.setattr(bf16_gemm, "unpack", lambda *args: unpacked.append(args) or real_unpack(*args))
    with torch.inference_mode():
        got = layer(x)
        assert len(unpacked) == (1 if onednn_bf16 else 0)
        ours = bf16_gemm.gemm(bf16_gemm.load(), x, layer.weight, None, 16)
    assert torch.equal(got, plain if onednn_bf16 else ours)


def layer_weight(layer: Linear) -> torch.Tensor:
    return bf16_gemm.unpack(layer.weight, layer.out_features, layer.in_features)


def test_pack_keeps_one_copy_and_unpack_restores_it():
    layer = _layer(70, 50, bias=True)
    plain = layer.weight.detach().clone()
    layer.pack("gemv")
    # The only weight tensor is the packed one (padded to 16 channels and an even width).
    assert [name for name, _ in layer.named_parameters()] == ["weight", "bias"]
    assert layer.weight.shape == (4, 35, 16, 2)
    layer.pack("packed")  # already packed: nothing changes
    assert layer.kernel == "gemv"
    layer.unpack()
    assert layer.kernel == "plain" and torch.equal(layer.weight, plain)


def test_merged_layer_splits_the_gemv_output():
    layer = MergedLinear(32, {"gate": 24, "up": 24}, bias=False, dtype=torch.bfloat16)
    layer.weight.data.copy_(torch.randn(48, 32))
    x = torch.randn(3, 32).to(torch.bfloat16)
    expected = [t.clone() for t in layer.split(layer(x))]
    layer.pack("gemv")
    for got, want in zip(layer.split(layer(x)), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_is_bf16_only_and_leaves_other_weights_plain(dtype):
    layer = Linear(32, 16, bias=False, dtype=dtype)
    layer.weight.data.copy_(torch.randn(16, 32))
    layer.pack("gemv")
    assert layer.kernel == "plain" and layer.weight.shape == (16, 32)
    with pytest.raises(ValueError, match="unknown linear kernel"):
        layer.pack("fast")


def test_forcing_gemv_falls_back_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(linear_choice, "calibrate_shape", pytest.fail)
    shapes = [(64, 96)]
    assert linear_choice.choose_linear_kernels(shapes, torch.bfloat16, "gemv") == {
        (64, 96): "gemv"}  # fmt: skip
    expected = "packed" if linear_choice.can_pack_onednn(torch.float32) else "plain"
    assert linear_choice.choose_linear_kernels(shapes, torch.float32, "gemv") == {
        (64, 96): expected}  # fmt: skip
    monkeypatch.setattr(linear_choice, "can_pack_onednn", lambda dtype: False)
    assert linear_choice.choose_linear_kernels(shapes, torch.float32, "gemv") == {
        (64, 96): "plain"}  # fmt: skip


def test_real_calibration_times_every_bf16_path_at_every_bucket():
    result = linear_choice.calibrate_shape(64, 128, torch.bfloat16)
    paths = linear_choice.available_paths(torch.bfloat16)
    assert "gemv" in paths
    assert result["choice"] in paths
    for rows in linear_choice.CALIBRATION_ROWS:
        for path in paths:
            assert result[f"{path}_us_m{rows}"] > 0
    # ... and the fallback a gemv layer runs past its rows, where it has one (oneDNN bf16)
    fallback = result.get(f"fallback_us_m{linear_choice.PREFILL_ROWS}")
    assert (fallback is not None and fallback > 0) == (bf16_gemm.layer_max_rows() is not None)


def test_tied_lm_head_packs_its_own_copy_and_the_embedding_stays(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, EngineConfig(num_kv_blocks=8, linear_kernel="gemv"),
                         torch.bfloat16)  # fmt: skip
    model = runner.model
    assert runner.linear_kernels == {"plain": 0, "packed": 0, "gemv": 9}
    assert model.tie_word_embeddings  # the tiny model ties them, as SmolLM2 does
    table, head = model.model.embed_tokens.weight, model.lm_head
    assert table.shape == (head.out_features, head.in_features)  # still the plain table
    assert head.weight.data_ptr() != table.data_ptr()
    assert torch.equal(layer_weight(head), table)


def test_the_steps_shapes_take_the_gemv_whatever_one_call_measured(monkeypatch, tmp_path):
    """With "auto", the fused step's shapes take our GEMV even where the calibration chose
    oneDNN for one call (which cannot weigh what the step gains); the rest keep the
    calibration's choice; a forced path and a dtype our GEMV does not run are unchanged."""
    calibrated = []

    def calibrate(in_features, out_features, dtype):
        calibrated.append((in_features, out_features))
        return {"choice": "packed" if linear_choice.can_pack_onednn(dtype) else "plain"}

    monkeypatch.setattr(linear_choice, "calibrate_shape", calibrate)
    monkeypatch.setattr(linear_choice, "calibration_file", lambda: tmp_path / "linear.json")
    monkeypatch.setattr(linear_choice.calibration, "busy_reason", lambda: "not cached in a test")
    shapes = [(64, 96), (64, 200), (32, 64)]
    other = calibrate(0, 0, torch.bfloat16)["choice"]
    calibrated.clear()
    got = linear_choice.choose_linear_kernels(shapes, torch.bfloat16, step_shapes=[(64, 200)])
    assert got == {(64, 96): other, (64, 200): "gemv", (32, 64): other}
    assert sorted(calibrated) == sorted(shapes)  # the step's too: they decide its rows
    forced = linear_choice.choose_linear_kernels(shapes, torch.bfloat16, "plain", [(64, 200)])
    assert set(forced.values()) == {"plain"}
    fp32 = linear_choice.choose_linear_kernels(shapes, torch.float32, step_shapes=[(64, 200)])
    assert "gemv" not in fp32.values()


@settings(max_examples=60, deadline=None)
@given(ours=st.floats(1, 1e4), fallback=st.floats(1, 1e4), has_entry=st.booleans(),
       onednn_bf16=st.booleans())  # fmt: skip
def test_a_gemv_layer_runs_every_row_count_where_ours_timed_faster_than_the_fallback(
    ours, fallback, has_entry, onednn_bf16
):
    """Past 16 rows a gemv layer hands oneDNN a transient copy (HF's rounding) unless its
    shape's calibration timed our kernel at a prefill's rows no slower than that fallback;
    without oneDNN bf16, every row count."""
    rows = linear_choice.PREFILL_ROWS
    entry = {f"gemv_us_m{rows}": ours, f"fallback_us_m{rows}": fallback} if has_entry else None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bf16_gemm, "can_pack_onednn", lambda dtype: onednn_bf16)
        limit = linear_choice.gemv_max_rows(entry)
    if not onednn_bf16 or (has_entry and ours <= fallback):
        assert limit is None
    else:
        assert limit == bf16_gemm.GEMV_MAX_ROWS


@pytest.mark.parametrize("ours_faster", [True, False])
def test_a_runner_gives_each_gemv_layer_its_shapes_rows(
    monkeypatch, tmp_path, tiny_model_dir, ours_faster
):
    """The calibrated limit reaches the layers: with our kernel timed faster at 64 rows a
    40-row prefill runs it (no copy for oneDNN); slower, the layers copy their weight out."""
    rows = linear_choice.PREFILL_ROWS
    timed = {f"gemv_us_m{rows}": 1.0 if ours_faster else 3.0, f"fallback_us_m{rows}": 2.0}
    monkeypatch.setattr(
        linear_choice, "calibrate_shape", lambda *shape: {"choice": "gemv", **timed}
    )
    monkeypatch.setattr(linear_choice, "calibration_file", lambda: tmp_path / "linear.json")
    monkeypatch.setattr(linear_choice.calibration, "busy_reason", lambda: "not cached in a test")
    monkeypatch.setattr(bf16_gemm, "can_pack_onednn", lambda dtype: True)
    runner = ModelRunner(tiny_model_dir, EngineConfig(num_kv_blocks=8), torch.bfloat16,
                         quantization=None)  # fmt: skip
    layers = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.kernel == "gemv" for m in layers)
    expected = None if ours_faster else bf16_gemm.GEMV_MAX_ROWS
    assert {m._gemv_max_rows for m in layers} == {expected}
    unpacked = []
    real_unpack = bf16_gemm.unpack
    monkeypatch.setattr(bf16_gemm, "unpack", lambda *args: unpacked.append(args) or real_unpack(*args))
    layer = layers[0]
    with torch.inference_mode():
        layer(torch.randn(40, layer.in_features).to(torch.bfloat16))
    assert len(unpacked) == (0 if ours_faster else 1)


@pytest.mark.parametrize("fused_decode", ["auto", "off"])
def test_a_runner_keeps_the_lm_head_on_the_step_where_one_call_would_choose_onednn(
    monkeypatch, tmp_path, tiny_model_dir, fused_decode
):
    """As on the Zen 5, a calibration that picks oneDNN for every shape: with the fused step
    on, its projections and lm_head still take our GEMV, so the step runs the lm_head; with the
    step off, the calibration's choice stands."""
    monkeypatch.setattr(linear_choice, "calibrate_shape", lambda *shape: {"choice": "packed"})
    monkeypatch.setattr(linear_choice, "calibration_file", lambda: tmp_path / "linear.json")
    monkeypatch.setattr(linear_choice, "can_pack_onednn", lambda dtype: True)
    monkeypatch.setattr(linear_choice.calibration, "busy_reason", lambda: "not cached in a test")
    config = EngineConfig(num_kv_blocks=8, fused_decode=fused_decode)
    runner = ModelRunner(tiny_model_dir, config, torch.bfloat16, quantization=None)
    if fused_decode == "off":
        assert runner.linear_kernels == {"plain": 0, "packed": 9, "gemv": 0}
        return
    assert runner.linear_kernels == {"plain": 0, "packed": 0, "gemv": 9}
    assert runner.fused_decode is None and runner._forward.fused.has_lm_head
