"""The decoder layer's elementwise chains behind one door: add + RMSNorm, RoPE, SiLU * up.

Model code calls `self.ops.rms_norm / rotary_ / silu_mul` and has no device branch. Which
implementation each runs is chosen once per model, by the runner once the model sits on its
device (`choose`, `build`, `use_ops`):
- "triton" on CUDA: one kernel per chain, rounding where the torch chain rounds
  (engine/kernels/triton/pointwise.py);
- "fused" on the eager CPU step where the fused C++ ops load (engine/kernels/cpu/fused_ops.cpp:
  the torch chains' bits in one call instead of about 30 per layer); the norm only in bf16/fp16,
  since in fp32 torch's own fused `F.rms_norm` already gives HF's numbers;
- "torch" otherwise: the reference, and what a compiled model keeps for Inductor to fuse.
A model no runner resolved runs the torch chains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import structlog
import torch
import torch.nn.functional as F
from torch import nn

log = structlog.get_logger(__name__)

OPS = ("rms_norm", "rotary", "silu_mul")
_FUSED_NORM_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PointwiseOps:
    """One model's implementation of each chain (`names`: op -> "torch" | "fused" | "triton")."""

    names: dict[str, str]
    # (x, weight, eps, residual=None) -> norm(x), or with residual (norm(x + residual),
    # x + residual); x, residual [num_tokens, hidden] may be reused for the results.
    rms_norm: Callable
    # (x [num_tokens, num_heads, head_dim], cos, signed_sin [num_tokens, 1, head_dim]) -> x,
    # rotated in place (x may be a view into the fused q/k/v output).
    rotary_: Callable
    # (gate_up [num_tokens, 2 * intermediate], gate first) -> silu(gate) * up.
    silu_mul: Callable
    kernels: ModuleType | None = None  # the fused C++ ops where any op uses them
    lanes: tuple[int, int] = (8, 0)  # (torch's sum width, its exp width) they follow


def choose(device_type: str, dtype: torch.dtype, has_fused: bool) -> dict[str, str]:
    """op -> implementation for a model of `dtype` on `device_type`, `has_fused` saying whether
    the fused C++ ops are loaded (the CPU runner loads them only for the eager step)."""
    if device_type == "cuda":
        return dict.fromkeys(OPS, "triton")
    if not has_fused:
        return dict.fromkeys(OPS, "torch")
    norm = "fused" if dtype in _FUSED_NORM_DTYPES else "torch"
    return {"rms_norm": norm, "rotary": "fused", "silu_mul": "fused"}


def build(
    device_type: str,
    dtype: torch.dtype,
    kernels: ModuleType | None = None,
    lanes: tuple[int, int] = (8, 0),
) -> PointwiseOps:
    names = choose(device_type, dtype, kernels is not None)
    if names["rotary"] == "triton":
        from engine.kernels.triton import pointwise  # imports Triton: only when chosen

        return PointwiseOps(
            names, pointwise.rms_norm, pointwise.rotary_, _triton_silu_mul(pointwise)
        )
    if names["rotary"] == "torch":
        return TORCH_OPS
    norm = _fused_rms_norm(kernels, lanes[0]) if names["rms_norm"] == "fused" else rms_norm_torch
    return PointwiseOps(
        names, norm, _fused_rotary(kernels), _fused_silu_mul(kernels, lanes[1]), kernels, lanes
    )


def load_fused_ops(mode: str) -> ModuleType | None:
    """The fused-ops extension for EngineConfig.fused_ops ("auto" | "on" | "off"), or None for
    the torch chains ("off", or no extension: no compiler, or torch's arithmetic not matched)."""
    if mode == "off":
        return None
    from engine.kernels.cpu import fused_ops

    kernels = fused_ops.load()
    if kernels is None:
        log.warning("pointwise.fused_ops_unavailable", requested=mode, fallback="torch")
    return kernels


def cpu_ops(dtype: torch.dtype, mode: str) -> PointwiseOps:
    """The eager CPU step's ops for EngineConfig.fused_ops `mode`."""
    from engine.kernels.cpu import fused_ops

    kernels = load_fused_ops(mode)
    return build("cpu", dtype, kernels, fused_ops.lanes() or (8, 0))


def use_ops(model: nn.Module, ops: PointwiseOps) -> dict[str, str]:
    """Hand `ops` to every module that runs a chain (one with an `ops` attribute); returns
    `ops.names` for the log."""
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops
    return ops.names


# The torch chains: the references every other implementation is tested against.


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    """HF's RMSNorm: in fp32 torch's fused `F.rms_norm` (the same numbers in one op); in
    bf16/fp16 normalised in float32 and rounded before the weight multiply, HF's order."""
    if residual is not None:
        x = x + residual
        return _norm_torch(x, weight, eps), x
    return _norm_torch(x, weight, eps)


def _norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def rotary_torch_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) met as
    roll(x) = cat(x2, x1) times the sin whose first half is negated (engine/layers/rotary.py):
    (-a) * b == -(a * b) exactly, so fp32 and bf16 results are bit-identical to HF's."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
    if torch.compiler.is_compiling():  # dynamo has no out= into a strided view; Inductor fuses
        return x.copy_(x * cos + rotated)  # the copy into the same single loop anyway
    return torch.add(x * cos, rotated, out=x)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # 2 x [num_tokens, intermediate]
    return F.silu(gate) * up


TORCH_OPS = PointwiseOps(dict.fromkeys(OPS, "torch"), rms_norm_torch, rotary_torch_, silu_mul_torch)


# The fused C++ ops (the same bits as the torch chains) and the Triton kernels.


def _fused_rms_norm(kernels: ModuleType, sum_lanes: int) -> Callable:
    def rms_norm(x, weight, eps, residual=None):
        if residual is None:
            out = torch.empty_like(x)
            kernels.rms_norm(x, weight, out, eps, sum_lanes)
            return out
        # x (the branch output, a fresh tensor) becomes the normalised sum; residual the sum.
        kernels.add_rms_norm_(x, residual, weight, eps, sum_lanes)
        return x, residual

    return rms_norm


def _fused_rotary(kernels: ModuleType) -> Callable:
    def rotary_(x, cos, signed_sin):
        kernels.rotary_(x, cos, signed_sin)
        return x

    return rotary_


def _fused_silu_mul(kernels: ModuleType, exp_lanes: int) -> Callable:
    def silu_mul(gate_up):
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        kernels.silu_mul(gate_up, out, exp_lanes)
        return out

    return silu_mul


def _triton_silu_mul(pointwise: ModuleType) -> Callable:
    def silu_mul(gate_up):
        return pointwise.silu_and_mul(*gate_up.chunk(2, dim=-1))

    return silu_mul
