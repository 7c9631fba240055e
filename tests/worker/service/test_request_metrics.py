"""What one request and the engine's steps put into the metrics, without Kafka: the gen_ai
attributes (operation, provider, model, error.type on errors), and the engine's cumulative
counters turned into increments from a start-up baseline (warm-up is not traffic)."""

from __future__ import annotations

import re
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from schemas.headers import Urgency
from schemas.messages import Timing
from worker.service import request_metrics
from worker.service.settings import ObservabilitySettings
from worker.service.telemetry import Telemetry


def scrape(t: Telemetry) -> dict[str, list[tuple[dict[str, str], float]]]:
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in generate_latest(t.prometheus_registry).decode().splitlines():
        if line and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            name, _, labels = head.partition("{")
            series.setdefault(name, []).append(
                (dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value))
            )
    return series


def job(messages: list | None) -> SimpleNamespace:
    request = SimpleNamespace(messages=messages)
    return SimpleNamespace(
        urgency=Urgency.HIGH, request=request, num_prompt_tokens=5, num_output_tokens=3,
        engine_queue_s=None, prefill_s=None,
    )  # fmt: skip


def test_a_failed_chat_request_carries_the_gen_ai_attributes_and_its_error_type() -> None:
    t = Telemetry(ObservabilitySettings(), "w", model_name="smol")
    timing = Timing(queued_ms=1.0, ttft_ms=None, total_ms=20.0)
    request_metrics.on_final(
        t, job([{"role": "user", "content": "x"}]), "error", timing, "internal"
    )
    request_metrics.on_final(t, job(None), "length", timing)
    series = scrape(t)
    finished = {
        labels["finish_reason"]: labels
        for labels, _ in series["mini_infer_requests_finished_total"]
    }
    assert finished["error"]["error_type"] == "internal"
    assert finished["error"]["gen_ai_operation_name"] == "chat"
    assert finished["length"].get("error_type", "") == ""  # Prometheus: a missing label is ""
    assert finished["length"]["gen_ai_operation_name"] == "text_completion"
    for labels in finished.values():
        assert labels["gen_ai_provider_name"] == "mini_infer"
        assert labels["gen_ai_request_model"] == "smol" and labels["urgency"] == "high"
    durations = [labels for labels, _ in series["gen_ai_server_request_duration_seconds_count"]]
    assert {d.get("error_type", "") for d in durations} == {"internal", ""}


def stats(**counts) -> SimpleNamespace:
    base = dict(
        num_running=0, num_waiting=0, num_blocks_total=100, num_blocks_free=100,
        num_preemptions=0, num_prefix_queries=0, num_prefix_hits=0, num_tokens_computed=0,
        num_fused_steps=0, num_fused_steps_one_thread=0, fused_step_gil_wait_s=0.0,
        num_draft_tokens=0, num_draft_accepted=0,
    )  # fmt: skip
    return SimpleNamespace(**{**base, **counts})


def test_engine_counters_count_from_the_start_up_baseline() -> None:
    t = Telemetry(ObservabilitySettings(), "w", model_name="smol")
    t.observe_engine(stats(num_prefix_queries=40, num_prefix_hits=16, num_tokens_computed=64,
                           num_fused_steps=10, num_fused_steps_one_thread=2,
                           fused_step_gil_wait_s=0.25, num_draft_tokens=20,
                           num_draft_accepted=18))  # fmt: skip
    t.observe_engine(
        stats(num_running=2, num_waiting=1, num_blocks_free=75, num_preemptions=1,
              num_prefix_queries=100, num_prefix_hits=46, num_tokens_computed=96,
              num_fused_steps=50, num_fused_steps_one_thread=12, fused_step_gil_wait_s=0.375,
              num_draft_tokens=60, num_draft_accepted=50)
    )  # fmt: skip
    series = scrape(t)
    fused = {labels["threads"]: n for labels, n in series["mini_infer_engine_fused_steps_total"]}
    assert fused == {"all": 30, "one": 10}  # 40 steps since start-up, 10 of them on one thread
    [(_, gil_wait)] = series["mini_infer_engine_gil_wait_seconds_total"]
    assert gil_wait == pytest.approx(0.125)  # waited for the GIL since start-up
    drafts = {labels["accepted"]: n for labels, n in series["mini_infer_engine_draft_tokens_total"]}
    assert drafts == {"true": 32, "false": 8}  # 40 drafted since start-up, 32 kept

    def value(name: str) -> float:
        ((labels, number),) = series[name]
        assert labels["gen_ai_request_model"] == "smol"
        return number

    assert value("mini_infer_prefix_cache_queries_total") == 60  # not the warm-up's 40
    assert value("mini_infer_prefix_cache_hits_total") == 30
    assert value("mini_infer_engine_preemptions_total") == 1
    assert value("mini_infer_engine_step_tokens_sum") == 32
    assert value("mini_infer_engine_requests_running") == 2
    assert value("mini_infer_engine_requests_waiting") == 1
    assert value("mini_infer_kv_cache_blocks_used") == 25
    assert value("mini_infer_kv_cache_usage") == 0.25


