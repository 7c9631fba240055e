"""At `max_num_inflight` the consumer pauses instead of buffering; a stop finishes in-flight
work within the grace period and commits exactly what was answered."""

from __future__ import annotations

import asyncio

import pytest

from tests.worker.kafka_helpers import (
    Producer,
    ReplyReader,
    committed_offsets,
    create_topic,
    fresh_topics,
    make_request,
    slow_engine_factory,
    worker_settings,
)
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka


async def test_inflight_limit_pauses_and_stop_drains_and_commits(broker, tiny_model_dir) -> None:
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        kafka={"num_partitions": 1}, limits={"max_num_inflight": 2},
    )  # fmt: skip
    worker = Worker(settings, engine_factory=slow_engine_factory(tiny_model_dir, step_s=0.02))
    async with (
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
    ):
        await worker.start()
        try:
            await worker.wait_assigned()
            requests = [
                make_request(replies.topic, f"p{i}", max_tokens=25, ignore_eos=True)
                for i in range(6)
            ]
            for request in requests:
                await producer.send(topic, request)
            max_num_inflight, was_paused = 0, False
            while sum(1 for r in requests if replies.finals(r.id)) < 2:
                max_num_inflight = max(max_num_inflight, worker.tracker.num_unfinished)
                was_paused |= worker.consumer.is_paused
                await asyncio.sleep(0.005)
        finally:
            await worker.stop(grace_s=30)  # ample: whatever is in flight finishes
        # Everything the worker sent is flushed now; a marker shows the reader has read it all.
        await producer.send(replies.topic, make_request(replies.topic, id="end-marker"))
        await replies.wait_until(lambda: "end-marker" in replies.raw_ids, what="the end marker")
        assert max_num_inflight <= 2 and was_paused
        answered = [r for r in requests if replies.finals(r.id)]
        # Answered in order on one partition, and the commit covers exactly those.
        assert answered == requests[: len(answered)] and len(answered) < len(requests)
        assert all(len(replies.finals(r.id)) == 1 for r in answered)
        committed = await committed_offsets(broker.bootstrap_servers, group_id, topic, 1)
        assert committed[0] == len(answered)
