"""What a request's life tells the metrics, the trace and its final's `timing`.

Pure bookkeeping over a `Job`'s timestamps (monotonic seconds), kept out of the pipeline so the
pipeline reads as the life of a request and this file as what is measured about it.
"""

from __future__ import annotations

import time
from collections import Counter
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


def operation_of(job: Job) -> str:
    """gen_ai.operation.name: a chat (messages, rendered with the chat template) or a plain
    completion prompt."""
    request = job.request
    return "chat" if request is not None and request.messages is not None else "text_completion"


def on_arrival(t: Telemetry, job: Job) -> None:
    urgency = job.urgency.value
    t.requests_received.add(1, {"urgency": urgency, "gen_ai.operation.name": operation_of(job)})
    t.inflight_requests.add(1)
    if job.kafka_wait_s is not None:
        attributes = {"stage": "kafka", "urgency": urgency, **t.kafka_attributes}
        t.queue_s.record(job.kafka_wait_s, attributes)


def on_tokens(job: Job, num_tokens: int, now_s: float, gaps: Counter) -> None:
    """`num_tokens` new tokens reached the event loop at `now_s`. Their inter-token gaps are
    counted into `gaps` ((gap, urgency) -> tokens) for `record_gaps`."""
    if num_tokens <= 0:
        return
    if job.first_token_s is None:
        job.first_token_s = now_s
    elif job.last_token_s is not None:
        gap_s = (now_s - job.last_token_s) / num_tokens  # a step's tokens arrive together
        gaps[gap_s, job.urgency.value] += num_tokens
    job.last_token_s = now_s


def record_gaps(t: Telemetry, gaps: Counter) -> None:
    """A step's inter-token gaps into the histogram: one observation per token (OpenTelemetry
    has no weighted record), but one attribute set per distinct gap (every job that was in the
    previous step has the same one), in one loop after the step's deltas rather than between
    each delta's other work. With the hand-built token map (schemas/codec.py) this took the
    event loop's time per token at W2 from 71.5 to 64.2 us (loadtest/bench_reply_path.py)."""
    for (gap_s, urgency), num_tokens in gaps.items():
        t.itl_s.record_many(gap_s, num_tokens, {"urgency": urgency})


def on_step(t: Telemetry, step: StepInfo) -> None:
    """Engine gauges and counters after a step."""
    t.step_s.record(step.duration_s)
    if step.stats is not None:
        t.observe_engine(step.stats)


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


def on_final(
    t: Telemetry, job: Job, finish_reason: str, timing: Timing, error_type: str | None = None
) -> None:
    """`error_type`: the final's error code when `finish_reason` is "error" (error.type)."""
    urgency = {"urgency": job.urgency.value}
    gen_ai = {**urgency, "gen_ai.operation.name": operation_of(job)}
    if error_type is not None:
        gen_ai["error.type"] = error_type
    t.requests_finished.add(1, {"finish_reason": finish_reason, **gen_ai})
    t.prompt_tokens.add(job.num_prompt_tokens)
    t.generated_tokens.add(job.num_output_tokens)
    t.e2e_s.record(timing.total_ms / 1000, gen_ai)
    if timing.ttft_ms is not None:  # by lane too: did the request come by its urgency lane?
        t.ttft_s.record(timing.ttft_ms / 1000, {**gen_ai, "lane": lane_of(job.partition)})
    if timing.batcher_ms is not None:
        t.queue_s.record(timing.batcher_ms / 1000, {"stage": "batcher", **urgency})
    if job.engine_queue_s is not None:
        t.queue_s.record(job.engine_queue_s, {"stage": "engine", **urgency})
    if job.prefill_s is not None:
        t.prefill_s.record(job.prefill_s, urgency)
    if timing.decode_ms is not None:
        t.decode_s.record(timing.decode_ms / 1000, urgency)
        if job.num_output_tokens > 1:
            t.tpot_s.record(timing.decode_ms / 1000 / (job.num_output_tokens - 1), gen_ai)


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
