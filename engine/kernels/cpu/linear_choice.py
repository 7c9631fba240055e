"""Plain, oneDNN-packed or our GEMV's weights for each linear layer, decided on the running machine.

Three GEMM paths exist on CPU: `F.linear` on the checkpoint layout (MKL for fp32; for bf16/fp16
torch repacks the weight inside every call), oneDNN's `_linear_pointwise` on a weight packed
once into its blocked layout, and, for bf16, our own GEMV / small GEMM on weights packed in
pairs along K (engine/kernels/cpu/bf16_gemm.py; timed as itself at every rows bucket, and a
layer's rows decided below). Which is faster depends on the CPU, the dtype, the shape and the
number of rows, and a rule measured on one CPU family was wrong on the other:

    fp32, [M, 576] x [576, 3072]      plain F.linear   packed oneDNN
    2-core Xeon, M = 1 (whole step)   30 ms            37 ms          -> plain won
    AMD EPYC Zen 4, M = 1             147 us           70 us          -> packed wins 2.1x
    AMD EPYC Zen 4, M = 32            850 us           569 us         -> packed wins 1.5x

So the choice is measured at load on the model's real shapes with 1, 4, 16 and 64 rows (the
single stream people feel up to a busy batch; each is a rows bucket), alternating the paths
over several rounds and comparing the fastest sample of each (on a machine shared with other
processes, the minimum is the estimate least disturbed by preemption: medians of one
calibration under load were off by 10x); a shape takes the path whose product of times over
the buckets is smallest (for two paths: packed when the product of its time ratios packed /
plain is below 1). Only one layout of a weight stays resident, so the choice is per shape; the
times of every bucket are kept in the cache file for the record.
Results are cached as JSON under the cache dir, keyed by CPU model + flags + torch version (the
fingerprint) and thread count, so calibration is paid once per machine (a few seconds for
SmolLM2's five shapes per dtype on the Zen 4 VM) and a restarted worker starts at once. A
decision taken on a busy machine is used but not cached (measured again next start): when the
1-minute load average exceeds the number of cores before or after calibrating, or when a path
kept fewer than MIN_PLAUSIBLE_SAMPLES plausible samples in a rows bucket (a sample is
implausible when it is not finite or faster than any CPU could run the call: below
MIN_CALL_US, or streaming the weight faster than MAX_BYTES_PER_US_PER_THREAD per thread).

In the engine (SmolLM2 fp32 on the Zen 4 VM, 2 threads, 32 new tokens, 3 alternating rounds,
medians) the calibrated choice (lm_head, gate/up and down packed; q/k/v and o plain) gave 1.72x
the tok/s of all-plain (the rule measured on the Xeon) for 1 stream and 1.67x for 16. bf16 took
packed for every shape (2-2.5x per GEMM at 1 row).

The fused decode step's linears (every projection and the lm_head of a model the step takes,
engine/fused_decode.py `linears_for_the_step`) take our GEMV with "auto" whatever their
calibration chose, because on it they run inside the step's one parallel region and the
lm_head brings the step's screen and speculative decoding with it, a gain one call cannot
measure. On the 2-core Zen 5 the calibration put SmolLM2's bf16 lm_head on oneDNN (faster at
64 rows only), which kept it off the step: W1 bf16 ran at 158 tok/s against 298.

A layer on our GEMV runs it up to 16 rows and, past them, oneDNN on a copy of its weight (HF's
rounding of a prompt) where oneDNN has a bf16 GEMM, unless its calibration also timed that
fallback at 64 rows slower than our kernel (`gemv_max_rows`): then every row count. On the Zen 5
the copy made it 3-6x slower on every SmolLM2 and 1B shape (a 1B model's 39-token prompt: 950
against 143 ms).

`EngineConfig.linear_kernel` forces a path ("plain" | "packed" | "gemv"), so each stays tested
on any CPU. A path this machine cannot run (oneDNN cannot pack fp16 without
avx_ne_convert/avx512_fp16; our GEMV is bf16 only and needs a C++ compiler) falls back, with one
log line, to the next that it can ("gemv" -> "packed" -> "plain"): never a crash for want of an
instruction.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import structlog
import torch
import torch.nn.functional as F

from engine.kernels.cpu import bf16_gemm, calibration
from engine.platform import can_pack_onednn, cpu_info

log = structlog.get_logger(__name__)

LINEAR_KERNELS = ("auto", "plain", "packed", "gemv")
CALIBRATION_ROWS = (1, 4, 16, 64)
PREFILL_ROWS = CALIBRATION_ROWS[-1]  # the bucket that stands for a prefill chunk (`gemv_max_rows`)
_ROUNDS = 15
_FALLBACK_ROUNDS = 5  # the fallback copies the weight each call: fewer, slower samples
# Bumped when what a cached entry means changes: entries from before are measured again (v2:
# decisions taken under load or from implausible samples are no longer cached; v3: "gemv" timed
# as our kernel at every bucket; v4: our kernel's two-block tiles from 32 rows; v5: the
# fallback a gemv layer runs past its rows timed at 64 rows, deciding those rows).
CALIBRATION_VERSION = 5
MIN_PLAUSIBLE_SAMPLES = 5  # of _ROUNDS, per path and rows bucket, for a decision to be cached
MIN_CALL_US = 0.5  # one torch call never returns faster (dispatch alone is ~1-2 us)
# An upper bound on what one core reads from its own L2 (64 B/cycle at 5 GHz): 320 GB/s.
MAX_BYTES_PER_US_PER_THREAD = 320e3


def calibration_file() -> Path:
    return calibration.cache_dir() / f"linear-{cpu_info().fingerprint}.json"


def _key(dtype: torch.dtype, in_features: int, out_features: int) -> str:
    # The candidate paths are part of the key: a result that never saw a path is not reused.
    name = str(dtype).removeprefix("torch.")
    paths = "+".join(available_paths(dtype))
    threads = torch.get_num_threads()
    return f"{name}:{in_features}x{out_features}:threads{threads}:{paths}:v{CALIBRATION_VERSION}"


def available_paths(dtype: torch.dtype) -> tuple[str, ...]:
    """The paths this machine runs for `dtype`, slowest fallback first."""
    paths = ["plain"]
    if can_pack_onednn(dtype):
        paths.append("packed")
    if dtype == torch.bfloat16 and bf16_gemm.load() is not None:
        paths.append("gemv")
    return tuple(paths)


class LinearChoice(NamedTuple):
    """A shape's path, and for "gemv" the most rows a call runs our kernel for (None: every row
    count; beyond, oneDNN's F.linear on a transient unpacked copy, `bf16_gemm.linear`)."""

    path: str
    max_rows: int | None = None


