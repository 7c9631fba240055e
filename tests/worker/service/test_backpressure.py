"""At `max_num_inflight` the consumer pauses instead of buffering; a stop finishes in-flight
work within the grace period and commits exactly what was answered."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaProducer

from schemas.codec import MSGPACK, encode
from schemas.headers import request_headers
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
from tests.worker.workers import running_worker

pytestmark = pytest.mark.kafka


async def test_inflight_limit_pauses_and_stop_drains_and_commits(broker, tiny_model_dir) -> None:
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        kafka={"num_partitions": 1}, limits={"max_num_inflight": 2},
    )  # fmt: skip
    factory = slow_engine_factory(tiny_model_dir, step_s=0.02)
    async with (
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
    ):
        # grace_s ample: whatever is in flight at the stop finishes
        async with running_worker(settings, factory, grace_s=30) as worker:
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


async def test_a_backlog_of_ten_thousand_keeps_memory_bounded_and_the_member_alive(
    broker, tiny_model_dir
) -> None:
    """Guards against memory growing with the backlog in Kafka (the byte budget is the bound
    here, below the count limit), and against a paused worker dropping out of its group (it must
    keep heartbeating past the session timeout) or dropping what it consumed."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    budget_bytes = 64 << 10
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic, kafka={"num_partitions": 1},
        limits={"max_inflight_bytes": budget_bytes, "max_message_bytes": 4096,
                "max_prompt_chars": 1000},
    )  # fmt: skip
    max_job_bytes = 4096 + 40 * 1000
    factory = slow_engine_factory(tiny_model_dir, step_s=0.05)
    async with ReplyReader(broker.bootstrap_servers) as replies:
        requests = [make_request(replies.topic, f"p{i}", max_tokens=2) for i in range(10_000)]
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap_servers, linger_ms=20)
        await producer.start()
        try:
            sends = [
                await producer.send(topic, encode(r, MSGPACK), key=r.id.encode(),
                                    headers=request_headers(MSGPACK))
                for r in requests
            ]  # fmt: skip
            await asyncio.gather(*sends)
        finally:
            await producer.stop()
        async with running_worker(settings, factory, grace_s=2) as worker:
            assignment = worker.consumer.assignment
            peak_bytes = peak_unfinished = 0
            was_paused = False
            observe_until_s = time.monotonic() + 8.0  # past the 6 s session timeout
            while time.monotonic() < observe_until_s:
                peak_bytes = max(peak_bytes, worker.pipeline.inflight_bytes)
                peak_unfinished = max(peak_unfinished, worker.tracker.num_unfinished)
                was_paused |= worker.consumer.is_paused
                assert worker.consumer.assignment == assignment  # never thrown out
                await asyncio.sleep(0.02)
        # Everything the worker sent is flushed now; a marker shows the reader has read it all.
        async with Producer(broker.bootstrap_servers) as marker:
            await marker.send(replies.topic, make_request(replies.topic, id="end-marker"))
        await replies.wait_until(lambda: "end-marker" in replies.raw_ids, what="the end marker")
    assert was_paused and 0 < peak_bytes <= budget_bytes + max_job_bytes
    assert peak_unfinished < 1000  # far below the backlog: read as it is answered
    answered = [r for r in requests if replies.finals(r.id)]
    assert answered == requests[: len(answered)] and answered  # in order, none skipped
    committed = await committed_offsets(broker.bootstrap_servers, group_id, topic, 1)
    assert committed[0] == len(answered)
