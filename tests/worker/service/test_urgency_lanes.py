"""Urgency lanes against the real broker: a critical request sent to its lane is read and
admitted ahead of a backlog of low requests on the base topic, and under backpressure the base
topic pauses first, the critical lane last.

The engine is gated: its steps wait until the test opens the gate, so "still in flight" is a
fact, not a race, and the order in which requests reach the engine is recorded."""

from __future__ import annotations

import threading

import pytest

from schemas.contract import request_topic_for
from tests.worker.kafka_helpers import (
    SMALL_ENGINE,
    create_topic,
    fresh_topics,
    make_request,
    serving,
    wait_for,
    worker_settings,
)
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka


class GatedEngine:
    """The real engine; records the order of `add_request`, and computes only once `gate` is
    set."""

    def __init__(self, engine, gate: threading.Event) -> None:
        self._engine = engine
        self._gate = gate
        self.added: list[str] = []  # attempt ids, in admission order

    def add_request(self, request_id, *args, **kwargs):
        self.added.append(request_id)
        return self._engine.add_request(request_id, *args, **kwargs)

    def step(self):
        # Closed: a step that computes nothing (the engine thread still takes new requests).
        if not self._gate.wait(0.01):
            return []
        return self._engine.step()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def gated_factory(model_dir, gate: threading.Event, engines: list):
    def build():
        from engine import LLMEngine

        engine = GatedEngine(LLMEngine(str(model_dir), **SMALL_ENGINE), gate)
        engines.append(engine)
        return engine

    return build


def paused_topics(worker: Worker) -> set[str]:
    return {p.topic for p in worker.consumer._consumer.paused()}


async def test_a_critical_lane_request_overtakes_a_low_backlog(broker, tiny_model_dir) -> None:
    """Guards against a critical request waiting behind a backlog in Kafka: 20 low requests
    wait on the base topic before the worker starts, and the worker may hold only 4. The two
    critical requests on the critical lane still reach the engine while the 16 other low ones
    wait, paused, in Kafka."""
    topic, group_id = fresh_topics()
    critical_topic = request_topic_for("critical", topic)
    for name in (topic, critical_topic, request_topic_for("high", topic)):
        await create_topic(broker.bootstrap_servers, name, 1)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic, kafka={"num_partitions": 1},
        limits={"max_num_inflight": 4, "num_urgent_reserve": 4},
    )  # fmt: skip
    gate, engines = threading.Event(), []
    worker = Worker(settings, engine_factory=gated_factory(tiny_model_dir, gate, engines))
    async with serving(broker, worker, grace_s=30) as (producer, replies):
        try:
            lows = [make_request(replies.topic, f"low {i}", max_tokens=2) for i in range(20)]
            for request in lows:
                await producer.send(topic, request, urgency="low")
            await wait_for(lambda: worker.tracker.num_unfinished == 4, what="4 lows read")
            await wait_for(lambda: topic in paused_topics(worker), what="the base topic paused")
            criticals = [make_request(replies.topic, f"urgent {i}", max_tokens=2) for i in range(2)]
            for request in criticals:
                await producer.send(critical_topic, request, urgency="critical")
            engine = engines[0]
            critical_ids = {c.id for c in criticals}
            await wait_for(
                lambda: critical_ids <= set(admitted_ids(worker, engine)),
                what="both criticals in the engine",
            )
            admitted = admitted_ids(worker, engine)
            # At most the 4 lows read before the pause went ahead; 16 still wait in Kafka.
            assert sum(1 for r in lows if r.id in admitted) <= 4
            assert topic in paused_topics(worker) and critical_topic not in paused_topics(worker)
        finally:
            gate.set()
        for request in [*criticals, *lows]:
            assert (await replies.final_of(request.id)).finish_reason in ("stop", "length")


def admitted_ids(worker: Worker, engine: GatedEngine) -> list[str]:
    """Request ids in the order the engine received them (of jobs still in flight)."""
    ids = {j.attempt: j.request_id for j in worker.pipeline.active_jobs()}
    return [ids[a] for a in list(engine.added) if a in ids]


async def test_lanes_pause_in_reverse_urgency_order(broker, tiny_model_dir) -> None:
    """The base topic pauses at `max_num_inflight`, the high lane half the reserve later, the
    critical lane at the whole reserve; with the gate open they all resume."""
    topic, group_id = fresh_topics()
    high_topic, critical_topic = (
        request_topic_for("high", topic),
        request_topic_for("critical", topic),
    )
    for name in (topic, critical_topic, high_topic):
        await create_topic(broker.bootstrap_servers, name, 1)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic, kafka={"num_partitions": 1},
        limits={"max_num_inflight": 2, "num_urgent_reserve": 2},
    )  # fmt: skip
    gate, engines = threading.Event(), []
    worker = Worker(settings, engine_factory=gated_factory(tiny_model_dir, gate, engines))
    async with serving(broker, worker, grace_s=30) as (producer, replies):
        try:
            sent = []
            for i in range(2):
                sent.append(make_request(replies.topic, f"low {i}", max_tokens=2))
                await producer.send(topic, sent[-1], urgency="low")
            await wait_for(lambda: topic in paused_topics(worker), what="the base topic paused")
            assert paused_topics(worker) == {topic}
            sent.append(make_request(replies.topic, "high", max_tokens=2))
            await producer.send(high_topic, sent[-1], urgency="high")
            await wait_for(lambda: high_topic in paused_topics(worker), what="the high lane paused")
            assert paused_topics(worker) == {topic, high_topic}
            sent.append(make_request(replies.topic, "critical", max_tokens=2))
            await producer.send(critical_topic, sent[-1], urgency="critical")
            await wait_for(lambda: critical_topic in paused_topics(worker), what="all paused")
            assert worker.tracker.num_unfinished == 4
        finally:
            gate.set()
        for request in sent:
            await replies.final_of(request.id)
        await wait_for(lambda: not paused_topics(worker), what="every lane resumed")
