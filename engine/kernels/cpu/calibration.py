"""What the start-up calibrations share: their timing loop, the busy-machine rule, the cache file.

Two choices are measured on the running machine at load because a rule measured on one CPU was
wrong on another: each linear layer's GEMM path (linear_choice.py) and the longest chunk after
cached tokens that takes the extend attention kernel (extend_choice.py). Both time their sides
the same way (`timed_rounds`: alternating, one call per sample, the fastest kept), refuse to
cache a decision taken on a busy machine (`busy_reason`), and keep their decisions as JSON in
one directory (`cache_dir`), one file per CPU fingerprint, merged atomically (`write`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)


def cache_dir() -> Path:
    """The calibration files' directory, under the engine's cache dir."""
    from engine.loader import cache_dir as engine_cache_dir  # pulls in safetensors: import late

    return engine_cache_dir() / "calibration"


def busy_reason() -> str | None:
    """Why a calibration taken now should not be cached (the 1-minute load average above the
    number of cores: the sides were timed against other processes), or None."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this OS: nothing to judge by
        return None
    num_cores = os.cpu_count() or 1
    if load > num_cores:
        return f"load average {load:.1f} above {num_cores} cores"
    return None


def timed_rounds(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Microseconds of each call `rounds` times, the calls alternating (so drift on a shared
    machine hits all alike), after one warm-up call each (first-call allocation, page faults,
    oneDNN primitive creation)."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(time_us(call))
    return times


def time_us(call: Callable[[], object]) -> float:
    """Microseconds of one call. One call per sample, not a mean over many: under contention
    a mean absorbs every preemption (each costs a whole time slice, ~5-10 ms, when the partner
    OpenMP thread is descheduled), while the fastest single call still shows the kernel."""
    with torch.inference_mode():
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e6


def read(path: Path) -> dict:
    """A calibration file's entries; {} when it is missing or not a JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write(path: Path, new: dict) -> None:
    """Merge `new` into the file atomically (rename): a concurrent reader never sees half a
    file; two writers at once may lose one's entries, which only costs a re-calibration."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**read(path), **new}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(merged, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as error:  # a read-only cache dir: decide again next start, do not fail
        log.warning("calibration.not_saved", file=str(path), error=str(error))
