"""A worker process killed with SIGKILL mid-generation loses nothing: its partitions move to the
survivor after the session timeout, which regenerates the unfinished requests under new
attempts; every request ends with a whole stream (the client's seq/attempt rule then shows one
clean answer). The time from the kill to the survivor's first message is printed (`-s`)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from tests.worker.kafka_helpers import (
    Producer,
    ReplyReader,
    create_topic,
    fresh_topics,
    make_request,
    stream_of,
    worker_settings,
)
from tests.worker.service.test_serve_sigterm import start_serve, wait_for_file
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka


async def test_sigkill_of_one_of_two_workers_loses_nothing(broker, tiny_model_dir, tmp_path) -> None:
    """Guards against work lost (or committed unanswered) when a worker dies without any
    chance to clean up."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 2)
    ready_file, log_path = tmp_path / "ready.json", tmp_path / "victim.log"
    victim = start_serve(
        broker.bootstrap_servers, tiny_model_dir, group_id, topic, ready_file, log_path, "victim"
    )
    survivor = Worker(
        worker_settings(
            tiny_model_dir, broker.bootstrap_servers, group_id, topic, worker_id="survivor",
            kafka={"num_partitions": 2, "control_topic": topic + ".control",
                   "dlq_topic": topic + ".dlq"},
        )
    )  # fmt: skip
    try:
        await wait_for_file(ready_file, victim, log_path)
        await survivor.start()
        async with (
            Producer(broker.bootstrap_servers) as producer,
            ReplyReader(broker.bootstrap_servers) as replies,
        ):
            await wait_for_split_with_process(survivor)
            requests = [
                make_request(replies.topic, f"crash {i}", max_tokens=200, ignore_eos=True)
                for i in range(8)
            ]
            for request in requests:
                await producer.send(topic, request)

            def victim_streams() -> list[str]:
                return [r.id for r in requests
                        if any(m.attempt.startswith("victim:") for m in replies.messages[r.id])]  # fmt: skip

            await replies.wait_until(lambda: victim_streams(), what="the victim to stream")
            victim.send_signal(signal.SIGKILL)
            killed_s = time.monotonic()
            await asyncio.to_thread(victim.wait, 10)
            orphans = [r.id for r in requests if not replies.finals(r.id)
                       and any(m.attempt.startswith("victim:") for m in replies.messages[r.id])]  # fmt: skip
            assert orphans
            await replies.wait_until(
                lambda: any(m.attempt.startswith("survivor:") for m in replies.messages[orphans[0]]),
                timeout_s=60, what="the survivor to take over",
            )  # fmt: skip
            print(f"\nrecovery: {time.monotonic() - killed_s:.1f} s from SIGKILL to the survivor's "
                  "first message of an orphaned request")  # fmt: skip
            for request in requests:
                final = await replies.final_of(request.id, timeout_s=90)
                assert final.finish_reason == "length" and final.usage.completion_tokens == 200
                stream = stream_of(replies, request.id, final.attempt)
                assert [m.seq for m in stream] == list(range(len(stream)))
                assert "".join(m.text for m in stream[:-1]) == final.text
            for request_id in orphans:
                assert replies.finals(request_id)[0].attempt.startswith("survivor:")
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
        await survivor.stop(grace_s=5)


async def wait_for_split_with_process(worker: Worker, timeout_s: float = 60.0) -> None:
    """Until the in-process worker holds exactly one of the two partitions (the other is the
    process's)."""
    deadline_s = time.monotonic() + timeout_s
    while len(worker.consumer.assignment) != 1:
        assert time.monotonic() < deadline_s, worker.consumer.assignment
        await asyncio.sleep(0.05)


