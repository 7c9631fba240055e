"""CPU feature detection (and MINI_INFER_MAX_ISA), dtype="auto", and the per-machine linear kernel
choice.

Every path is exercised on any x86-64 CPU by forcing it: fabricated CpuInfo for the dtype rule,
`linear_kernel="plain" | "packed" | "gemv"` for the GEMM paths, a patched oneDNN check for a CPU
without a packed path."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import engine.kernels.cpu.calibration as calibration
import engine.kernels.cpu.linear_choice as linear_choice
import engine.platform as platform
import engine.precision as precision
from engine.config import EngineConfig
from engine.kernels.cpu import bf16_gemm
from engine.layers.linear import Linear
from engine.model_runner import ModelRunner
from engine.platform import CpuInfo, has_native, parse_cpuinfo
from engine.precision import resolve_dtype
from engine.quant.config import QuantConfig
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from tests.tiny_model import make_tiny_llama

ZEN4_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx f16c fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni

processor\t: 1
model name\t: ignored second processor
flags\t\t: fpu
"""
ZEN4 = CpuInfo("zen4", frozenset(parse_cpuinfo(ZEN4_CPUINFO)[1]), "AVX512")
AVX2_ONLY = CpuInfo("haswell", frozenset({"avx", "avx2", "fma", "f16c"}), "AVX2")
SAPPHIRE = CpuInfo("spr", ZEN4.flags | {"amx_bf16", "amx_tile", "avx512_fp16"}, "AVX512")
BARE = CpuInfo("qemu", frozenset({"sse2"}), "DEFAULT")


def test_parse_cpuinfo_reads_the_first_processor():
    model_name, flags = parse_cpuinfo(ZEN4_CPUINFO)
    assert model_name == "AMD EPYC 9R14"
    assert {"avx512f", "avx512_bf16", "avx2"} <= flags
    assert "avx512_fp16" not in flags
    assert parse_cpuinfo("")[1] == frozenset()


def test_vector_isa_follows_the_flags():
    assert ZEN4.vector_isa == "avx512"
    assert AVX2_ONLY.vector_isa == "avx2"
    assert BARE.vector_isa == "portable"
    assert ZEN4.fingerprint != AVX2_ONLY.fingerprint


@pytest.mark.parametrize(
    ("info", "bf16", "fp16"),
    [(ZEN4, True, False), (AVX2_ONLY, False, False), (SAPPHIRE, True, True), (BARE, False, False)],
)
def test_native_dtypes(info, bf16, fp16):
    assert has_native(torch.float32, info)
    assert has_native(torch.bfloat16, info) is bf16
    assert has_native(torch.float16, info) is fp16


def test_this_machine_is_detected():
    info = platform.cpu_info()
    assert info.torch_capability == torch.backends.cpu.get_cpu_capability()
    assert info.vector_isa in ("avx512", "avx2", "portable")
    # oneDNN's own fp16 check and ours agree on whether fp16 can be packed.
    assert platform.can_pack_onednn(torch.float16) == bool(
        torch.ops.mkldnn._is_mkldnn_fp16_supported()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_never_raises_and_keeps_the_result(dtype):
    """On a CPU without oneDNN's fp16 path (Zen 4) pack() leaves the weight plain."""
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True, dtype=dtype)
    layer.weight.data.copy_(torch.randn(96, 64))
    layer.bias.data.copy_(torch.randn(96))
    x = torch.randn(5, 64).to(dtype)
    expected = layer(x).float()
    layer.pack()
    assert layer.is_packed == platform.can_pack_onednn(dtype)
    torch.testing.assert_close(layer(x).float(), expected, rtol=2e-2, atol=2e-2)


