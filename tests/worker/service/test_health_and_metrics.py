"""What an operator sees: health probes, Prometheus metrics and traces of a real worker on the
embedded broker. Guards against probes that say ready while the worker serves nothing (or alive
while its engine is stuck), metric names or labels that dashboards rely on changing silently,
and a producer's trace that stops at the worker."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.worker.kafka_helpers import (
    Producer,
    ReplyReader,
    create_topic,
    fresh_topics,
    make_request,
    worker_settings,
)
from tests.worker.workers import running_worker
from worker.client import ClientOptions, MiniInferClient
from worker.service.telemetry import Telemetry
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


async def get(worker: Worker, path: str) -> tuple[int, str]:
    return await asyncio.to_thread(fetch, f"http://127.0.0.1:{worker.health.port}{path}")


async def wait_for_status(worker: Worker, path: str, status: int, timeout_s: float = 30.0) -> str:
    deadline_s = time.monotonic() + timeout_s
    while True:
        code, body = await get(worker, path)
        if code == status:
            return body
        assert time.monotonic() < deadline_s, f"{path} stayed {code}: {body}"
        await asyncio.sleep(0.1)


async def test_ready_means_started_and_able_to_work_not_holding_partitions(
    broker, tiny_model_dir, tmp_path
) -> None:
    """One partition, two workers: the one without a partition is ready all the same (a surge
    pod in a rollout with replicas = partitions), and stopping makes a worker unready."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    ready_file = tmp_path / "ready.json"
    workers = [
        Worker(worker_settings(
            tiny_model_dir, broker.bootstrap_servers, group_id, topic, worker_id=name,
            kafka={"urgency_lanes": False},  # one partition in all: no lane partitions to share
            observability={"health_port": 0, "ready_file": ready_file if name == "a" else None},
        ))  # fmt: skip
        for name in ("a", "b")
    ]
    for worker in workers:
        await worker.start()
    try:
        deadline_s = time.monotonic() + 60
        while True:
            holders = [w for w in workers if w.consumer.assignment]
            idle = [w for w in workers if not w.consumer.assignment]
            if len(holders) == 1:
                code, body = await get(idle[0], "/readyz")
                if code == 200:
                    break
            assert time.monotonic() < deadline_s, f"no worker ready without a partition: {body}"
            await asyncio.sleep(0.1)
        assert '"consumer_running": true' in body and '"broker_reachable": true' in body
        assert "partitions_assigned" not in body
        assert not idle[0].consumer.assignment  # still none: ready without one
        first = workers[0]
        await wait_for_status(first, "/readyz", 200)
        assert ready_file.exists() and (await get(first, "/healthz"))[0] == 200
        # The ready file names the port a health_port of 0 was bound to.
        assert json.loads(ready_file.read_text())["health_port"] == first.health.port > 0
        assert (await get(first, "/nope"))[0] == 404
        first.health.set_ready(False)  # stopping: no longer ready, still alive
        assert (await get(first, "/readyz"))[0] == 503
        assert (await get(first, "/healthz"))[0] == 200
    finally:
        for worker in workers:
            await worker.stop(grace_s=1)
    assert not ready_file.exists()


class StuckEngine:
    """The real engine, whose steps block while `stuck` is set: a hung kernel, say."""

    def __init__(self, engine, stuck: threading.Event, release: threading.Event) -> None:
        self._engine, self._stuck, self._release = engine, stuck, release

    def step(self):
        if self._stuck.is_set():
            self._release.wait(30)
        return self._engine.step()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


