"""Duplicates: the same request delivered twice while its first delivery runs is generated once
by the worker (both offsets are committed with its final); delivered again after it finished, it
is answered again, consistently (the same tokens: the seed derives from the id)."""

from __future__ import annotations

import pytest

from tests.worker.kafka_helpers import (
    create_topic,
    fresh_topics,
    make_request,
    serving,
    slow_engine_factory,
    wait_for_commit,
    worker_settings,
)
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka


async def test_a_duplicate_while_running_is_not_generated_twice(broker, tiny_model_dir) -> None:
    """Guards against a producer retry (or a redelivery) of a running request costing a second
    generation on the same worker, and against its offset never being committed."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    # Static membership, so that the setting is exercised against the broker too.
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        kafka={"group_instance_id": "dup-worker-0"},
    )  # fmt: skip
    worker = Worker(settings, engine_factory=slow_engine_factory(tiny_model_dir, step_s=0.03))
    async with serving(broker, worker, grace_s=5) as (producer, replies):
        request = make_request(replies.topic, "twice", max_tokens=30, ignore_eos=True)
        await producer.send(topic, request)
        await producer.send(topic, request)  # the duplicate, while the first one runs
        first = await replies.final_of(request.id)
        committed = await wait_for_commit(
            broker.bootstrap_servers, group_id, topic, 1, lambda c: c[0] == 2
        )
        assert committed[0] == 2
        assert {m.attempt for m in replies.messages[request.id]} == {first.attempt}
        assert len(replies.finals(request.id)) == 1
        await producer.send(topic, request)  # once more, after it finished
        await replies.wait_until(lambda: len(replies.finals(request.id)) == 2)
        again = replies.finals(request.id)[1]
        assert again.attempt != first.attempt and again.text == first.text
        assert again.usage == first.usage and again.finish_reason == first.finish_reason