def choose_linear_kernels(
    shapes: Iterable[tuple[int, int]],
    dtype: torch.dtype,
    requested: str = "auto",
    step_shapes: Iterable[tuple[int, int]] = (),
) -> dict[tuple[int, int], str]:
    """{(in_features, out_features): "plain" | "packed" | "gemv"} for each distinct shape
    (`choose_linears`' paths)."""
    return {shape: c.path for shape, c in choose_linears(shapes, dtype, requested, step_shapes).items()}


def choose_linears(
    shapes: Iterable[tuple[int, int]],
    dtype: torch.dtype,
    requested: str = "auto",
    step_shapes: Iterable[tuple[int, int]] = (),
) -> dict[tuple[int, int], LinearChoice]:
    """{(in_features, out_features): LinearChoice} for each distinct shape. `step_shapes` are
    the fused decode step's linears (fused_decode.linears_for_the_step): with "auto" they take
    our GEMV wherever it runs, whatever their calibration says of one call (the step's gain is
    not one call's); their calibration still decides their rows (`gemv_max_rows`)."""
    if requested not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernel must be one of {LINEAR_KERNELS}, got {requested!r}")
    distinct = sorted(set(shapes))
    paths = available_paths(dtype)
    if requested != "auto":
        chosen = next(p for p in reversed(LINEAR_KERNELS[1 : LINEAR_KERNELS.index(requested) + 1])
                      if p in paths)  # fmt: skip
        if chosen != requested:
            log.warning(
                "linear.kernel_unavailable", requested=requested, using=chosen,
                dtype=str(dtype), cpu=cpu_info().model_name,
            )  # fmt: skip
        return dict.fromkeys(
            distinct, LinearChoice(chosen, gemv_max_rows(None) if chosen == "gemv" else None)
        )
    if paths == ("plain",):
        if dtype != torch.float32:
            log.warning(
                "linear.packing_unavailable", dtype=str(dtype), cpu=cpu_info().model_name,
                detail="oneDNN has no packed path for this dtype on this CPU; using F.linear",
            )  # fmt: skip
        return dict.fromkeys(distinct, LinearChoice("plain"))
    on_the_step = set(step_shapes) if "gemv" in paths else set()
    path = calibration_file()
    cached = calibration.read(path)
    choices, measured = {}, {}
    busy = calibration.busy_reason()
    for shape in distinct:
        key = _key(dtype, *shape)
        if key not in cached:
            measured[key] = calibrate_shape(*shape, dtype)
        entry = measured.get(key) or cached[key]
        choice = "gemv" if shape in on_the_step else entry["choice"]
        choices[shape] = LinearChoice(choice, gemv_max_rows(entry) if choice == "gemv" else None)
    if measured:
        unsure = [r["unsure"] for r in measured.values() if "unsure" in r]
        reason = busy or calibration.busy_reason() or (unsure[0] if unsure else None)
        if reason is None:
            calibration.write(path, measured)
            log.info("linear.calibrated", file=str(path), results=measured)
        else:  # used for this process only: a busy machine's ranking must not outlive it
            log.warning("linear.calibration_not_cached", reason=reason, results=measured)
    return choices


