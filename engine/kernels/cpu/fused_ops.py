"""Fused eager C++ ops for the CPU step (fused_ops.cpp): build once per machine, load, call.

Why: a decode step on the default model is ~3,000 torch calls, most of them small elementwise
chains between the GEMVs (RMSNorm with HF's rounding in 9 ops, RoPE in 4, SiLU * up in 3),
each a Python call, a dispatch and a fresh tensor. One C++ call per chain gives the same bits
(fused_ops.cpp says how) for a fraction of the overhead. `torch.compile` fuses the same chains
but measured no win here (engine/compile.py); these are the eager alternative the issue asked
for, chosen at run time, with the torch chain kept as the reference and the fallback.

The kernels follow torch's own arithmetic for this machine's ATen dispatch width ("AVX512": 16
float lanes, "AVX2" or "DEFAULT": 8): the RMSNorm's summation order and SiLU's exp depend on
it, so `lanes()` reads it from torch. Where the extension cannot match it (no compiler, not
x86-64, a build without the instruction set torch dispatches to), `load()` is None and the
callers keep the torch chain.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from types import ModuleType

import torch

from engine.kernels.cpu import extension
from engine.platform import cpu_info

SOURCE = Path(__file__).with_name("fused_ops.cpp")
_ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "portable": [],
}
# A fused multiply-add rounds once where torch's chain rounds twice.
_EXACT_FLAGS = ["-ffp-contract=off", "-fno-fast-math"]
# torch 2.x registers its sum kernel for AVX2, not AVX-512 (ATen keeps most reductions off
# AVX-512): its sums are 8 lanes wide on both; its exp follows the dispatch width.
_CAPABILITY_LANES = {"AVX512": (8, 16), "AVX2": (8, 8), "DEFAULT": (8, 0)}


def extension_name(isa: str) -> str:
    return f"mini_infer_fused_ops_{isa}_{extension.source_digest(SOURCE)}"


def build(build_root: Path | None = None, isa: str | None = None) -> ModuleType | None:
    isa = isa or cpu_info().vector_isa
    return extension.build(
        extension_name(isa), SOURCE, [*_ISA_FLAGS[isa], *_EXACT_FLAGS], build_root,
        event="fused_ops",
    )  # fmt: skip


def lanes() -> tuple[int, int] | None:
    """(float lanes of torch's reductions, lanes of its vectorised exp: 0 = std::exp) for this
    process's ATen dispatch; None where the kernels cannot follow it."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return _CAPABILITY_LANES.get(torch.backends.cpu.get_cpu_capability())


@functools.cache
def load() -> ModuleType | None:
    """The extension, if it can reproduce torch's arithmetic here; else None (torch chain)."""
    wanted = lanes()
    if wanted is None:
        return None
    ext = build()
    if ext is None or ext.exp_lanes_built() < wanted[1]:
        return None
    return ext
