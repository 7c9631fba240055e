"""The load generator's arithmetic, pure: arrivals, synthetic lengths, the urgency mix, and the
metrics of a finished run, with the definitions and JSON keys of `vllm bench serve`.

No asyncio, Kafka or clock in here: the runner (`loadtest.loadgen`) measures, this module
counts, so every number in a report can be checked against a hand computation.

Definitions (as vLLM's `calculate_metrics`):
- TTFT: from sending the request to the first streamed token.
- ITL: the gap between two consecutive streamed chunks of one request (every gap of every
  request is one sample; a chunk is one reply message, one token at `tokens_per_message=1`).
- TPOT: (E2E latency - TTFT) / (output tokens - 1), only for requests with more than one output
  token; for goodput a request with one token counts as TPOT 0.
- E2E latency (`e2el`): from sending the request to its final reply.
- Goodput: completed requests per second whose every given SLO (`ttft`, `tpot`, `e2el`, in ms)
  holds, `<=` as vLLM's `s >= r`.
- Percentiles interpolate linearly between order statistics, as `numpy.percentile` does.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

URGENCIES = ("critical", "high", "normal", "low")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
# A request is served only when it ends with one of these; "cancelled" is the load generator's
# own doing, "expired" and "error" are failures.
SERVED_FINISH_REASONS = ("stop", "length")


# --- arrivals and workloads -------------------------------------------------------------------


def arrival_gaps_s(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between consecutive requests, as vLLM draws them: gamma with shape `burstiness` and
    mean `1 / request_rate` (burstiness 1 is a Poisson process; below 1 burstier, above 1 more
    regular, its coefficient of variation being `1 / sqrt(burstiness)`). An infinite rate sends
    everything at once."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    theta = 1.0 / (request_rate * burstiness)
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, theta) for _ in range(num)]


def arrival_offsets_s(gaps_s: Sequence[float]) -> list[float]:
    """When each request is sent, relative to the first: vLLM sends one, then sleeps a gap, so
    request i leaves after the first i gaps and the first leaves at 0."""
    offsets, t = [], 0.0
    for gap in gaps_s:
        offsets.append(t)
        t += gap
    return offsets


def sample_lengths(num: int, mean_len: int, range_ratio: float, rng: random.Random) -> list[int]:
    """Uniform integers in [floor(mean*(1-r)), ceil(mean*(1+r))], vLLM's random dataset rule
    (at least 1); `range_ratio` 0 gives the fixed-length workload."""
    if mean_len < 1:
        raise ValueError(f"length must be >= 1, got {mean_len}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean_len * (1 - range_ratio)))
    high = max(low, math.ceil(mean_len * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(num)]


def parse_urgency_mix(text: str) -> dict[str, float]:
    """`critical:0.1,normal:0.6,low:0.3` -> weights; they must be >= 0 and sum to 1."""
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, sep, weight = part.strip().partition(":")
        if not sep or name not in URGENCIES:
            raise ValueError(
                f"bad urgency mix entry {part!r}: want NAME:WEIGHT with NAME in {URGENCIES}"
            )
        if name in mix:
            raise ValueError(f"urgency {name!r} is given twice")
        try:
            mix[name] = float(weight)
        except ValueError:
            raise ValueError(f"bad weight in {part!r}") from None
        if not (mix[name] >= 0 and math.isfinite(mix[name])):
            raise ValueError(f"weight of {name!r} must be a finite number >= 0")
    if not math.isclose(sum(mix.values()), 1.0, abs_tol=1e-6):
        raise ValueError(f"urgency weights must sum to 1, got {sum(mix.values())}")
    return mix


def assign_urgencies(num: int, mix: dict[str, float], rng: random.Random) -> list[str]:
    names = list(mix)
    return rng.choices(names, weights=[mix[n] for n in names], k=num)


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> SLOs in ms, as vLLM's `--goodput`."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"bad goodput SLO {item!r}: want NAME:MS with NAME in {GOODPUT_METRICS}"
            )
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"bad milliseconds in goodput SLO {item!r}") from None
        if not slos[name] > 0:
            raise ValueError(f"goodput SLO {item!r} must be > 0 ms")
    return slos


# --- one request's outcome --------------------------------------------------------------------


@dataclass
class RequestResult:
    """What the runner saw of one request. Times are seconds since it was sent, on one clock.

    `chunk_times_s`: arrival of each streamed reply that carried tokens; `worker_timing`: the
    final's `timing` (ms, the worker's clock), None when no final came."""

    urgency: str
    prompt_len: int = 0  # from the final's usage (the worker's tokenizer), else the target
    output_len: int = 0
    e2el_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # None: no final (timeout, client error)
    error: str | None = None
    worker_timing: dict[str, float | None] | None = None

    @property
    def is_served(self) -> bool:
        return self.finish_reason in SERVED_FINISH_REASONS and self.e2el_s is not None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def tpot_s(self) -> float | None:
        """None when undefined (one output token or none)."""
        if self.output_len <= 1 or self.ttft_s is None or self.e2el_s is None:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_len - 1)


# --- statistics -------------------------------------------------------------------------------


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0 for no samples, as vLLM's
    `np.percentile(xs or 0, q)`."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not xs:
        return 0.0
    ordered = sorted(xs)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentile_key(p: float) -> str:
    """vLLM writes p99, p99.9: the integer when the percentile is whole."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def latency_stats_ms(name: str, xs_s: Sequence[float], percentiles: Sequence[float]) -> dict:
    """mean/median/std/pNN of `xs_s` in ms under vLLM's names (`mean_ttft_ms`, ...)."""
    xs = list(xs_s)
    stats = {
        f"mean_{name}_ms": statistics.fmean(xs) * 1000 if xs else 0.0,
        f"median_{name}_ms": percentile(xs, 50) * 1000,
        f"std_{name}_ms": statistics.pstdev(xs) * 1000 if xs else 0.0,
    }
    for p in percentiles:
        stats[f"{percentile_key(p)}_{name}_ms"] = percentile(xs, p) * 1000
    return stats


