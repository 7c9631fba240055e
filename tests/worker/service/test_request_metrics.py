"""What one request and the engine's steps put into the metrics, without Kafka: the gen_ai
attributes (operation, provider, model, error.type on errors), and the engine's cumulative
counters turned into increments from a start-up baseline (warm-up is not traffic)."""

from __future__ import annotations

import re
from types import SimpleNamespace

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
        num_fused_steps=0, num_fused_steps_one_thread=0,
    )  # fmt: skip
    return SimpleNamespace(**{**base, **counts})


def test_engine_counters_count_from_the_start_up_baseline() -> None:
    t = Telemetry(ObservabilitySettings(), "w", model_name="smol")
    t.observe_engine(stats(num_prefix_queries=40, num_prefix_hits=16, num_tokens_computed=64,
                           num_fused_steps=10, num_fused_steps_one_thread=2))  # fmt: skip
    t.observe_engine(
        stats(num_running=2, num_waiting=1, num_blocks_free=75, num_preemptions=1,
              num_prefix_queries=100, num_prefix_hits=46, num_tokens_computed=96,
              num_fused_steps=50, num_fused_steps_one_thread=12)
    )  # fmt: skip
    series = scrape(t)
    fused = {labels["threads"]: n for labels, n in series["mini_infer_engine_fused_steps_total"]}
    assert fused == {"all": 30, "one": 10}  # 40 steps since start-up, 10 of them on one thread

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