@pytest.fixture
def calibration_dir(tmp_path, monkeypatch):
    """An empty cache dir, on an idle machine (the load average forced: never the real one)."""
    monkeypatch.setenv("MINI_INFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    return tmp_path / "calibration"


def test_forced_choices_skip_calibration(calibration_dir, monkeypatch):
    monkeypatch.setattr(linear_choice, "calibrate_shape", pytest.fail)
    shapes = [(64, 96), (64, 96), (96, 64)]
    assert linear_choice.choose_linear_kernels(shapes, torch.float32, "plain") == {
        (64, 96): "plain", (96, 64): "plain"}  # fmt: skip
    assert set(linear_choice.choose_linear_kernels(shapes, torch.float32, "packed").values()) == {
        "packed"
    }
    assert not calibration_dir.exists()
    with pytest.raises(ValueError, match="linear_kernel"):
        linear_choice.choose_linear_kernels(shapes, torch.float32, "fast")


def test_no_packed_path_means_plain_whatever_is_asked(calibration_dir, monkeypatch):
    monkeypatch.setattr(linear_choice, "can_pack_onednn", lambda dtype: False)
    monkeypatch.setattr(linear_choice, "calibrate_shape", pytest.fail)
    for requested in ("auto", "packed", "plain"):
        choices = linear_choice.choose_linear_kernels([(64, 96)], torch.float16, requested)
        assert choices == {(64, 96): "plain"}


def test_auto_calibrates_once_and_caches_per_machine(calibration_dir, monkeypatch):
    calls = []

    def fake(in_features, out_features, dtype):
        calls.append((in_features, out_features))
        return {"choice": "packed" if out_features > 64 else "plain"}

    monkeypatch.setattr(linear_choice, "calibrate_shape", fake)
    shapes = [(64, 96), (96, 64)]
    first = linear_choice.choose_linear_kernels(shapes, torch.float32)
    assert first == {(64, 96): "packed", (96, 64): "plain"}
    assert sorted(calls) == sorted(shapes)
    saved = json.loads(linear_choice.calibration_file().read_text())
    assert linear_choice.calibration_file().parent == calibration_dir
    assert len(saved) == 2 and all(key.startswith("float32:") for key in saved)
    # A second load (another process, same machine) reads the file and measures nothing.
    monkeypatch.setattr(linear_choice, "calibrate_shape", pytest.fail)
    assert linear_choice.choose_linear_kernels(shapes, torch.float32) == first


def test_corrupt_calibration_file_is_measured_again(calibration_dir, monkeypatch):
    calibration_dir.mkdir(parents=True)
    linear_choice.calibration_file().write_text("{not json")
    monkeypatch.setattr(
        linear_choice, "calibrate_shape", lambda i, o, d: {"choice": "plain", "plain_us_m1": 1.0}
    )
    assert linear_choice.choose_linear_kernels([(8, 8)], torch.float32) == {(8, 8): "plain"}
    assert json.loads(linear_choice.calibration_file().read_text())


def test_real_calibration_measures_both_paths():
    result = linear_choice.calibrate_shape(64, 128, torch.float32)
    assert result["choice"] in ("plain", "packed")
    for rows in linear_choice.CALIBRATION_ROWS:
        assert result[f"plain_us_m{rows}"] > 0 and result[f"packed_us_m{rows}"] > 0


def _loads(monkeypatch, *values: float) -> None:
    """os.getloadavg returns `values` in turn (the last one from then on): no real load."""
    queue = list(values)
    monkeypatch.setattr(
        calibration.os, "getloadavg", lambda: (queue.pop(0) if len(queue) > 1 else queue[0],) * 3
    )


@pytest.mark.parametrize("loads", [(99.0,), (0.0, 99.0), (99.0, 0.0)])
def test_a_calibration_under_load_is_used_but_not_cached(calibration_dir, monkeypatch, loads):
    """Load above the number of cores before or after calibrating: the choice serves this
    process, nothing is written, and the next start measures again."""
    calls = []

    def fake(in_features, out_features, dtype):
        calls.append((in_features, out_features))
        return {"choice": "packed", "packed_us_m1": 1.0}

    monkeypatch.setattr(linear_choice, "calibrate_shape", fake)
    monkeypatch.setattr(calibration.os, "cpu_count", lambda: 2)
    _loads(monkeypatch, *loads)
    assert linear_choice.choose_linear_kernels([(64, 96)], torch.float32) == {(64, 96): "packed"}
    assert not linear_choice.calibration_file().exists()
    _loads(monkeypatch, 1.5)  # idle enough: measured again, and cached this time
    assert linear_choice.choose_linear_kernels([(64, 96)], torch.float32) == {(64, 96): "packed"}
    assert len(calls) == 2
    assert len(json.loads(linear_choice.calibration_file().read_text())) == 1
    monkeypatch.setattr(linear_choice, "calibrate_shape", pytest.fail)
    assert linear_choice.choose_linear_kernels([(64, 96)], torch.float32) == {(64, 96): "packed"}


def test_no_load_average_on_this_os_does_not_stop_caching(monkeypatch):
    def unavailable():
        raise OSError("getloadavg")

    monkeypatch.setattr(calibration.os, "getloadavg", unavailable)
    assert calibration.busy_reason() is None


def test_implausible_samples_are_rejected_and_not_cached(calibration_dir, monkeypatch):
    """A timer reading 0 (or NaN) for one path must not make it win, nor be cached."""
    _loads(monkeypatch, 0.0)
    real_time_us = calibration.time_us

    def time_us(call):  # the packed path's call reads torch.ops.mkldnn._linear_pointwise
        return 0.0 if "_linear_pointwise" in call.__code__.co_names else real_time_us(call)

    monkeypatch.setattr(calibration, "time_us", time_us)
    result = linear_choice.calibrate_shape(64, 128, torch.float32)
    assert result["choice"] == "plain"
    assert "packed" in result["unsure"] and "packed_us_m1" not in result
    monkeypatch.setattr(linear_choice, "calibrate_shape", lambda i, o, d: result)
    assert linear_choice.choose_linear_kernels([(64, 128)], torch.float32) == {(64, 128): "plain"}
    assert not linear_choice.calibration_file().exists()


times_us = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0.5, max_value=1e4),
)


