"""engine/layers/ops.py: which implementation each elementwise chain gets, and that the Triton
side (run by the interpreter on CPU tensors, or on a GPU) matches the torch references."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.layers import ops
from engine.layers.norm import RMSNorm
from tests.engine.kernels.triton_cases import DEVICE, POINTWISE_TOLERANCES

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("device", "dtype", "has_fused", "expected"),
    [
        ("cuda", BF16, False, ("triton", "triton", "triton")),
        ("cuda", FP32, True, ("triton", "triton", "triton")),
        ("cpu", BF16, False, ("torch", "torch", "torch")),
        ("cpu", FP32, False, ("torch", "torch", "torch")),
        ("cpu", BF16, True, ("fused", "fused", "fused")),
        ("cpu", FP16, True, ("fused", "fused", "fused")),
        # fp32: torch's own F.rms_norm is HF's numbers in one op; RoPE and SiLU * up fuse.
        ("cpu", FP32, True, ("torch", "fused", "fused")),
    ],
)
def test_choose(device, dtype, has_fused, expected):
    assert ops.choose(device, dtype, has_fused) == dict(zip(ops.OPS, expected, strict=True))


class FakeKernels:
    """Records which fused C++ op was called (and the lanes it was given)."""

    def __init__(self):
        self.calls: list[tuple[str, int | None]] = []

    def rms_norm(self, x, weight, out, eps, lanes):
        self.calls.append(("rms_norm", lanes))

    def add_rms_norm_(self, x, residual, weight, eps, lanes):
        self.calls.append(("add_rms_norm_", lanes))

    def rotary_(self, x, cos, signed_sin):
        self.calls.append(("rotary_", None))

    def silu_mul(self, gate_up, out, lanes):
        assert out.shape == (gate_up.shape[0], gate_up.shape[1] // 2)
        self.calls.append(("silu_mul", lanes))


def _call_every_op(built: ops.PointwiseOps, dtype: torch.dtype) -> None:
    x, weight = torch.ones(2, 8, dtype=dtype), torch.ones(8, dtype=dtype)
    built.rms_norm(x.clone(), weight, 1e-5)
    built.rms_norm(x.clone(), weight, 1e-5, x.clone())
    built.rotary_(torch.ones(2, 3, 8, dtype=dtype), torch.ones(2, 1, 8, dtype=dtype),
                  torch.zeros(2, 1, 8, dtype=dtype))  # fmt: skip
    built.silu_mul(torch.ones(2, 16, dtype=dtype))


@pytest.mark.parametrize(
    ("dtype", "expected_calls"),
    [
        (BF16, [("rms_norm", 16), ("add_rms_norm_", 16), ("rotary_", None), ("silu_mul", 32)]),
        (FP32, [("rotary_", None), ("silu_mul", 32)]),  # the norm runs torch's F.rms_norm
    ],
)
def test_build_cpu_routes_to_the_fused_ops(dtype, expected_calls):
    kernels = FakeKernels()
    built = ops.build("cpu", dtype, kernels, lanes=(16, 32))
    _call_every_op(built, dtype)
    assert kernels.calls == expected_calls
    assert built.kernels is kernels


def test_build_cpu_without_kernels_is_torch():
    assert ops.build("cpu", BF16) is ops.TORCH_OPS
    assert ops.build("cpu", FP32, None) is ops.TORCH_OPS


def test_build_cuda_takes_the_triton_kernels():
    from engine.kernels.triton import pointwise

    built = ops.build("cuda", BF16, FakeKernels())  # kernels are the CPU's: ignored
    assert built.rms_norm is pointwise.rms_norm and built.rotary_ is pointwise.rotary_
    assert built.kernels is None


def test_use_ops_reaches_every_module_and_the_norm_reports_its_kernels():
    model = torch.nn.Sequential(RMSNorm(8, 1e-5, BF16), RMSNorm(8, 1e-5, BF16))
    assert all(m.kernels is None for m in model)  # torch until a runner chooses
    kernels = FakeKernels()
    names = ops.use_ops(model, ops.build("cpu", BF16, kernels, lanes=(16, 32)))
    assert names["rms_norm"] == "fused"
    assert all(m.kernels is kernels and m.lanes == 16 for m in model)
    model[0](torch.ones(2, 8, dtype=BF16))
    assert kernels.calls == [("rms_norm", 16)]


def test_model_code_has_no_device_branches():
    """Layers and models leave the device choice to ops.py: no `.is_cuda` anywhere else."""
    offenders = []
    for folder in ("engine/layers", "engine/models"):
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name == "ops.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "is_cuda":
                    offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


# The Triton side of ops.build("cuda") against the torch references (the interpreter on CPU).


def _randn(*shape, generator, dtype):
    return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)


@settings(max_examples=4, deadline=None)
@given(
    num_tokens=st.integers(1, 4),
    has_residual=st.booleans(),
    dtype=st.sampled_from([FP32, BF16]),
    seed=st.integers(0, 2**16),
)
def test_triton_rms_norm_matches_torch(num_tokens, has_residual, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    x = _randn(num_tokens, 96, generator=generator, dtype=dtype)
    weight = _randn(96, generator=generator, dtype=dtype)
    residual = _randn(num_tokens, 96, generator=generator, dtype=dtype) if has_residual else None
    got = ops.build("cuda", dtype).rms_norm(x, weight, 1e-5, residual)
    want = ops.TORCH_OPS.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(got, want, **POINTWISE_TOLERANCES[dtype])


@settings(max_examples=4, deadline=None)
@given(
    num_tokens=st.integers(1, 4),
    dtype=st.sampled_from([FP32, BF16]),
    seed=st.integers(0, 2**16),
)
def test_triton_rotary_and_silu_mul_match_torch(num_tokens, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    qkv = _randn(num_tokens, 5, 32, generator=generator, dtype=dtype)  # q 3 heads, k 1, v 1
    cos = _randn(num_tokens, 1, 32, generator=generator, dtype=dtype)
    sin = _randn(num_tokens, 1, 32, generator=generator, dtype=dtype)
    triton_ops = ops.build("cuda", dtype)
    got, want = qkv.clone(), qkv.clone()
    assert triton_ops.rotary_(got[:, :4], cos, sin).data_ptr() == got.data_ptr()
    ops.TORCH_OPS.rotary_(want[:, :4], cos, sin)
    torch.testing.assert_close(got, want, **POINTWISE_TOLERANCES[dtype])
    gate_up = _randn(num_tokens, 2 * 48, generator=generator, dtype=dtype)
    torch.testing.assert_close(
        triton_ops.silu_mul(gate_up), ops.TORCH_OPS.silu_mul(gate_up),
        **POINTWISE_TOLERANCES[dtype],
    )  # fmt: skip