# A step: ms since the previous one, and its deltas as (job index, number of tokens).
STEPS = st.lists(
    st.tuples(
        st.integers(1, 300), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=6)
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(steps=STEPS)
def test_a_steps_gaps_are_recorded_once_per_token_as_per_delta_recording_did(steps) -> None:
    """Each step's deltas (job, tokens) counted into one `gaps` and recorded after the step
    give the histogram what one record per token, delta by delta, gave: the same count, sum
    and buckets, by urgency. A job's first tokens have no gap; a delta of n tokens is n gaps
    of (time since the job's last tokens) / n."""
    t = Telemetry(ObservabilitySettings(), "w", model_name="smol")
    jobs = [
        SimpleNamespace(urgency=urgency, first_token_s=None, last_token_s=None)
        for urgency in (Urgency.NORMAL, Urgency.HIGH, Urgency.NORMAL, Urgency.CRITICAL,
                        Urgency.NORMAL, Urgency.HIGH)
    ]  # fmt: skip
    expected: dict[str, list[float]] = {}
    last_s: dict[int, float] = {}
    now_s = 100.0
    for step_ms, deltas in steps:
        now_s += step_ms / 1000
        gaps: Counter = Counter()
        for index, num_tokens in deltas:
            request_metrics.on_tokens(jobs[index], num_tokens, now_s, gaps)
            if num_tokens > 0:  # the reference: one observation per token
                if index in last_s:
                    gap_s = (now_s - last_s[index]) / num_tokens
                    expected.setdefault(jobs[index].urgency.value, []).extend([gap_s] * num_tokens)
                last_s[index] = now_s
        request_metrics.record_gaps(t, gaps)
    series = scrape(t)
    counts = {
        labels["urgency"]: n
        for labels, n in series.get("mini_infer_inter_token_latency_seconds_count", [])
    }  # fmt: skip
    sums = {
        labels["urgency"]: n
        for labels, n in series.get("mini_infer_inter_token_latency_seconds_sum", [])
    }  # fmt: skip
    assert counts == {urgency: len(gaps) for urgency, gaps in expected.items()}
    for urgency, gaps in expected.items():
        assert sums[urgency] == pytest.approx(sum(gaps))
    for labels, n in series.get("mini_infer_inter_token_latency_seconds_bucket", []):
        le = float(labels["le"])  # "+Inf" parses to inf
        assert n == sum(1 for gap_s in expected[labels["urgency"]] if gap_s <= le)


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(
        st.tuples(st.integers(1, 40), st.booleans()),  # (steps before it, scrape after it)
        min_size=1, max_size=12,
    ),  # fmt: skip
    max_pending=st.integers(1, 50),
)
def test_deferred_histograms_show_every_measurement_once_at_every_scrape(
    batches, max_pending
) -> None:
    """The per-step and per-token histograms hand their measurements to the SDK at each
    collection (or every MAX_PENDING, where nothing collects): whatever the interleaving, a
    scrape counts every measurement made before it, once, and the pending ones stay bounded."""
    t = Telemetry(ObservabilitySettings(), "w", model_name="smol")
    t.deferred.MAX_PENDING = max_pending
    num_steps = num_gaps = 0
    for steps, scrape_after in batches:
        for _ in range(steps):
            t.step_s.record(0.01)
            t.itl_s.record_many(0.02, 3, {"urgency": "normal"})
            num_steps += 1
            num_gaps += 3
            assert len(t.deferred._pending) <= max_pending
        if scrape_after:
            series = scrape(t)
            assert series["mini_infer_engine_step_duration_seconds_count"][0][1] == num_steps
            [(labels, count)] = series["mini_infer_inter_token_latency_seconds_count"]
            assert (labels["urgency"], count) == ("normal", num_gaps)
    series = scrape(t)
    assert series["mini_infer_engine_step_duration_seconds_sum"][0][1] == pytest.approx(
        0.01 * num_steps
    )
