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
