"""A failing engine step fails only what it can be pinned on; a persistent fault stops the
worker without answering (or committing) anything more.

The real worker, broker and tiny engine, wrapped so that `step` raises while a marked request
(max_tokens == 13) is in the engine, or always.
"""

from __future__ import annotations

import asyncio

import pytest

from schemas.messages import ErrorCode
from tests.worker.kafka_helpers import (
    SMALL_ENGINE,
    Producer,
    ReplyReader,
    committed_offsets,
    create_topic,
    fresh_topics,
    make_request,
    serving,
    stream_of,
    wait_for_commit,
    worker_settings,
)
from tests.worker.workers import running_worker
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka

POISON_MAX_TOKENS = 13


class FaultyEngine:
    """The real engine; `step` raises while a marked request is in it (or always)."""

    def __init__(self, engine, always: bool) -> None:
        self._engine = engine
        self._always = always
        self._marked: set[str] = set()

    def add_request(self, request_id, prompt, params, priority=0):
        self._engine.add_request(request_id, prompt, params, priority=priority)
        if params.max_tokens == POISON_MAX_TOKENS:
            self._marked.add(request_id)

    def abort_request(self, request_id):
        self._marked.discard(request_id)
        return self._engine.abort_request(request_id)

    def step(self):
        if self._always or self._marked:
            raise RuntimeError("injected step fault")
        return self._engine.step()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def faulty_engine_factory(model_dir, always: bool = False):
    def build():
        from engine import LLMEngine

        return FaultyEngine(LLMEngine(str(model_dir), **SMALL_ENGINE), always)

    return build


async def test_one_request_breaking_steps_fails_alone_and_its_neighbours_finish(
    broker, tiny_model_dir
) -> None:
    """Guards against a step failure giving every live request a committed error final."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(tiny_model_dir, broker.bootstrap_servers, group_id, topic)
    worker = Worker(settings, engine_factory=faulty_engine_factory(tiny_model_dir))
    async with serving(broker, worker, grace_s=5) as (producer, replies):
        neighbours = [
            make_request(replies.topic, f"n {i}", max_tokens=8, ignore_eos=True) for i in range(5)
        ]
        poison = make_request(replies.topic, "poison", max_tokens=POISON_MAX_TOKENS)
        for request in [*neighbours[:3], poison, *neighbours[3:]]:
            await producer.send(topic, request, urgency="low")  # one release batch
        final = await replies.final_of(poison.id)
        assert final.finish_reason == "error" and final.error.code == ErrorCode.INTERNAL
        for request in neighbours:
            final = await replies.final_of(request.id)
            assert final.finish_reason == "length" and final.usage.completion_tokens == 8
            # The answering attempt's stream is whole (a restart opened a new attempt).
            stream = stream_of(replies, request.id, final.attempt)
            assert [m.seq for m in stream] == list(range(len(stream)))
            assert "".join(m.text for m in stream[:-1]) == final.text
        committed = await wait_for_commit(
            broker.bootstrap_servers, group_id, topic, 1, lambda c: c[0] == 6
        )
        assert committed[0] == 6 and not worker.failed.is_set()


async def test_a_persistent_engine_fault_stops_the_worker_and_commits_nothing(
    broker, tiny_model_dir
) -> None:
    """Guards against a broken engine turning the whole topic into committed error finals:
    the worker fails (serve exits non-zero) and the requests stay for a healthy worker."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        limits={"max_consecutive_step_failures": 3},
    )  # fmt: skip
    factory = faulty_engine_factory(tiny_model_dir, always=True)
    async with (
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
    ):
        async with running_worker(settings, factory) as worker:
            requests = [make_request(replies.topic, f"r {i}") for i in range(4)]
            for request in requests:
                await producer.send(topic, request, urgency="low")
            await asyncio.wait_for(worker.failed.wait(), 30)
        assert not any(replies.finals(r.id) for r in requests)
    committed = await committed_offsets(broker.bootstrap_servers, group_id, topic, 1)
    assert committed[0] in (None, 0)
