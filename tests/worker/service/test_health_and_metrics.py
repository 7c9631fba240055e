"""What an operator sees: health probes, Prometheus metrics and traces of a real worker on the
embedded broker. Guards against probes that say ready while the worker serves nothing (or alive
while its engine is stuck), metric names or labels that dashboards rely on changing silently,
and a producer's trace that stops at the worker."""

from __future__ import annotations

import asyncio
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


async def test_readiness_follows_assignment_and_the_ready_file(
    broker, tiny_model_dir, tmp_path
) -> None:
    topic, group_id = fresh_topics()
    ready_file = tmp_path / "ready.json"
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        observability={"health_port": 0, "ready_file": ready_file},
    )  # fmt: skip
    worker = Worker(settings)
    await worker.start()
    try:
        # Joining the group takes seconds: until then the worker is alive but serves nothing.
        if not worker.consumer.assignment:
            code, body = await get(worker, "/readyz")
            assert code == 503 and '"partitions_assigned": false' in body
        assert (await get(worker, "/healthz"))[0] == 200
        await worker.wait_assigned()
        body = await wait_for_status(worker, "/readyz", 200)
        assert '"broker_reachable": true' in body and ready_file.exists()
        assert (await get(worker, "/nope"))[0] == 404
        worker.health.set_ready(False)  # stopping: no longer ready, still alive
        assert (await get(worker, "/readyz"))[0] == 503
        assert (await get(worker, "/healthz"))[0] == 200
    finally:
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
    telemetry = Telemetry(settings.observability, "w-metrics", [SimpleSpanProcessor(worker_spans)])
    worker = Worker(settings, telemetry=telemetry)
    await worker.start()
    # The producer's own tracer: the client SDK starts a `send` span and injects traceparent.
    client_spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(client_spans))
    options = ClientOptions(
        request_topic=topic, control_topic=settings.kafka.control_topic,
        tracer=provider.get_tracer("test-producer"),
    )  # fmt: skip
    try:
        await worker.wait_assigned()
        async with MiniInferClient(broker.bootstrap_servers, options) as client:
            results = await asyncio.gather(
                client.generate(prompt="Hello there", max_tokens=6, temperature=0.0),
                client.generate(prompt="Kafka", max_tokens=5, temperature=0.0, urgency="high"),
            )
        assert [r.finish_reason for r in results] == ["length", "length"]
        timing = results[0].timing
        assert timing.batcher_ms is not None and timing.prefill_ms is not None
        assert timing.decode_ms is not None and timing.engine_queue_ms is not None
        await asyncio.sleep(0.5)  # one Kafka gauge sample
        code, text = await get(worker, "/metrics")
    finally:
        await worker.stop(grace_s=1)
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
        "mini_infer_kv_cache_usage", "mini_infer_prefix_cache_hit_rate",
        "mini_infer_consumer_partitions_paused", "mini_infer_consumer_partitions_assigned",
        "mini_infer_tokens_prompt_total", "mini_infer_tokens_generated_total",
        "mini_infer_engine_step_tokens", "messaging_kafka_consumer_lag",
    ):  # fmt: skip
        assert samples(gauge), gauge
    assert any('messaging_destination_partition_id="0"' in s for s in samples("messaging_kafka_consumer_lag"))

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