@settings(max_examples=200, deadline=None)
@given(
    samples=st.dictionaries(
        st.sampled_from(linear_choice.CALIBRATION_ROWS),
        st.fixed_dictionaries(
            {"plain": st.lists(times_us, max_size=20), "packed": st.lists(times_us, max_size=20)}
        ),
        min_size=1,
    ),
    floor=st.floats(min_value=0.5, max_value=100.0),
)
def test_decide_keeps_only_plausible_samples(samples, floor):
    result = linear_choice.decide(samples, floor)
    assert result["choice"] in ("plain", "packed")
    for key, value in result.items():
        if key.endswith(tuple(f"_us_m{rows}" for rows in linear_choice.CALIBRATION_ROWS)):
            assert math.isfinite(value) and value >= round(floor, 1)
    too_few = any(
        sum(1 for t in times if math.isfinite(t) and t >= floor)
        < linear_choice.MIN_PLAUSIBLE_SAMPLES
        for by_path in samples.values()
        for times in by_path.values()
    )
    assert ("unsure" in result) == too_few


@pytest.fixture(scope="module")
def tiny_bf16_dir(tmp_path_factory):
    """A tiny checkpoint whose config says its weights are bfloat16."""
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny-bf16"))
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("info", "kernels_built", "expected"),
    [
        (ZEN4, False, torch.bfloat16),  # native: the kernels do not matter
        (AVX2_ONLY, False, torch.float32),  # torch's bf16 emulation is slower than fp32
        (AVX2_ONLY, True, torch.bfloat16),  # our kernels take the bf16 step
    ],
)
def test_auto_dtype_of_a_bf16_checkpoint(tiny_bf16_dir, monkeypatch, info, kernels_built, expected):
    monkeypatch.setattr(platform, "cpu_info", lambda: info)
    monkeypatch.setattr(precision, "bf16_kernels_built", lambda: kernels_built)
    runner = ModelRunner(tiny_bf16_dir, EngineConfig(num_kv_blocks=8), "auto")
    assert runner.dtype == expected and runner.kv_cache.dtype == expected


