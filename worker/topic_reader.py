"""Reading topics from their start in the background, outside any consumer group: the start,
read and bounded stop that tools watching replies share (the load tests' and the tests' reply
readers). aiokafka only, no torch.

Every record goes to `on_record` on the event loop, in order per partition, until the reader
is closed; an offset gap is fetched again before it is believed (worker/offset_gaps.py). The
stop is bounded: aiokafka's `stop()` can hang on a broker that went away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition

from worker.offset_gaps import OffsetGaps, records_of

POLL_TIMEOUT_MS = 200
STOP_TIMEOUT_S = 10.0


class TopicReader:
    """`async with TopicReader(servers, on_record, topics=[...])` (whole topics) or
    `partitions=[...]` (those alone); extra keyword arguments go to `AIOKafkaConsumer`."""

    def __init__(
        self,
        bootstrap_servers: str,
        on_record: Callable[[object], None],
        *,
        topics: Iterable[str] = (),
        partitions: Iterable[TopicPartition] = (),
        **consumer_options,
    ) -> None:
        self._on_record = on_record
        self._partitions = list(partitions)
        self._consumer = AIOKafkaConsumer(
            *topics, bootstrap_servers=bootstrap_servers, group_id=None,
            auto_offset_reset="earliest", enable_auto_commit=False, **consumer_options,
        )  # fmt: skip
        self._task: asyncio.Task | None = None
        self.gaps = OffsetGaps(what="topic reader")

    async def __aenter__(self) -> TopicReader:
        await self._consumer.start()
        if self._partitions:
            self._consumer.assign(self._partitions)
            for partition in self._partitions:  # from the start: the first record is checked
                self.gaps.expect(partition, await self._consumer.position(partition))
        self._task = asyncio.create_task(self._read(), name="topic-reader")
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.wait_for(self._consumer.stop(), STOP_TIMEOUT_S)

    async def _read(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
            for record in records_of(self._consumer, self.gaps, batches):
                self._on_record(record)
