"""What the running CPU can do, read once: the facts every kernel choice is made from.

Machines differ where it matters. oneDNN's packed fp16 GEMM needs avx_ne_convert or
avx512_fp16 and raises on a CPU without them (an AMD EPYC Zen 4 has neither); bf16 is computed
natively only with avx512_bf16 or AMX, and is emulated (several times slower) on a plain AVX-512
or AVX2 CPU. So kernels are chosen here from the flags the kernel reports, never assumed, and
every choice can be forced (for tests, and to check a slower path on a faster machine).

Sources: /proc/cpuinfo (Linux x86; elsewhere the flag set is empty and nothing fast is assumed),
torch's own dispatch level (`torch.backends.cpu.get_cpu_capability()`: "AVX512", "AVX2",
"DEFAULT", ...) and oneDNN's own checks for its reduced-precision paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from engine import openmp
from engine.cpus import cpu_budget

log = structlog.get_logger(__name__)

_CPUINFO = Path("/proc/cpuinfo")
# What turns an engine switch in the environment off (MINI_INFER_HUGE_PAGES,
# MINI_INFER_RELEASE_LIBRARY_PAGES), lower case and stripped.
SWITCH_OFF = frozenset({"0", "off", "false", "no"})


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]
    torch_capability: str  # the ATen vectorised dispatch level: "AVX512", "AVX2", "DEFAULT", ...

    def has(self, *flags: str) -> bool:
        """True if the CPU reports every one of `flags` (Linux /proc/cpuinfo names)."""
        return all(flag in self.flags for flag in flags)

    @property
    def vector_isa(self) -> str:
        """ "avx512" | "avx2" | "portable": the widest instruction set our own C++ kernels may be
        compiled for on this machine."""
        if self.has("avx512f", "avx512bw", "avx512vl", "avx512dq"):
            return "avx512"
        if self.has("avx2", "fma", "f16c"):
            return "avx2"
        return "portable"

    @property
    def fingerprint(self) -> str:
        """A short key for caches of per-machine decisions: CPU model, flags and torch version."""
        text = "|".join(
            [self.model_name, " ".join(sorted(self.flags)), torch.__version__, platform.machine()]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in a /proc/cpuinfo text ("Features" on Arm)."""
    first: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in first:
            first[key.strip()] = value.strip()
    flags = first.get("flags") or first.get("Features") or ""
    model_name = first.get("model name") or platform.processor() or "unknown"
    return model_name, frozenset(flags.split())


# MINI_INFER_MAX_ISA: the widest instruction set the engine's own choices may see of this CPU,
# so that a narrower machine's paths run, and are measured, here: "avx512" hides the AVX-512
# extensions past the foundation (bf16, fp16, VNNI, VBMI) and AMX; "avx2" every AVX-512 flag as
# well; "portable" AVX, AVX2, FMA and F16C too. torch's own kernels keep their dispatch level
# (ATEN_CPU_CAPABILITY sets that).
MAX_ISA_ENV = "MINI_INFER_MAX_ISA"
_HIDDEN_ABOVE = {
    "avx512": ("avx512_", "avx512vbmi", "avx512ifma", "amx"),
    "avx2": ("avx512", "amx"),
    "portable": ("avx512", "amx", "avx", "fma", "f16c"),
}


def cap_flags(flags: frozenset[str], max_isa: str | None) -> frozenset[str]:
    """`flags` without those above `max_isa` (None or "": all of them kept); ValueError for an
    unknown name."""
    if not max_isa:
        return flags
    hidden = _HIDDEN_ABOVE.get(max_isa.strip().lower())
    if hidden is None:
        raise ValueError(
            f"{MAX_ISA_ENV} must be one of {', '.join(_HIDDEN_ABOVE)}, got {max_isa!r}"
        )
    return frozenset(f for f in flags if not f.startswith(hidden))


@functools.cache
def cpu_info() -> CpuInfo:
    try:
        text = _CPUINFO.read_text()
    except OSError:
        text = ""
    model_name, flags = parse_cpuinfo(text)
    flags = cap_flags(flags, os.environ.get(MAX_ISA_ENV))
    return CpuInfo(model_name, flags, torch.backends.cpu.get_cpu_capability())


def has_native(dtype: torch.dtype, info: CpuInfo | None = None) -> bool:
    """Whether this CPU computes `dtype` GEMMs in hardware rather than by emulation.

    fp32 always; bf16 with avx512_bf16 (Zen 4, Cooper Lake and later Xeons) or AMX; fp16 with
    avx512_fp16 or AMX-FP16 (Sapphire Rapids and later). Without them torch still runs the dtype
    (converting to fp32 inside each kernel), correctly but slower than fp32 itself."""
    info = info or cpu_info()
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return info.has("avx512_bf16") or info.has("amx_bf16")
    if dtype == torch.float16:
        return info.has("avx512_fp16") or info.has("amx_fp16")
    return False


def can_pack_onednn(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed-weight linear (`mkldnn._reorder_linear_weight`) accepts `dtype`
    here; asking oneDNN itself, since it raises, not falls back, where its own check fails."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS now (glibc's malloc_trim; a no-op elsewhere).

    `keep_freed_memory` raises glibc's trim threshold so each step's freed temporaries stay
    mapped; while loading, that also keeps every freed intermediate (a layer's canonical codes
    once packed, dequantized chunks) resident until the end of the load, where they all add to
    the peak. Called between layers while loading, it keeps the peak near the live data."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        return


def tune_process(num_threads: int | None) -> None:
    """The process-wide settings the engine relies on, set in this one place (the engine calls
    it before loading, the model runner again for when it is built alone): torch's thread count
    (when configured; else torch's, one per CPU of the affinity, capped by a cgroup CPU quota:
    `_default_threads`), glibc keeping freed memory (`keep_freed_memory`), and one warning when
    the OpenMP wait policy could not be applied (engine/openmp.py)."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    else:
        _default_threads()
    keep_freed_memory()
    _warn_if_openmp_spins()


@functools.cache
def _default_threads() -> None:
    """Torch's thread count within the process's CPU budget (engine/cpus.py): torch counts the
    CPUs it may run on, not a container's quota (`--cpus`, a Kubernetes limit), and more
    threads than the quota allows are throttled in turn, each holding the others at the fused
    step's barriers. `OMP_NUM_THREADS` set by the user is left as it is."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    budget = cpu_budget()
    if budget < torch.get_num_threads():
        log.info("engine.threads_capped", threads=budget, cpus=torch.get_num_threads(),
                 reason="cgroup CPU quota")  # fmt: skip
        torch.set_num_threads(budget)


@functools.cache
def _warn_if_openmp_spins() -> None:
    if not openmp.APPLIED_AT_IMPORT and "OMP_WAIT_POLICY" not in os.environ:
        log.warning(
            "model_runner.openmp_spinning",
            detail="torch was imported before engine: OpenMP threads spin while waiting; "
            "set OMP_WAIT_POLICY=PASSIVE in the environment (see engine/openmp.py)",
        )  # fmt: skip


@functools.cache
def keep_freed_memory() -> None:
    """Stop glibc from handing each step's multi-megabyte temporaries (logits, gathered K/V,
    prefill activations) back to the OS when freed: re-faulting their pages every step doubled
    fp32 decode attention time (3.1 -> 1.5 ms per layer at 176 context). Process-wide, like
    the tcmalloc/jemalloc preload that CPU inference stacks recommend; RSS stays at its peak.
    What loading freed is handed back once after it (`trim_heap`)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
    libc.mallopt(m_trim_threshold, 1 << 30)