def gemv_max_rows(entry: dict | None) -> int | None:
    """The most rows a layer on our GEMV runs it for, from its shape's calibration `entry`:
    every row count (None) where our kernel at PREFILL_ROWS rows was timed no slower than the
    fallback past `bf16_gemm.layer_max_rows()` rows (the weight copied out of our layout, then
    `F.linear`); else, and with no calibration (a forced path), `layer_max_rows()`: oneDNN past
    16 rows, which rounds a prefill as Hugging Face's bf16 model does, on a CPU where oneDNN
    has a bf16 GEMM."""
    limit = bf16_gemm.layer_max_rows()
    if limit is None or entry is None:
        return limit
    ours = entry.get(f"gemv_us_m{PREFILL_ROWS}")
    fallback = entry.get(f"fallback_us_m{PREFILL_ROWS}")
    return None if ours is not None and fallback is not None and ours <= fallback else limit


def calibrate_shape(in_features: int, out_features: int, dtype: torch.dtype) -> dict:
    """Fastest microseconds per call of each path at each of CALIBRATION_ROWS, and the choice
    (the path with the smallest product of times over the rows buckets)."""
    weight = torch.randn(out_features, in_features).div_(in_features**0.5).to(dtype)
    paths = available_paths(dtype)
    weights = {"plain": weight}
    if "packed" in paths:
        weights["packed"] = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
    if "gemv" in paths:
        weights["gemv"] = bf16_gemm.pack(weight)
    gemv = bf16_gemm.load().bf16_gemm if "gemv" in paths else None
    isa = bf16_gemm.isa_code() if gemv is not None else None
    samples: dict[int, dict[str, list[float]]] = {}
    for rows in CALIBRATION_ROWS:
        x = torch.randn(rows, in_features).to(dtype)
        calls = {
            "plain": lambda x=x: F.linear(x, weights["plain"]),
            "packed": lambda x=x: torch.ops.mkldnn._linear_pointwise(
                x, weights["packed"], None, "none", [], ""
            ),
            # Our kernel itself at every bucket: the fused decode step runs it up to
            # bf16_gemm.FUSED_MAX_ROWS (64) decode rows. (Where oneDNN has a bf16 GEMM, a
            # prefill chunk past GEMV_MAX_ROWS may take F.linear on an unpacked copy instead,
            # timed apart below for `gemv_max_rows`. Timing that path in this bucket chose
            # oneDNN for every SmolLM2 linear, which kept the fused step off: W1 bf16 33 tok/s
            # against 77.)
            "gemv": lambda x=x: gemv(x, weights["gemv"], None, out_features, isa, None),
        }
        samples[rows] = calibration.timed_rounds({name: calls[name] for name in paths}, _ROUNDS)
    weight_bytes = in_features * out_features * dtype.itemsize
    result = decide(samples, floor_us(weight_bytes, torch.get_num_threads()))
    if gemv is not None and bf16_gemm.layer_max_rows() is not None:
        # What a gemv layer runs past layer_max_rows() rows: its weight copied out of our
        # layout, then F.linear (`gemv_max_rows` weighs it against our kernel).
        x = torch.randn(PREFILL_ROWS, in_features).to(dtype)
        fallback = partial(bf16_gemm.linear, gemv, isa, x, weights["gemv"], None, out_features,
                           in_features, 0)  # fmt: skip
        times = calibration.timed_rounds({"fallback": fallback}, _FALLBACK_ROUNDS)["fallback"]
        result[f"fallback_us_m{PREFILL_ROWS}"] = round(min(times), 1)
    return result


def floor_us(weight_bytes: int, num_threads: int) -> float:
    """The fastest a call reading `weight_bytes` of weights could plausibly be timed."""
    return max(MIN_CALL_US, weight_bytes / (max(1, num_threads) * MAX_BYTES_PER_US_PER_THREAD))


def decide(samples: dict[int, dict[str, list[float]]], floor: float) -> dict:
    """{f"{path}_us_m{rows}": fastest plausible microseconds, "choice": path, and "unsure":
    why, when a path kept fewer than MIN_PLAUSIBLE_SAMPLES plausible samples in a bucket}.

    `samples` is {rows: {path: [microseconds per call, ...]}}. The choice is the path with the
    smallest product of its fastest times over the buckets, among the paths with a plausible
    sample in every bucket (the first path, the slowest fallback, when none has)."""
    paths = list(next(iter(samples.values()))) if samples else ["plain"]
    result: dict = {}
    log_product = dict.fromkeys(paths, 0.0)
    for rows, times in samples.items():
        for name in paths:
            kept = [t for t in times.get(name, []) if math.isfinite(t) and t >= floor]
            if len(kept) < MIN_PLAUSIBLE_SAMPLES and "unsure" not in result:
                result["unsure"] = f"{len(kept)} plausible samples of {name} at {rows} rows"
            if not kept:
                log_product[name] = math.inf
                continue
            result[f"{name}_us_m{rows}"] = round(min(kept), 1)
            log_product[name] += math.log(min(kept))
    candidates = [name for name in paths if math.isfinite(log_product[name])] or paths[:1]
    result["choice"] = min(candidates, key=lambda name: log_product[name])
    return result
