"""Cancels and deadlines reach a request wherever it is (decoding, waiting in the engine, held
in the batcher) on every worker of the group, and free its KV blocks."""

from __future__ import annotations

import time

import pytest

from tests.worker.kafka_helpers import (
    SMALL_ENGINE,
    Producer,
    ReplyReader,
    SlowEngine,
    create_topic,
    fresh_topics,
    make_request,
    wait_for,
    worker_settings,
)
from tests.worker.workers import running_workers
from worker.client import ClientOptions, MiniInferClient
from worker.service.job import JobState
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka

NUM_PARTITIONS = 2


async def test_cancels_and_deadlines_reach_requests_everywhere_on_every_worker(
    broker, tiny_model_dir
) -> None:
    """Guards against a cancel that only works where the request happens to be (e.g. running),
    or only on the worker that owns partition 0, and against a stopped request keeping its
    blocks."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, NUM_PARTITIONS)
    engines = []

    def factory():
        from engine import LLMEngine

        engine = LLMEngine(str(tiny_model_dir), **{**SMALL_ENGINE, "max_num_seqs": 1})
        engines.append(engine)
        return SlowEngine(engine, 0.02)

    workers = [
        Worker(
            worker_settings(
                tiny_model_dir,
                broker.bootstrap_servers,
                group_id,
                topic,
                worker_id=f"c{i}",
                kafka={"num_partitions": NUM_PARTITIONS, "urgency_lanes": False},
                batcher={"max_batch_tokens": 8},
            ),  # fmt: skip
            engine_factory=factory,
        )
        for i in range(2)
    ]
    options = ClientOptions(
        request_topic=topic, control_topic=workers[0].settings.kafka.control_topic
    )
    async with (
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
        MiniInferClient(broker.bootstrap_servers, options) as client,
        running_workers(workers, NUM_PARTITIONS, grace_s=2),
    ):
        long = {"max_tokens": 2000, "ignore_eos": True}
        requests = [make_request(replies.topic, f"long {i}", **long) for i in range(12)]
        soon_ms = int(time.time() * 1000) + 1500
        expiring = [
            make_request(replies.topic, f"expiring {i}", deadline_ms=soon_ms, **long)
            for i in range(4)
        ]
        # Spread over the partitions by hand: keyed by random request ids, 14 of the 16 once
        # landed on one partition, and the other worker never had one held in its batcher.
        for i, request in enumerate([*requests, *expiring]):
            await producer.send(topic, request, partition=i % NUM_PARTITIONS)
        # Both workers hold some: one decoding, one waiting in the engine, the rest held.
        where = {"decoding", "engine queue", "batcher"}
        await wait_for(lambda: all(placed(w) == where for w in workers))
        for request in requests:
            await client.cancel(request.id)
        for request in requests:
            assert (await replies.final_of(request.id)).finish_reason == "cancelled"
        for request in expiring:
            assert (await replies.final_of(request.id)).finish_reason == "expired"
        answered_by = {replies.finals(r.id)[0].attempt.split(":")[0] for r in requests}
        assert answered_by == {"c0", "c1"}
        await wait_for(lambda: all(w.pipeline.num_unacked == 0 for w in workers))
        for engine in engines:  # idle now: every block is back in the pool
            await wait_for(lambda e=engine: not e.has_unfinished_requests())
            stats = engine.get_stats()
            assert stats.num_blocks_free == stats.num_blocks_total


def placed(worker: Worker) -> set[str]:
    """Where this worker's requests are now."""
    where = set()
    for job in worker.pipeline.active_jobs():
        if job.state is JobState.PENDING:
            where.add("batcher")
        elif job.first_token_s is not None:
            where.add("decoding")
        else:
            where.add("engine queue")
    return where
