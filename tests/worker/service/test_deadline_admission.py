"""Admission that knows deadlines: a request whose deadline cannot be met, given the prompts
ahead of it and the engine's step cost model, is answered `expired` when it is read, without
reaching the engine or taking a KV block. The cost model is pinned to a known, slow one (1 s a
step plus 100 ms a token), so the verdict does not depend on this machine's speed."""

from __future__ import annotations

import time

import pytest

from engine.step_cost import StepCostModel
from tests.worker.kafka_helpers import (
    SMALL_ENGINE,
    create_topic,
    fresh_topics,
    make_request,
    serving,
    worker_settings,
)
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka


class RecordingEngine:
    """The real engine with a pinned cost model; records every request it was given."""

    def __init__(self, engine) -> None:
        self._engine = engine
        engine.scheduler.cost_model = StepCostModel(1000.0, 100.0, 0.0)
        self.added: list[str] = []

    def add_request(self, request_id, *args, **kwargs):
        self.added.append(request_id)
        return self._engine.add_request(request_id, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def recording_factory(model_dir, engines: list):
    def build():
        from engine import LLMEngine

        engine = RecordingEngine(LLMEngine(str(model_dir), **SMALL_ENGINE))
        engines.append(engine)
        return engine

    return build


async def test_an_unreachable_deadline_is_expired_at_admission(broker, tiny_model_dir) -> None:
    """Guards against spending compute (and KV blocks) on a request that cannot make it: its
    prompt alone predicts well over 2 s to a first token against a deadline 2 s out. A request
    with room in its deadline is served as usual."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic, kafka={"num_partitions": 1}
    )
    engines: list = []
    worker = Worker(settings, engine_factory=recording_factory(tiny_model_dir, engines))
    async with serving(broker, worker, grace_s=30) as (producer, replies):
        now_ms = int(time.time() * 1000)
        doomed = make_request(
            replies.topic, "a prompt of some tokens " * 4, max_tokens=2,
            deadline_ms=now_ms + 2_000,
        )  # fmt: skip
        await producer.send(topic, doomed, urgency="critical")
        final = await replies.final_of(doomed.id)
        assert final.finish_reason == "expired"
        assert final.usage.completion_tokens == 0 and final.timing.ttft_ms is None
        engine = engines[0]
        assert engine.added == []  # never reached the engine
        stats = engine.get_stats()
        assert stats.num_blocks_free == stats.num_blocks_total and stats.num_tokens_computed == 0
        roomy = make_request(
            replies.topic, "hi", max_tokens=2, deadline_ms=int(time.time() * 1000) + 600_000
        )
        await producer.send(topic, roomy, urgency="critical")
        assert (await replies.final_of(roomy.id)).finish_reason in ("stop", "length")
        assert len(engine.added) == 1