def is_good(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """vLLM's goodput rule: served, and every SLO met; TPOT counts as 0 with one output token."""
    if not result.is_served:
        return False
    values_s = {"ttft": result.ttft_s, "tpot": result.tpot_s or 0.0, "e2el": result.e2el_s}
    for name, slo_ms in slos_ms.items():
        value = values_s[name]
        if value is None or value * 1000 > slo_ms:
            return False
    return True


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    slos_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict:
    """The summary of `vllm bench serve` for `results` over a run of `duration_s`."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    served = [r for r in results if r.is_served]
    total_input = sum(r.prompt_len for r in served)
    total_output = sum(r.output_len for r in served)
    finish_reasons: dict[str, int] = {}
    for r in results:
        key = r.finish_reason or "no_final"
        finish_reasons[key] = finish_reasons.get(key, 0) + 1
    num_cancelled = finish_reasons.get("cancelled", 0)
    metrics = {
        "duration": duration_s,
        "num_prompts": len(results),
        "completed": len(served),
        "cancelled": num_cancelled,
        "failed": len(results) - len(served) - num_cancelled,
        "finish_reasons": finish_reasons,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(served) / duration_s,
        "request_goodput": (
            sum(is_good(r, slos_ms) for r in served) / duration_s if slos_ms else None
        ),
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    metrics.update(latency_stats_ms("ttft", [r.ttft_s for r in served], percentiles))
    tpots = [r.tpot_s for r in served if r.tpot_s is not None]
    metrics.update(latency_stats_ms("tpot", tpots, percentiles))
    metrics.update(latency_stats_ms("itl", [x for r in served for x in r.itls_s], percentiles))
    metrics.update(latency_stats_ms("e2el", [r.e2el_s for r in served], percentiles))
    return metrics


def latency_split_ms(
    results: Sequence[RequestResult], percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> dict:
    """Where a served request's time went, from the final's `timing` (worker clock, from the
    moment the worker read the message) and the client's own E2E latency:

    - `kafka`: client E2E - worker total: producing the request, the worker's fetch, the replies'
      way back (both directions together; the two clocks are not compared);
    - `batcher`: `queued_ms`, from receipt to release by the urgency batcher;
    - `engine_queue` and `prefill`: the worker's `engine_queue_ms` and `prefill_ms` (contract
      v1.1); from a worker that does not send them, `engine_queue_prefill` = `ttft_ms -
      queued_ms`, the two together;
    - `decode`: `total_ms - ttft_ms`.
    """
    parts: dict[str, list[float]] = {"kafka": [], "batcher": [], "decode": []}
    for r in results:
        timing = r.worker_timing
        if not r.is_served or timing is None or timing.get("ttft_ms") is None:
            continue
        parts["kafka"].append(r.e2el_s * 1000 - timing["total_ms"])
        parts["batcher"].append(timing["queued_ms"])
        if timing.get("engine_queue_ms") is not None and timing.get("prefill_ms") is not None:
            parts.setdefault("engine_queue", []).append(timing["engine_queue_ms"])
            parts.setdefault("prefill", []).append(timing["prefill_ms"])
        else:
            parts.setdefault("engine_queue_prefill", []).append(
                timing["ttft_ms"] - timing["queued_ms"]
            )
        parts["decode"].append(timing["total_ms"] - timing["ttft_ms"])
    # latency_stats_ms scales seconds to ms; these are ms already.
    return {
        name: latency_stats_ms(name, [v / 1000 for v in values], percentiles)
        for name, values in parts.items()
    } | {"num_requests": len(parts["kafka"])}


def ttft_split_ms(
    results: Sequence[RequestResult], percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> dict:
    """The client's TTFT beside the worker's, to find where a first token waits. For every
    request with a first token and a final that has `ttft_ms`:

    - `worker_ttft`: the final's `ttft_ms`, from the worker reading the request to the first
      token reaching its event loop;
    - `kafka_in`: the final's `kafka_ms`, the request record's producer timestamp to the
      worker reading it (its fetch and any read-ahead pause);
    - `reply_out`: client TTFT - `kafka_in` - `worker_ttft`: the first token's way back
      (the publisher, the broker, the client's fetch and routing), and the client's send.

    `kafka_in` and `reply_out` compare the client's, broker's and worker's clocks: exact on
    one machine, a hint across machines. Requests without `kafka_ms` count in `worker_ttft`
    only."""
    parts: dict[str, list[float]] = {"worker_ttft": [], "kafka_in": [], "reply_out": []}
    for r in results:
        timing = r.worker_timing or {}
        if r.ttft_s is None or timing.get("ttft_ms") is None:
            continue
        parts["worker_ttft"].append(timing["ttft_ms"])
        if timing.get("kafka_ms") is not None:
            parts["kafka_in"].append(timing["kafka_ms"])
            parts["reply_out"].append(r.ttft_s * 1000 - timing["kafka_ms"] - timing["ttft_ms"])
    split: dict = {"num_requests": len(parts["worker_ttft"])}
    for name, values in parts.items():
        split.update(latency_stats_ms(name, [v / 1000 for v in values], percentiles))
    return split


def summarize_run(
    results: Sequence[RequestResult],
    duration_s: float,
    slos_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict:
    """Overall metrics at the top level (vLLM's keys), then `per_urgency` (each with its
    `ttft_split`), `latency_split` and `ttft_split`."""
    doc = compute_metrics(results, duration_s, slos_ms, percentiles)
    by_urgency: dict[str, list[RequestResult]] = {}
    for r in results:
        by_urgency.setdefault(r.urgency, []).append(r)
    doc["per_urgency"] = {
        u: compute_metrics(by_urgency[u], duration_s, slos_ms, percentiles)
        for u in URGENCIES
        if u in by_urgency
    }
    doc["latency_split"] = latency_split_ms(results, percentiles)
    doc["ttft_split"] = ttft_split_ms(results, percentiles)
    for u, metrics in doc["per_urgency"].items():
        metrics["ttft_split"] = ttft_split_ms(by_urgency[u], percentiles)
    return doc
