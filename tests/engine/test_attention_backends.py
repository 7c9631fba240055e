"""The attention-backend resolver (engine/attention_backends.py), decision by decision: device x
KV cache dtype x requested x compile, with the machine's abilities (the C++ kernels built, Triton
usable) forced both ways, so every row is decided here whatever this machine has."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine import attention_backends
from engine.attention_backends import (
    create_attention_backend,
    resolve_attention_backend,
)
from engine.config import EngineConfig

NO_TRITON = "attention_backend='triton' needs a CUDA GPU; ... TRITON_INTERPRET=1"
ERROR = "error"

# (device, kv dtype, requested, C++ kernels built, Triton usable) -> backend name, or ERROR
TABLE = {
    ("cpu", "auto", "auto", True, False): "cpu",
    ("cpu", "auto", "auto", False, False): "torch",  # the one fallback, logged with its reason
    ("cpu", "int8", "auto", True, False): "cpu-int8kv",
    ("cpu", "int8", "auto", False, False): "torch-int8kv",
    ("cpu", "auto", "cpu", True, False): "cpu",
    ("cpu", "auto", "cpu", False, False): ERROR,  # asked for: never a silent substitute
    ("cpu", "int8", "cpu", True, False): "cpu-int8kv",
    ("cpu", "int8", "cpu", False, False): ERROR,
    ("cpu", "auto", "torch", True, False): "torch",
    ("cpu", "int8", "torch", True, False): "torch-int8kv",
    ("cpu", "auto", "triton", True, True): "triton",  # the interpreter
    ("cpu", "int8", "triton", True, True): "triton",  # quantizes on store itself
    ("cpu", "auto", "triton", True, False): ERROR,
    ("cuda", "auto", "auto", True, True): "triton",
    ("cuda", "int8", "auto", False, True): "triton",
    ("cuda", "auto", "auto", True, False): ERROR,
    ("cuda", "auto", "triton", True, True): "triton",
    ("cuda", "int8", "triton", True, False): ERROR,
    ("cuda", "auto", "torch", True, True): "torch",
    ("cuda", "int8", "torch", True, True): "torch-int8kv",
    ("cuda", "auto", "cpu", True, True): ERROR,  # the C++ kernels read host memory
    ("cuda", "int8", "cpu", True, True): ERROR,
}


@pytest.fixture
def machine(monkeypatch):
    """force(has_cpu_kernels, is_triton_usable): what the resolver sees of this machine."""

    def force(has_cpu_kernels: bool, is_triton_usable: bool) -> None:
        monkeypatch.setattr(attention_backends, "cpu_kernels_available", lambda: has_cpu_kernels)
        problem = None if is_triton_usable else NO_TRITON
        monkeypatch.setattr(attention_backends, "triton_unusable_reason", lambda: problem)

    return force


@pytest.mark.parametrize(
    ("case", "compile"), list(itertools.product(TABLE, (False, True))),
    ids=lambda value: "-".join(map(str, value)) if isinstance(value, tuple) else f"compile={value}",
)  # fmt: skip
def test_resolver_table(machine, case, compile):
    device, kv_dtype, requested, has_cpu_kernels, is_triton_usable = case
    machine(has_cpu_kernels, is_triton_usable)
    expected = ERROR if compile and device == "cuda" else TABLE[case]
    if expected == ERROR:
        with pytest.raises((ValueError, RuntimeError)) as error:
            resolve_attention_backend(device, kv_dtype, requested, compile)
        assert requested in str(error.value) or "triton" in str(error.value) or compile
        return
    choice = resolve_attention_backend(device, kv_dtype, requested, compile)
    assert choice.name == expected
    assert choice.is_fallback == (requested == "auto" and expected.startswith("torch"))
    assert choice.reason  # always says why
    assert ("compiled" in choice.reason) == compile  # compiling never changes the kernels


def test_the_errors_say_what_to_do(machine):
    machine(has_cpu_kernels=False, is_triton_usable=False)
    with pytest.raises(RuntimeError, match="did not build.*use 'auto'"):
        resolve_attention_backend("cpu", "auto", "cpu", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("cuda", "auto", "auto", False)
    with pytest.raises(ValueError, match="on CUDA use 'triton'"):
        resolve_attention_backend("cuda", "auto", "cpu", False)
    with pytest.raises(ValueError, match="CPU runner only"):
        resolve_attention_backend("cuda", "auto", "triton", True)


def test_the_fallback_is_logged_with_its_reason(machine):
    from structlog.testing import capture_logs

    machine(has_cpu_kernels=False, is_triton_usable=False)
    with capture_logs() as logs:
        choice = resolve_attention_backend("cpu", "auto", "auto", False)
    assert [entry["log_level"] for entry in logs] == ["warning"]
    assert logs[0]["backend"] == "torch" and logs[0]["reason"] == choice.reason
    assert "did not build" in choice.reason


@given(
    device=st.text(max_size=8),
    kv_dtype=st.sampled_from(["auto", "int8", "fp8", ""]),
    requested=st.text(max_size=8),
)
def test_bad_input_is_a_clear_error(device, kv_dtype, requested):
    valid = (
        device in ("cpu", "cuda")
        and kv_dtype in ("auto", "int8")
        and requested in ("auto", "torch", "cpu", "triton")
    )
    if valid:
        return
    with pytest.raises(ValueError, match="attention backend|device|kv_cache_dtype"):
        resolve_attention_backend(device, kv_dtype, requested, False)


def test_config_takes_the_resolvers_names():
    for name in attention_backends.REQUESTABLE:
        assert EngineConfig(attention_backend=name).attention_backend == name
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")


@pytest.mark.parametrize("name", ["torch", "torch-int8kv", "cpu", "cpu-int8kv"])
def test_create_builds_the_named_backend(monkeypatch, name):
    from engine.kernels.cpu import paged_attention

    fake_extension = object()  # the C++ adapters only hold it until a step runs
    monkeypatch.setattr(paged_attention, "load", lambda: fake_extension)
    backend = create_attention_backend(attention_backends.AttentionBackendChoice(name, "test"))
    assert backend.name == name
    if name.startswith("cpu"):
        assert backend.extension is fake_extension
