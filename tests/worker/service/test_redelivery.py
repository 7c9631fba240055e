"""Workers in one group: a worker dying mid-stream, and two workers sharing the partitions."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.worker.kafka_helpers import (
    SMALL_ENGINE,
    HeldEngine,
    Producer,
    ReplyReader,
    create_topic,
    fresh_topics,
    make_request,
    slow_engine_factory,
    stream_of,
    worker_settings,
)
from tests.worker.workers import running_workers
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka

NUM_PARTITIONS = 2


async def test_a_request_redelivered_after_a_crash_regenerates_the_same_messages(
    broker, tiny_model_dir
) -> None:
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, NUM_PARTITIONS)
    settings_a = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic, worker_id="crashing"
    )
    settings_b = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic, worker_id="taking-over"
    )
    async with (
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
    ):
        # Greedy, and sampled without a seed: the worker derives the seed from the request id.
        greedy = make_request(replies.topic, "Hello there", max_tokens=40, ignore_eos=True)
        sampled = make_request(
            replies.topic, "Kafka streams", max_tokens=40, ignore_eos=True, temperature=0.9
        )
        worker_a = Worker(settings_a, engine_factory=slow_engine_factory(tiny_model_dir))
        await worker_a.start()
        try:
            await worker_a.wait_assigned()
            await producer.send(topic, greedy)
            await producer.send(topic, sampled)
            await replies.wait_until(
                lambda: all(len(replies.tokens(r.id)) >= 5 for r in (greedy, sampled)),
                what="tokens from worker A",
            )
        finally:
            await worker_a.abort()  # dies mid-stream: nothing drained, nothing committed
        assert not replies.finals(greedy.id) and not replies.finals(sampled.id)

        worker_b = Worker(settings_b)
        await worker_b.start()
        try:
            for request in (greedy, sampled):
                final = await replies.final_of(request.id)
                assert final.attempt.startswith("taking-over:")
                (first_attempt,) = {m.attempt for m in replies.messages[request.id]} - {
                    final.attempt
                }
                assert first_attempt.startswith("crashing:")
                old = stream_of(replies, request.id, first_attempt)
                new = stream_of(replies, request.id, final.attempt)
                assert len(old) >= 5 and len(new) > len(old)
                # Same tokens, same message boundaries, same seq: only the attempt differs.
                for before, after in zip(old, new, strict=False):
                    assert before.model_dump(exclude={"attempt"}) == after.model_dump(
                        exclude={"attempt"}
                    )
                assert final.usage.completion_tokens == 40
        finally:
            await worker_b.stop(grace_s=5)


async def test_two_workers_share_the_partitions_and_answer_each_request_once(
    broker, tiny_model_dir
) -> None:
    topic, group_id = fresh_topics()
    num_partitions = 4
    await create_topic(broker.bootstrap_servers, topic, num_partitions)
    workers = [
        Worker(
            worker_settings(
                tiny_model_dir,
                broker.bootstrap_servers,
                group_id,
                topic,
                worker_id=f"pool-{i}",
                kafka={"num_partitions": num_partitions, "urgency_lanes": False},
            )
        )  # fmt: skip
        for i in range(2)
    ]
    async with (
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
    ):
        async with running_workers(workers, num_partitions):
            requests = [make_request(replies.topic, f"prompt {i}", max_tokens=6) for i in range(16)]
            for i, request in enumerate(requests):  # every partition, so both workers, gets some
                await producer.send(topic, request, partition=i % num_partitions)
            for request in requests:
                await replies.final_of(request.id)
        # Everything the workers sent is flushed now; a marker shows the reader has read it all.
        await producer.send(replies.topic, make_request(replies.topic, id="end-marker"))
        await replies.wait_until(lambda: "end-marker" in replies.raw_ids, what="the end marker")
    finals_per_id = {r.id: len(replies.finals(r.id)) for r in requests}
    assert set(finals_per_id.values()) == {1}, finals_per_id
    answered_by = {replies.finals(r.id)[0].attempt.split(":")[0] for r in requests}
    assert answered_by == {"pool-0", "pool-1"}


async def test_a_rebalance_mid_generation_moves_some_work_and_keeps_the_rest_going(
    broker, tiny_model_dir
) -> None:
    """`busy` holds all four partitions, two requests streaming on each, its engine held there
    (so "still running" at the rebalance is a fact, not a race). `joining` joins: aiokafka's
    eager protocol revokes every partition of `busy` and gives two of them back. The requests of
    the two that moved are dropped by `busy` and generated again, in full, by `joining`; those
    of the two `busy` kept go on where they were, never generated twice (the keep path)."""
    topic, group_id = fresh_topics()
    num_partitions = 4
    await create_topic(broker.bootstrap_servers, topic, num_partitions)

    def settings(worker_id: str):
        return worker_settings(tiny_model_dir, broker.bootstrap_servers, group_id, topic, worker_id=worker_id,
                               kafka={"num_partitions": num_partitions, "urgency_lanes": False})  # fmt: skip

    requests_per_partition = 2
    release = threading.Event()
    engines: list[HeldEngine] = []

    def held_engine():
        from engine import LLMEngine

        engines.append(HeldEngine(
            LLMEngine(str(tiny_model_dir), **SMALL_ENGINE),
            num_partitions * requests_per_partition, release,
        ))  # fmt: skip
        return engines[-1]

    busy = Worker(settings("busy"), engine_factory=held_engine)
    joining = Worker(settings("joining"))
    async with (
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
    ):
        await busy.start()
        try:
            await busy.wait_assigned()
            requests = [
                make_request(replies.topic, f"long {i}", max_tokens=300, ignore_eos=True)
                for i in range(num_partitions * requests_per_partition)
            ]
            partition_of = {r.id: i % num_partitions for i, r in enumerate(requests)}
            for request in requests:
                await producer.send(topic, request, partition=partition_of[request.id])
            assert await asyncio.to_thread(engines[0].held.wait, 60), "never all streaming"
            await replies.wait_until(
                lambda: all(replies.tokens(r.id) for r in requests), what="all to stream"
            )
            await joining.start()  # the group rebalances while every request is mid-generation
            await joining.wait_assigned()
            deadline_s = time.monotonic() + 60
            while (
                len(busy.consumer.assignment) == num_partitions or busy.consumer.tracker.suspended
            ):
                assert time.monotonic() < deadline_s, "busy never settled its new assignment"
                await asyncio.sleep(0.05)
            kept = {tp.partition for tp in busy.consumer.assignment}
            release.set()
            for request in requests:
                await replies.final_of(request.id, timeout_s=120)
        finally:
            release.set()
            await asyncio.gather(busy.stop(grace_s=5), joining.stop(grace_s=5))
        await producer.send(replies.topic, make_request(replies.topic, id="end-marker"))
        await replies.wait_until(lambda: "end-marker" in replies.raw_ids, what="the end marker")
    assert engines[0].num_finished_before_release == 0
    assert 0 < len(kept) < num_partitions, kept
    finals = {r.id: replies.finals(r.id) for r in requests}
    assert all(len(f) == 1 for f in finals.values()), finals  # revoked work sends no final
    for rid, (final,) in finals.items():
        attempts = sorted({m.attempt for m in replies.messages[rid]})
        assert final.usage.completion_tokens == 300
        if partition_of[rid] in kept:  # went on in `busy`: one attempt, never redone
            assert attempts == [final.attempt] and final.attempt.startswith("busy:"), attempts
        else:  # started by `busy`, dropped at the revocation, redone in full by `joining`
            assert [a.split(":")[0] for a in attempts] == ["busy", "joining"], attempts
            assert final.attempt.startswith("joining:")