async def test_liveness_fails_while_the_engine_thread_is_stuck(broker, tiny_model_dir) -> None:
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        observability={"health_port": 0, "engine_stall_s": 0.5},
    )  # fmt: skip
    stuck, release = threading.Event(), threading.Event()

    def build():
        from engine import LLMEngine

        return StuckEngine(LLMEngine(str(tiny_model_dir), **settings.engine.__dict__), stuck, release)

    worker = Worker(settings, engine_factory=build)
    await worker.start()
    try:
        await worker.wait_assigned()
        async with Producer(broker.bootstrap_servers) as producer, ReplyReader(
            broker.bootstrap_servers
        ) as replies:
            assert (await get(worker, "/healthz"))[0] == 200  # idle is not stuck
            stuck.set()
            request = make_request(replies.topic, max_tokens=4)
            await producer.send(topic, request)
            body = await wait_for_status(worker, "/healthz", 503)
            assert '"engine_thread": false' in body
            release.set()  # the step returns: alive again, and the request is answered
            await wait_for_status(worker, "/healthz", 200)
            assert (await replies.final_of(request.id)).finish_reason == "length"
    finally:
        release.set()
        await worker.stop(grace_s=1)


async def test_metrics_and_a_producer_trace_through_the_worker(broker, tiny_model_dir) -> None:
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        observability={"health_port": 0, "kafka_sample_interval_s": 0.2},
    )  # fmt: skip
    worker_spans = InMemorySpanExporter()
    telemetry = Telemetry(
        settings.observability, "w-metrics", [SimpleSpanProcessor(worker_spans)],
        model_name="tiny", group_id=group_id,
    )  # fmt: skip
    # The producer's own tracer: the client SDK starts a `send` span and injects traceparent.
    client_spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(client_spans))
    options = ClientOptions(
        request_topic=topic, control_topic=settings.kafka.control_topic,
        tracer=provider.get_tracer("test-producer"),
    )  # fmt: skip
    async with running_worker(settings, telemetry=telemetry, grace_s=1) as worker:
        async with MiniInferClient(broker.bootstrap_servers, options) as client:
            results = await asyncio.gather(
                client.generate(prompt="Hello there", max_tokens=6, temperature=0.0),
                client.generate(
                    messages=[{"role": "user", "content": "Kafka"}], max_tokens=5,
                    temperature=0.0, urgency="high",
                ),  # fmt: skip
            )
        assert [r.finish_reason for r in results] == ["length", "length"]
        timing = results[0].timing
        assert timing.batcher_ms is not None and timing.prefill_ms is not None
        assert timing.decode_ms is not None and timing.engine_queue_ms is not None
        await asyncio.sleep(0.5)  # one Kafka gauge sample
        code, text = await get(worker, "/metrics")
    assert code == 200
    lines = text.splitlines()

    def samples(name: str) -> list[str]:
        return [line for line in lines if line.startswith(name)]

    finished = samples("mini_infer_requests_finished_total{")
    assert any('finish_reason="length"' in s and 'urgency="normal"' in s for s in finished)
    assert any('urgency="high"' in s for s in finished)
    for histogram in (
        "gen_ai_server_time_to_first_token_seconds_bucket",
        "gen_ai_server_time_per_output_token_seconds_bucket",
        "gen_ai_server_request_duration_seconds_bucket",
        "mini_infer_inter_token_latency_seconds_bucket",
        "mini_infer_request_prefill_time_seconds_bucket",
        "mini_infer_request_decode_time_seconds_bucket",
    ):
        assert samples(histogram), histogram
    stages = {s.split('stage="')[1].split('"')[0] for s in samples("mini_infer_request_queue_time")}
    assert {"kafka", "batcher", "engine"} <= stages
    for gauge in (
        "mini_infer_engine_requests_running", "mini_infer_engine_requests_waiting",
        "mini_infer_kv_cache_blocks_used", "mini_infer_kv_cache_blocks_total",
        "mini_infer_kv_cache_usage", "mini_infer_prefix_cache_queries_total",
        "mini_infer_prefix_cache_hits_total",
        "mini_infer_consumer_partitions_paused", "mini_infer_consumer_partitions_assigned",
        "mini_infer_tokens_prompt_total", "mini_infer_tokens_generated_total",
        "mini_infer_engine_step_tokens", "messaging_kafka_consumer_lag",
    ):  # fmt: skip
        assert samples(gauge), gauge
    assert any('messaging_destination_partition_id="0"' in s for s in samples("messaging_kafka_consumer_lag"))
    lag = samples("messaging_kafka_consumer_lag")
    assert all(f'messaging_consumer_group_name="{group_id}"' in s for s in lag)
    # Every sample names the model; the gen_ai ones their operation and provider too.
    metric_samples = [line for line in lines if line and not line.startswith(("#", "target_info"))]
    assert metric_samples and all('gen_ai_request_model="tiny"' in s for s in metric_samples)
    for s in finished + samples("gen_ai_server_request_duration_seconds_count"):
        assert 'gen_ai_provider_name="mini_infer"' in s
    operations = {s.split('gen_ai_operation_name="')[1].split('"')[0] for s in finished}
    assert operations == {"chat", "text_completion"}
    queries = samples("mini_infer_prefix_cache_queries_total")
    assert float(queries[0].rsplit(" ", 1)[1]) > 0  # two prompts were looked up

    # The trace: client send span -> worker process span (child, and linked) -> stage spans.
    sends = [s for s in client_spans.get_finished_spans() if s.kind is SpanKind.PRODUCER]
    # Each to its urgency's topic: `high` by its lane (contract v1.2).
    assert sorted(s.name for s in sends) == [f"send {topic}", f"send {topic}.high"]
    processes = [s for s in worker_spans.get_finished_spans() if s.kind is SpanKind.CONSUMER]
    assert len(processes) == 2
    for process in processes:
        send = next(s for s in sends if s.context.span_id == process.parent.span_id)
        assert process.context.trace_id == send.context.trace_id
        assert [link.context.span_id for link in process.links] == [send.context.span_id]
        stages = {
            s.name for s in worker_spans.get_finished_spans()
            if s.parent is not None and s.parent.span_id == process.context.span_id
        }  # fmt: skip
        assert {"batcher wait", "engine queue", "prefill", "decode", "publish"} <= stages


