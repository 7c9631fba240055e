"""What a request's life tells the metrics, the trace and its final's `timing`.

Pure bookkeeping over a `Job`'s timestamps (monotonic seconds), kept out of the pipeline so the
pipeline reads as the life of a request and this file as what is measured about it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from schemas.contract import LANE_SEPARATOR, LANE_URGENCIES
from schemas.messages import Timing
from worker.service.bridge import StepInfo
from worker.service.job import Job
from worker.service.telemetry import Telemetry


def kafka_wait_s(record: Any) -> float | None:
    """The record's producer timestamp to now (two machines' clocks: a hint, clamped at 0)."""
    timestamp_ms = getattr(record, "timestamp", None)
    if not isinstance(timestamp_ms, int) or timestamp_ms <= 0:
        return None
    return max(0.0, time.time() - timestamp_ms / 1000)


def on_arrival(t: Telemetry, job: Job) -> None:
    t.requests_received.add(1, {"urgency": job.urgency.value})
    t.inflight_requests.add(1)
    if job.kafka_wait_s is not None:
        t.queue_s.record(job.kafka_wait_s, {"stage": "kafka", "urgency": job.urgency.value})


def on_tokens(t: Telemetry, job: Job, num_tokens: int, now_s: float) -> None:
    """`num_tokens` new tokens reached the event loop at `now_s`."""
    if num_tokens <= 0:
        return
    if job.first_token_s is None:
        job.first_token_s = now_s
    elif job.last_token_s is not None:
        gap_s = (now_s - job.last_token_s) / num_tokens  # a step's tokens arrive together
        attributes = {"urgency": job.urgency.value}
        for _ in range(num_tokens):
            t.itl_s.record(gap_s, attributes)
    job.last_token_s = now_s


@dataclass
class EngineTotals:
    """The engine's cumulative counters as last seen, to turn them into per-step increments."""

    num_preemptions: int = 0
    num_tokens_computed: int = 0


def on_step(t: Telemetry, step: StepInfo, totals: EngineTotals) -> None:
    """Engine gauges and counters after a step."""
    t.step_s.record(step.duration_s)
    stats = step.stats
    if stats is None:
        return
    used = stats.num_blocks_total - stats.num_blocks_free
    t.running_requests.set(stats.num_running)
    t.waiting_requests.set(stats.num_waiting)
    t.kv_blocks_used.set(used)
    t.kv_blocks_total.set(stats.num_blocks_total)
    t.kv_usage.set(used / stats.num_blocks_total if stats.num_blocks_total else 0.0)
    t.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
    if stats.num_preemptions > totals.num_preemptions:
        t.preemptions.add(stats.num_preemptions - totals.num_preemptions)
    if stats.num_tokens_computed > totals.num_tokens_computed:
        t.step_tokens.record(stats.num_tokens_computed - totals.num_tokens_computed)
    totals.num_preemptions = stats.num_preemptions
    totals.num_tokens_computed = stats.num_tokens_computed


def lane_of(partition: Any) -> str:
    """`critical` or `high` for a request read from that urgency lane, else `base`."""
    topic = getattr(partition, "topic", "") or ""
    lane = topic.rsplit(LANE_SEPARATOR, 1)[-1]
    return lane if lane in LANE_URGENCIES and topic != lane else "base"


def timing_of(job: Job, now_s: float) -> Timing:
    first_s, last_s = job.first_token_s, job.last_token_s
    return Timing(
        queued_ms=_ms((job.released_s or now_s) - job.received_s),
        ttft_ms=None if first_s is None else _ms(first_s - job.received_s),
        total_ms=_ms(now_s - job.received_s),
        kafka_ms=None if job.kafka_wait_s is None else _ms(job.kafka_wait_s),
        batcher_ms=None if job.released_s is None else _ms(job.released_s - job.received_s),
        engine_queue_ms=None if job.engine_queue_s is None else _ms(job.engine_queue_s),
        prefill_ms=None if job.prefill_s is None else _ms(job.prefill_s),
        decode_ms=None if first_s is None or last_s is None else _ms(last_s - first_s),
    )


def on_final(t: Telemetry, job: Job, finish_reason: str, timing: Timing) -> None:
    urgency = {"urgency": job.urgency.value}
    t.requests_finished.add(1, {"finish_reason": finish_reason, **urgency})
    t.prompt_tokens.add(job.num_prompt_tokens)
    t.generated_tokens.add(job.num_output_tokens)
    t.e2e_s.record(timing.total_ms / 1000, urgency)
    if timing.ttft_ms is not None:  # by lane too: did the request come by its urgency lane?
        t.ttft_s.record(timing.ttft_ms / 1000, {**urgency, "lane": lane_of(job.partition)})
    if timing.batcher_ms is not None:
        t.queue_s.record(timing.batcher_ms / 1000, {"stage": "batcher", **urgency})
    if job.engine_queue_s is not None:
        t.queue_s.record(job.engine_queue_s, {"stage": "engine", **urgency})
    if job.prefill_s is not None:
        t.prefill_s.record(job.prefill_s, urgency)
    if timing.decode_ms is not None:
        t.decode_s.record(timing.decode_ms / 1000, urgency)
        if job.num_output_tokens > 1:
            t.tpot_s.record(timing.decode_ms / 1000 / (job.num_output_tokens - 1), urgency)


def record_stages(t: Telemetry, job: Job, acked_s: float) -> None:
    """The request's stages as child spans of its `process` span, from measured times."""
    span = job.span
    t.record_stage(span, "batcher wait", job.received_s, job.released_s)
    if job.released_s is not None and job.engine_queue_s is not None:
        engine_start_s = job.released_s + job.engine_queue_s
        t.record_stage(span, "engine queue", job.released_s, engine_start_s)
        if job.prefill_s is not None:
            t.record_stage(span, "prefill", engine_start_s, engine_start_s + job.prefill_s)
    t.record_stage(span, "decode", job.first_token_s, job.last_token_s)
    t.record_stage(span, "publish", job.finished_s, acked_s)


def _ms(seconds: float) -> float:
    return max(0.0, seconds * 1000.0)