def _config(dtype):
    return types.SimpleNamespace(dtype=dtype)


@pytest.mark.parametrize("kernels_built", [False, True])
@pytest.mark.parametrize("info", [ZEN4, AVX2_ONLY, SAPPHIRE, BARE], ids=lambda i: i.model_name)
def test_auto_dtype_table(monkeypatch, info, kernels_built):
    monkeypatch.setattr(platform, "cpu_info", lambda: info)
    monkeypatch.setattr(precision, "bf16_kernels_built", lambda: kernels_built)
    fast = has_native(torch.bfloat16, info) or kernels_built
    half = torch.bfloat16 if fast else torch.float32
    int4 = QuantConfig.parse("int4")
    assert resolve_dtype("auto", _config(torch.bfloat16)) == half
    assert resolve_dtype("auto", _config("bfloat16")) == half
    assert resolve_dtype("auto", _config(torch.float16)) == (
        torch.float16 if has_native(torch.float16, info) else half
    )
    assert resolve_dtype("auto", _config(torch.float32)) == torch.float32
    assert resolve_dtype("auto", _config(None)) == torch.float32
    for checkpoint in (torch.float32, torch.float16, None):  # quantized layers: bf16 if fast
        assert resolve_dtype("auto", _config(checkpoint), int4) == half
    # On CUDA only native bf16 counts (the CPU kernels do not run there).
    native = torch.bfloat16 if has_native(torch.bfloat16, info) else torch.float32
    assert resolve_dtype("auto", _config(torch.bfloat16), device="cuda") == native
    assert resolve_dtype("float32", _config(torch.bfloat16), int4) == torch.float32


def test_portable_cpus_never_count_the_kernels(monkeypatch):
    monkeypatch.setattr(platform, "cpu_info", lambda: BARE)
    assert not precision.bf16_kernels_built()


@pytest.mark.parametrize(
    ("cap", "gone", "kept"),
    [
        (None, set(), {"avx512f", "avx512_bf16", "avx2"}),
        ("avx512", {"avx512_bf16", "avx512_vnni"}, {"avx512f", "avx512bw", "avx2", "fma"}),
        ("avx2", {"avx512f", "avx512_bf16"}, {"avx2", "fma", "f16c"}),
        ("portable", {"avx512f", "avx2", "fma", "f16c"}, {"sse2"}),
    ],
)
def test_max_isa_hides_the_flags_above_it(monkeypatch, cap, gone, kept):
    flags = ZEN4.flags | {"sse2"}
    assert not (platform.cap_flags(flags, cap) & gone)
    assert kept <= platform.cap_flags(flags, cap)
    monkeypatch.delenv(platform.MAX_ISA_ENV, raising=False)
    real = platform.cpu_info.__wrapped__().flags  # uncached: read the environment now
    if cap is not None:
        monkeypatch.setenv(platform.MAX_ISA_ENV, cap)
    seen = platform.cpu_info.__wrapped__()
    assert seen.flags == platform.cap_flags(real, cap)
    expected_isa = {"avx2": "avx2", "portable": "portable"}.get(cap)
    if expected_isa is not None:
        assert seen.vector_isa == expected_isa


def test_max_isa_rejects_unknown_names():
    with pytest.raises(ValueError, match="MINI_INFER_MAX_ISA"):
        platform.cap_flags(frozenset({"avx2"}), "sse9")


def test_resolve_dtype_rejects_auto_without_a_config_and_unknown_names():
    with pytest.raises(ValueError, match="auto"):
        resolve_dtype("auto")
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("float8")
    with pytest.raises(ValueError, match="linear_kernel"):
        EngineConfig(linear_kernel="fast")