async def test_an_idle_worker_scrape_shows_its_gauges_with_the_model_label(
    broker, tiny_model_dir, monkeypatch
) -> None:
    """No request ever: the engine, KV-cache and partition gauges and the prefix-cache counters
    are there all the same (observable gauges, counters started at 0), with the model label,
    the consumer group, and the service name from OTEL_SERVICE_NAME."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", "inference-east")
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 2)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        kafka={"urgency_lanes": False},  # the two partitions of the request topic only
        observability={"health_port": 0, "kafka_sample_interval_s": 0.1},
    )  # fmt: skip
    async with running_worker(settings, grace_s=1) as worker:
        deadline_s = time.monotonic() + 30
        while True:  # the Kafka sampler's first look after the assignment
            code, text = await get(worker, "/metrics")
            if 'mini_infer_consumer_partitions_assigned{' in text and "} 2.0" in text:
                break
            assert time.monotonic() < deadline_s, text
            await asyncio.sleep(0.1)
    assert code == 200
    values: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            values.setdefault(name, []).append((labels, float(value)))
    model = f'gen_ai_request_model="{tiny_model_dir}"'

    def only(name: str) -> tuple[str, float]:
        (sample,) = values[name]
        assert model in sample[0], sample
        return sample

    assert only("mini_infer_kv_cache_blocks_total")[1] > 0  # known before any step
    assert only("mini_infer_kv_cache_blocks_used")[1] == 0
    assert only("mini_infer_kv_cache_usage")[1] == 0
    assert only("mini_infer_engine_requests_running")[1] == 0
    assert only("mini_infer_engine_requests_waiting")[1] == 0
    assert only("mini_infer_requests_inflight")[1] == 0
    assert only("mini_infer_prefix_cache_queries_total")[1] == 0  # warm-up is not traffic
    assert only("mini_infer_prefix_cache_hits_total")[1] == 0
    assert only("mini_infer_engine_preemptions_total")[1] == 0
    assigned = only("mini_infer_consumer_partitions_assigned")
    assert assigned[1] == 2 and f'messaging_consumer_group_name="{group_id}"' in assigned[0]
    assert only("mini_infer_consumer_partitions_paused")[1] == 0
    # (No lag series yet: an empty partition has no position to measure it from.)
    (target,) = values["target_info"]
    assert 'service_name="inference-east"' in target[0]
