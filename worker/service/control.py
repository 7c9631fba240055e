"""The control topic: cancel messages that every worker must see.

A cancel must reach whichever worker holds the request, so this consumer is outside the request
group: it assigns itself every partition of the control topic, with no group and no commits.
It starts each partition `max_num_replayed` records before its end (or at its start, if that is
later), not at the earliest offset: re-reading the whole topic at every start grows with the
topic's life, while a cancel matters only for a request not yet finished, and those are recent
(a cancel that overtakes its request is remembered; one for a request still in the backlog is
within the last records unless the backlog is that deep). Not at the very end either: cancels
sent just before this worker started must reach the requests it is about to take over. (Some
brokers report the end low after batched produces: that replays a few more, never fewer.)
A bug in handling one cancel is logged, never raised: it would stop every later cancel.
The topic's partitions are looked up again every
`PARTITION_REFRESH_S`, so partitions added later (or metadata that was not ready at start-up)
are picked up. A cancel for an id not (yet) here is remembered
by the pipeline, so a cancel that overtakes its request still wins.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from schemas.codec import Limits, UndecodableError, decode_cancel
from schemas.headers import read_content_type
from worker.offset_gaps import OffsetGaps, records_of
from worker.service.pipeline import Pipeline
from worker.service.routing import safe_for_log
from worker.service.settings import KafkaSettings

log = structlog.get_logger(__name__)

POLL_TIMEOUT_MS = 200
PARTITION_REFRESH_S = 10.0
MAX_NUM_REPLAYED = 10_000  # cancels per partition read again at start


class CancelListener:
    def __init__(
        self, kafka: KafkaSettings, bootstrap_servers: str, pipeline: Pipeline, limits: Limits
    ) -> None:
        self._topic = kafka.control_topic
        self._pipeline = pipeline
        self._limits = limits
        self._stop_timeout_s = kafka.consumer_stop_timeout_s
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap_servers,
            group_id=None,
            client_id=f"{kafka.client_id}-control",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            request_timeout_ms=kafka.request_timeout_ms,
            fetch_max_wait_ms=POLL_TIMEOUT_MS,
            **kafka.client_options(),
        )
        self._gaps = OffsetGaps(kafka.max_gap_refetches, what="cancels")

    async def start(self) -> None:
        await self._consumer.start()
        await self.refresh_partitions()

    async def refresh_partitions(self) -> None:
        """Assign every partition the control topic has now; new ones are read from the start."""
        await self._consumer.topics()  # fills the metadata that partitions_for_topic reads
        partition_ids = self._consumer.partitions_for_topic(self._topic) or {0}
        partitions = {TopicPartition(self._topic, p) for p in partition_ids}
        current = set(self._consumer.assignment())
        new = partitions - current
        if not new:
            return
        positions = {tp: await self._consumer.position(tp) for tp in current}
        self._consumer.assign(sorted(partitions | current))
        for tp, offset in positions.items():  # assign() forgets positions: keep ours
            self._consumer.seek(tp, offset)
        await self._seek_to_recent(new)
        for tp in new:
            self._gaps.forget(tp)
        if current:
            log.info("control.partitions_added", partitions=sorted(p.partition for p in new))

    async def _seek_to_recent(self, partitions: set[TopicPartition]) -> None:
        """Start `partitions` `MAX_NUM_REPLAYED` records before their end (at most)."""
        partitions = sorted(partitions)
        begin = await self._consumer.beginning_offsets(partitions)
        end = await self._consumer.end_offsets(partitions)
        for tp in partitions:
            self._consumer.seek(tp, max(begin[tp], end[tp] - MAX_NUM_REPLAYED))

    async def run(self) -> None:
        refreshed_s = time.monotonic()
        while True:
            if time.monotonic() - refreshed_s > PARTITION_REFRESH_S:
                refreshed_s = time.monotonic()
                try:
                    await self.refresh_partitions()
                except KafkaError as error:
                    log.warning("control.refresh_failed", error=repr(error))
            try:
                batches = await self._consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
            except KafkaError as error:
                log.warning("control.poll_failed", error=repr(error))
                await asyncio.sleep(1.0)
                continue
            for record in records_of(self._consumer, self._gaps, batches):
                self._handle(record)

    def _handle(self, record) -> None:
        try:
            self._cancel(record)
        except Exception:  # a bug with one cancel must not stop every later one
            log.exception("control.handling_failed", offset=record.offset)

    def _cancel(self, record) -> None:
        try:
            cancel = decode_cancel(record.value, read_content_type(record.headers), self._limits)
        except UndecodableError as error:
            log.warning("control.undecodable", offset=record.offset, reason=error.reason)
            return
        num_stopped = self._pipeline.cancel(cancel.id)
        if num_stopped:
            log.info(
                "request.cancel_received",
                request_id=safe_for_log(cancel.id),
                num_attempts=num_stopped,
            )

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._consumer.stop(), self._stop_timeout_s)
        except TimeoutError:
            log.warning("control.stop_timeout")
