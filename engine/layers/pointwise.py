"""The CPU step's elementwise chains, resolved once per model: fused C++ ops or torch's.

RMSNorm (with the residual add), RoPE and SiLU * up each hold the path they run and no longer
check the device on every call. With the fused ops (engine/kernels/cpu/fused_ops.py) a decoder
layer makes 4 calls where the torch chains made about 30; both give the same bits (tested).
Only the eager CPU step: a compiled model keeps the torch chains for Inductor to fuse, and the
CUDA runner keeps the per-call device choice (Triton kernels).
"""

from __future__ import annotations

import structlog
from torch import nn

log = structlog.get_logger(__name__)


def load_fused_ops(mode: str):
    """The fused-ops extension for EngineConfig.fused_ops ("auto" | "on" | "off"), or None for
    the torch chains ("off", or no extension: no compiler, or torch's arithmetic not matched)."""
    if mode == "off":
        return None
    from engine.kernels.cpu import fused_ops

    kernels = fused_ops.load()
    if kernels is None:
        log.warning("pointwise.fused_ops_unavailable", requested=mode, fallback="torch")
    return kernels


def use_cpu_ops(model: nn.Module, mode: str) -> dict[str, int]:
    """Resolve every module's CPU path (modules with a `use_cpu(kernels, lanes)`, lanes being
    (torch's sum width, its exp width): fused_ops.lanes()); returns how
    many took the fused op and how many the torch chain, for the log."""
    from engine.kernels.cpu import fused_ops

    kernels = load_fused_ops(mode)
    lanes = fused_ops.lanes() or (8, 0)  # (torch's sum width, its exp width)
    counts = {"fused": 0, "torch": 0}
    for module in model.modules():
        use_cpu = getattr(module, "use_cpu", None)
        if use_cpu is not None:
            counts["fused" if use_cpu(kernels, lanes) else "torch"] += 1
    return counts
