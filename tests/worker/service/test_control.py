"""The cancel listener reads every partition of the control topic, including partitions whose
metadata was not there at start-up (it used to assign partition 0 once and never look again)."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas.codec import Limits
from schemas.messages import Cancel
from tests.conftest import unique_name
from tests.worker.kafka_helpers import Producer, create_topic
from worker.service import control
from worker.service.control import CancelListener
from worker.service.settings import KafkaSettings

pytestmark = pytest.mark.kafka


class FakePipeline:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, request_id: str) -> int:
        self.cancelled.append(request_id)
        return 0


async def test_partitions_that_appear_later_are_read(broker, monkeypatch) -> None:
    """Guards against cancels on a control partition the listener never assigned: they would
    never reach any worker."""
    topic = unique_name("control")
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers, control_topic=topic)
    monkeypatch.setattr(control, "PARTITION_REFRESH_S", 0.2, raising=False)
    pipeline = FakePipeline()
    listener = CancelListener(kafka, broker.bootstrap_servers, pipeline, Limits())
    await listener.start()  # the topic does not exist yet: partition 0 as a stand-in
    task = asyncio.create_task(listener.run())
    try:
        await create_topic(broker.bootstrap_servers, topic, 3)
        async with Producer(broker.bootstrap_servers) as producer:
            for partition in range(3):
                await producer.send_raw(
                    topic, Cancel(id=f"c{partition}").model_dump_json().encode(), None,
                    [("content-type", b"application/json")], partition=partition,
                )  # fmt: skip
        deadline_s = time.monotonic() + 20
        while sorted(pipeline.cancelled) != ["c0", "c1", "c2"]:
            assert time.monotonic() < deadline_s, pipeline.cancelled
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await listener.close()


async def send_cancels(bootstrap_servers: str, topic: str, ids: list[str]) -> None:
    async with Producer(bootstrap_servers) as producer:
        for request_id in ids:  # one produce each: every record its own batch
            await producer.send_raw(
                topic, Cancel(id=request_id).model_dump_json().encode(), None,
                [("content-type", b"application/json")], partition=0,
            )  # fmt: skip


async def test_a_start_replays_only_the_recent_cancels_and_a_bug_in_one_is_survived(
    broker, monkeypatch
) -> None:
    """Guards against re-reading the whole control topic from the earliest offset at every
    start (it grows with the topic's life), and against an unguarded handler: a bug with one
    cancel killed the listener task, and every later cancel was lost."""
    topic = unique_name("control")
    await create_topic(broker.bootstrap_servers, topic, 1)
    await send_cancels(broker.bootstrap_servers, topic, [f"old{i}" for i in range(5)])
    monkeypatch.setattr(control, "MAX_NUM_REPLAYED", 2)
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers, control_topic=topic)
    pipeline = FakePipeline()
    cancel = pipeline.cancel

    def buggy_cancel(request_id: str) -> int:
        if request_id == "bug":
            raise RuntimeError("a bug with this one cancel")
        return cancel(request_id)

    pipeline.cancel = buggy_cancel
    listener = CancelListener(kafka, broker.bootstrap_servers, pipeline, Limits())
    await listener.start()
    task = asyncio.create_task(listener.run())
    try:
        await send_cancels(broker.bootstrap_servers, topic, ["bug", "after"])
        deadline_s = time.monotonic() + 20
        while "after" not in pipeline.cancelled:
            assert time.monotonic() < deadline_s and not task.done(), pipeline.cancelled
            await asyncio.sleep(0.05)
        assert pipeline.cancelled == ["old3", "old4", "after"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await listener.close()