@pytest.mark.parametrize("linear_kernel", ["plain", "packed", "gemv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_linear_path_matches_hf(tiny_model_dir, linear_kernel, dtype):
    """Each forced path (falling back to one this CPU runs: gemv -> packed -> plain) gives HF's
    logits."""
    runner = ModelRunner(
        tiny_model_dir, EngineConfig(num_kv_blocks=8, linear_kernel=linear_kernel), dtype
    )
    runnable = {
        "plain": True,
        "packed": platform.can_pack_onednn(dtype),
        "gemv": dtype == torch.bfloat16 and bf16_gemm.load() is not None,
    }
    fallbacks = {"plain": ["plain"], "packed": ["packed", "plain"], "gemv": ["gemv", "packed", "plain"]}
    expected_path = next(path for path in fallbacks[linear_kernel] if runnable[path])
    # 2 layers x (qkv, o, gate_up, down) + lm_head
    assert runner.linear_kernels[expected_path] == 9
    tokens = list(range(3, 12))
    request = ScheduledRequest(
        "r", tokens, 0, [0, 1, 2], needs_sample=True, params=SamplingParams(), seed=0
    )
    logits = runner.compute_logits(SchedulerOutput([request]))["r"]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0, -1].float()
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(logits, expected, rtol=tolerance, atol=tolerance)


def _fresh_python(code: str, **env) -> str:
    import os
    import subprocess
    import sys

    from engine.openmp import SET_BY_ENGINE_VAR

    environment = {
        k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", SET_BY_ENGINE_VAR)
    }
    result = subprocess.run(
        [sys.executable, "-c", code], env={**environment, **env}, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    return result.stdout.strip()


def test_openmp_threads_sleep_by_default_unless_told_otherwise():
    show = (
        "import os, engine.openmp as o; "
        "print(os.environ.get('OMP_WAIT_POLICY'), o.APPLIED_AT_IMPORT)"
    )
    assert _fresh_python(f"import engine; {show}") == "PASSIVE True"
    assert _fresh_python(f"import engine; {show}", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE True"
    # A spin count chosen by the user, or the opt-out: libgomp's own policy, nothing added.
    assert _fresh_python(f"import engine; {show}", GOMP_SPINCOUNT="10000") == "None True"
    assert _fresh_python(f"import engine; {show}", MINI_INFER_OMP_DEFAULTS="off") == "None True"
    # torch first: libgomp has read its environment already; nothing is set, and it says so.
    assert _fresh_python(f"import torch, engine; {show}") == "None False"


def test_environment_before_import_drops_only_what_engine_set():
    show = (
        "import engine.openmp as o; e = o.environ_before_import(); "
        "print(e.get('OMP_WAIT_POLICY'), e.get('KEEP'))"
    )
    assert _fresh_python(f"import engine; {show}", KEEP="1") == "None 1"
    assert _fresh_python(f"import engine; {show}", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE None"
    # A child of a process that imported engine inherits the value and the record of it.
    child = (
        "import os, subprocess, sys; import engine; "
        f"print(subprocess.run([sys.executable, '-c', {show!r}], env=os.environ, "
        "capture_output=True, text=True).stdout.strip())"
    )
    assert _fresh_python(child) == "None None"


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    platform._default_threads.cache_clear()
    yield
    platform._default_threads.cache_clear()
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("torch_threads", "budget", "configured", "expected"),
    [
        (4, 2, None, 2),  # a container's CPU quota below the CPUs torch counts: one per CPU
        (2, 8, None, 2),  # never raised
        (2, 1, 3, 3),  # a configured count wins
    ],
)
def test_default_threads_within_the_cpu_budget(
    monkeypatch, restore_threads, torch_threads, budget, configured, expected
):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(torch_threads)
    monkeypatch.setattr(platform, "cpu_budget", lambda: budget)
    platform.tune_process(configured)
    assert torch.get_num_threads() == expected


def test_omp_num_threads_set_by_the_user_is_left_alone(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    torch.set_num_threads(4)
    monkeypatch.setattr(platform, "cpu_budget", lambda: 1)
    platform.tune_process(None)
    assert torch.get_num_threads() == 4
