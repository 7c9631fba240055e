"""Plain or oneDNN-packed weights for each linear layer, decided on the running machine.

Two GEMM paths exist on CPU: `F.linear` on the checkpoint layout (MKL for fp32; for bf16/fp16
torch repacks the weight inside every call) and oneDNN's `_linear_pointwise` on a weight packed
once into its blocked layout. Which is faster depends on the CPU, the dtype, the shape and the
number of rows, and a rule measured on one CPU family was wrong on the other:

    fp32, [M, 576] x [576, 3072]      plain F.linear   packed oneDNN
    2-core Xeon, M = 1 (whole step)   30 ms            37 ms          -> plain won
    AMD EPYC Zen 4, M = 1             147 us           70 us          -> packed wins 2.1x
    AMD EPYC Zen 4, M = 32            850 us           569 us         -> packed wins 1.5x

So the choice is measured at load on the model's real shapes with 1 and 32 rows (the single
stream people feel, and a busy batch), alternating the two paths over several rounds and
comparing the fastest sample of each (on a machine shared with other processes, the minimum is
the estimate least disturbed by preemption: medians of one calibration under load were off by
10x); a shape goes packed when the product of its two time ratios (packed / plain) is below 1.
Results are cached as JSON under the cache dir, keyed by CPU model + flags + torch version (the
fingerprint) and thread count, so calibration is paid once per machine (a few seconds for
SmolLM2's five shapes per dtype on the Zen 4 VM) and a restarted worker starts at once.

In the engine (SmolLM2 fp32 on the Zen 4 VM, 2 threads, 32 new tokens, 3 alternating rounds,
medians) the calibrated choice (lm_head, gate/up and down packed; q/k/v and o plain) gave 1.72x
the tok/s of all-plain (the rule measured on the Xeon) for 1 stream and 1.67x for 16. bf16 took
packed for every shape (2-2.5x per GEMM at 1 row).

`EngineConfig.linear_kernel` forces a path ("plain" | "packed"), so both stay tested on any CPU.
A dtype oneDNN cannot pack here (fp16 without avx_ne_convert/avx512_fp16) gets plain with one
log line, whatever is asked: never a crash for want of an instruction.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F

from engine.platform import can_pack_onednn, cpu_info

log = structlog.get_logger(__name__)

LINEAR_KERNELS = ("auto", "plain", "packed")
CALIBRATION_ROWS = (1, 32)
_ROUNDS = 15


def _cache_dir() -> Path:
    from engine.loader import cache_dir  # the loader pulls in safetensors etc.: import late

    return cache_dir() / "calibration"


def calibration_file() -> Path:
    return _cache_dir() / f"linear-{cpu_info().fingerprint}.json"


def _key(dtype: torch.dtype, in_features: int, out_features: int) -> str:
    name = str(dtype).removeprefix("torch.")
    return f"{name}:{in_features}x{out_features}:threads{torch.get_num_threads()}"


def choose_linear_kernels(
    shapes: Iterable[tuple[int, int]], dtype: torch.dtype, requested: str = "auto"
) -> dict[tuple[int, int], str]:
    """{(in_features, out_features): "plain" | "packed"} for each distinct shape."""
    if requested not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernel must be one of {LINEAR_KERNELS}, got {requested!r}")
    distinct = sorted(set(shapes))
    if not can_pack_onednn(dtype):
        if requested == "packed" or dtype != torch.float32:
            log.warning(
                "linear.packing_unavailable", dtype=str(dtype), cpu=cpu_info().model_name,
                detail="oneDNN has no packed path for this dtype on this CPU; using F.linear",
            )  # fmt: skip
        return dict.fromkeys(distinct, "plain")
    if requested != "auto":
        return dict.fromkeys(distinct, requested)
    path = calibration_file()
    cached = _read(path)
    choices, measured = {}, {}
    for shape in distinct:
        key = _key(dtype, *shape)
        if key not in cached:
            measured[key] = calibrate_shape(*shape, dtype)
        choices[shape] = (measured.get(key) or cached[key])["choice"]
    if measured:
        _write(path, measured)
        log.info("linear.calibrated", file=str(path), results=measured)
    return choices


def calibrate_shape(in_features: int, out_features: int, dtype: torch.dtype) -> dict:
    """Fastest microseconds per call of each path at each of CALIBRATION_ROWS, and the choice."""
    weight = torch.randn(out_features, in_features).div_(in_features**0.5).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, max(CALIBRATION_ROWS))
    result: dict = {}
    ratio_product = 1.0
    for rows in CALIBRATION_ROWS:
        x = torch.randn(rows, in_features).to(dtype)
        calls = {
            "plain": lambda x=x: F.linear(x, weight),
            "packed": lambda x=x: torch.ops.mkldnn._linear_pointwise(
                x, packed, None, "none", [], ""
            ),
        }
        times = {name: [] for name in calls}
        for call in calls.values():
            call()  # warm-up: first-call allocation and oneDNN primitive creation
        for _ in range(_ROUNDS):  # alternate, so drift on a shared machine hits both alike
            for name, call in calls.items():
                times[name].append(_time_us(call))
        plain_us, packed_us = (min(times[n]) for n in ("plain", "packed"))
        result[f"plain_us_m{rows}"] = round(plain_us, 1)
        result[f"packed_us_m{rows}"] = round(packed_us, 1)
        ratio_product *= packed_us / plain_us
    result["choice"] = "packed" if ratio_product < 1.0 else "plain"
    return result


def _time_us(call) -> float:
    """Microseconds of one call. One call per sample, not a mean over many: under contention
    a mean absorbs every preemption (each costs a whole time slice, ~5-10 ms, when the partner
    OpenMP thread is descheduled), while the fastest single call still shows the kernel."""
    with torch.inference_mode():
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e6


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, new: dict) -> None:
    """Merge `new` into the file atomically (rename): a concurrent reader never sees half a
    file; two writers at once may lose one's entries, which only costs a re-calibration."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**_read(path), **new}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".linear-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(merged, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as error:  # a read-only cache dir: decide again next start, do not fail
        log.warning("linear.calibration_not_saved", file=str(path), error=str(error))
