"""A worker process killed with SIGKILL mid-generation loses nothing: its partitions move to the
survivor after the session timeout, which regenerates the unfinished requests under new
attempts; every request ends with a whole stream (the client's seq/attempt rule then shows one
clean answer). The time from the kill until the survivor runs the orphans is printed (`-s`)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from schemas.codec import MSGPACK, encode
from schemas.headers import request_headers
from tests.worker.kafka_helpers import (
    Producer,
    ReplyReader,
    create_topic,
    fresh_topics,
    make_request,
    stream_of,
    worker_settings,
)
from tests.worker.workers import running_worker, serve_process
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka

MAX_TOKENS = 64


async def test_sigkill_of_one_of_two_workers_loses_nothing(
    broker, tiny_model_dir, tmp_path
) -> None:
    """Guards against work lost (or committed unanswered) when a worker dies without any
    chance to clean up."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 2)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic, worker_id="survivor",
        kafka={"num_partitions": 2, "control_topic": topic + ".control",
               "dlq_topic": topic + ".dlq", "urgency_lanes": False},
    )  # fmt: skip
    async with (
        serve_process(
            broker.bootstrap_servers, tiny_model_dir, group_id, topic, tmp_path, "victim",
            extra_env={"MINI_INFER_TEST_GATE": "4", "MINI_INFER_KAFKA__URGENCY_LANES": "false"},
            module="tests.worker.service.gated_serve",
        ) as victim,
        running_worker(settings, is_assigned=False) as survivor,
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
    ):  # fmt: skip
        await wait_for_split_with_process(survivor)
        (survivor_partition,) = {tp.partition for tp in survivor.consumer.assignment}
        victim_partition = 1 - survivor_partition

        async def send(request, partition: int) -> None:
            await producer.send_raw(
                topic, encode(request, MSGPACK), request.id.encode(),
                request_headers(MSGPACK), partition=partition,
            )  # fmt: skip

        # Long enough never to finish in the gated victim; short for the survivor to redo.
        long = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
        orphans = [make_request(replies.topic, f"victim {i}", **long) for i in range(3)]
        others = [make_request(replies.topic, f"survivor {i}", **long) for i in range(3)]
        for request in orphans:
            await send(request, victim_partition)
        for request in others:
            await send(request, survivor_partition)
        # A short probe behind the long ones. The victim's engine is gated: it steps only
        # once all four are added, and never again after the first (the probe) finishes,
        # so once the probe is answered the long ones are running there and cannot finish.
        probe = make_request(replies.topic, "probe", max_tokens=2)
        await send(probe, victim_partition)
        assert (await replies.final_of(probe.id)).attempt.startswith("victim:")
        assert not any(replies.finals(r.id) for r in orphans)
        victim.send_signal(signal.SIGKILL)
        killed_s = time.monotonic()
        await asyncio.to_thread(victim.wait, 10)
        orphan_ids = {r.id for r in orphans}
        deadline_s = killed_s + 60
        while not orphan_ids <= {j.request_id for j in survivor.pipeline.active_jobs()}:
            assert time.monotonic() < deadline_s, "the survivor did not take over"
            await asyncio.sleep(0.05)
        print(f"\nrecovery: {time.monotonic() - killed_s:.1f} s from SIGKILL until the survivor "
              "runs every orphaned request")  # fmt: skip
        for request in orphans + others:
            final = await replies.final_of(request.id, timeout_s=90)
            assert final.finish_reason == "length" and final.usage.completion_tokens == MAX_TOKENS
            assert final.attempt.startswith("survivor:")
            stream = stream_of(replies, request.id, final.attempt)
            assert [m.seq for m in stream] == list(range(len(stream)))
            assert "".join(m.text for m in stream[:-1]) == final.text
        # The probe was answered, but its offset sat behind the unfinished long ones, so it
        # was not committed: redone by the survivor, with the same answer.
        await replies.wait_until(lambda: len(replies.finals(probe.id)) == 2)
        assert len({f.text for f in replies.finals(probe.id)}) == 1


async def wait_for_split_with_process(worker: Worker, timeout_s: float = 60.0) -> None:
    """Until the in-process worker holds exactly one of the two partitions (the other is the
    process's)."""
    deadline_s = time.monotonic() + timeout_s
    while len(worker.consumer.assignment) != 1:
        assert time.monotonic() < deadline_s, worker.consumer.assignment
        await asyncio.sleep(0.05)
