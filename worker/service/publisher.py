"""The one producer of the worker: replies, finals and dead letters, in the order they were made.

Callers hand messages over synchronously (`publish`), from any callback on the event loop; one
task feeds them to aiokafka in that order. aiokafka keeps per-partition order (one in-flight batch
per partition), and replies are keyed by request id, so a request's `seq` order holds on the
wire. `acks="all"` and, on real Kafka, idempotence: a retried batch is neither lost nor doubled.
A caller that must know the broker has the message (a final, before its offset is committed)
passes `on_done`, called with None or the delivery error.

One topic must not hold up the others: aiokafka's `send` waits (up to `request_timeout_ms`) for
the metadata of a topic it does not know yet, and a missing or unreachable reply topic would
then stall every request's replies behind it. So a message whose topic has no metadata yet goes
to a lane of its own (one task per such topic, in order within the topic), and the main loop
moves on. A callback that raises is logged and never kills the loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from worker.service.settings import WorkerSettings

log = structlog.get_logger(__name__)

# Room for the record and batch framing around a message of `max_message_bytes`.
_FRAMING_BYTES = 64 * 1024


@dataclass
class Outgoing:
    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]
    on_done: Callable[[BaseException | None], None] | None = None


class Publisher:
    def __init__(self, settings: WorkerSettings, bootstrap_servers: str) -> None:
        self._settings = settings
        self._bootstrap_servers = bootstrap_servers
        self._queue: asyncio.Queue[Outgoing] = asyncio.Queue()
        self._producer: AIOKafkaProducer | None = None
        self._task: asyncio.Task | None = None
        self._num_unacked = 0
        self._all_acked = asyncio.Event()
        self._all_acked.set()
        self._lanes: dict[str, deque[Outgoing]] = {}  # topics waiting for metadata
        self._lane_tasks: set[asyncio.Task] = set()
        self.is_idempotent = False
        # Set when the publishing loop (or a lane) died: every later final would wait forever,
        # so the worker treats it as fatal.
        self.failed = asyncio.Event()

    def _make_producer(self, enable_idempotence: bool) -> AIOKafkaProducer:
        kafka, publisher = self._settings.kafka, self._settings.publisher
        return AIOKafkaProducer(
            bootstrap_servers=self._bootstrap_servers,
            client_id=f"{kafka.client_id}-producer",
            acks="all",
            enable_idempotence=enable_idempotence,
            linger_ms=publisher.linger_ms,
            compression_type=publisher.compression_type,
            max_request_size=self._settings.limits.max_message_bytes + _FRAMING_BYTES,
            request_timeout_ms=kafka.request_timeout_ms,
            **kafka.client_options(),
        )

    async def start(self) -> None:
        want_idempotence = self._settings.kafka.use_idempotence
        self._producer = self._make_producer(want_idempotence)
        try:
            await self._producer.start()
            self.is_idempotent = want_idempotence
        except KafkaError as error:
            if not want_idempotence:
                raise
            # The embedded broker (and a Kafka without IdempotentWrite rights) refuses
            # InitProducerId. acks=all without idempotence is still at-least-once: a retried
            # batch may be doubled, and clients drop duplicates by (attempt, seq).
            log.warning("producer.idempotence_unavailable", error=repr(error))
            await self._producer.stop()
            self._producer = self._make_producer(False)
            await self._producer.start()
        self._task = asyncio.create_task(self._run(), name="publisher")
        self._task.add_done_callback(self._on_task_done)
        log.info("producer.started", is_idempotent=self.is_idempotent)

    def publish(self, message: Outgoing) -> None:
        self._num_unacked += 1
        self._all_acked.clear()
        self._queue.put_nowait(message)

    async def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything published so far is acknowledged (or failed); False when
        `timeout_s` ran out first."""
        try:
            await asyncio.wait_for(self._all_acked.wait(), timeout_s)
        except TimeoutError:
            log.warning("producer.flush_timeout", num_unacked=self._num_unacked)
            return False
        return True

    async def stop(self, timeout_s: float = 10.0) -> None:
        await self.flush(timeout_s)
        tasks = [t for t in (self._task, *self._lane_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._producer is not None:
            await self._producer.stop()

    async def _run(self) -> None:
        while True:
            message = await self._queue.get()
            lane = self._lanes.get(message.topic)
            if lane is not None:  # behind earlier messages to a topic still without metadata
                lane.append(message)
            elif self._has_metadata(message.topic):
                await self._send(message)
            else:
                self._lanes[message.topic] = deque([message])
                task = asyncio.create_task(self._drain_lane(message.topic))
                self._lane_tasks.add(task)
                task.add_done_callback(self._lane_tasks.discard)
                task.add_done_callback(self._on_task_done)

    def _on_task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("producer.task_died", task=task.get_name(), error=repr(task.exception()))
            self.failed.set()

    def _has_metadata(self, topic: str) -> bool:
        return self._producer.client.cluster.partitions_for_topic(topic) is not None

    async def _drain_lane(self, topic: str) -> None:
        lane = self._lanes[topic]
        try:
            while lane:
                await self._send(lane[0])
                lane.popleft()
        finally:
            del self._lanes[topic]
            for message in lane:  # cancelled (stop): fail what never went out
                self._done(message, asyncio.CancelledError())

    async def _send(self, message: Outgoing) -> None:
        try:
            delivery = await self._producer.send(
                message.topic, message.value, key=message.key, headers=message.headers
            )
        except (KafkaError, ValueError, TypeError) as error:  # e.g. too large, no metadata
            self._done(message, error)
            return
        delivery.add_done_callback(lambda fut, m=message: self._done(m, _error_of(fut)))

    def _done(self, message: Outgoing, error: BaseException | None) -> None:
        if error is not None:
            log.warning("producer.delivery_failed", topic=message.topic, error=repr(error))
        try:
            if message.on_done is not None:
                message.on_done(error)
        except Exception:  # a caller's bug must not kill the loop or lose the count
            log.exception("producer.callback_failed", topic=message.topic)
        finally:
            self._num_unacked -= 1
            if self._num_unacked == 0:
                self._all_acked.set()


def _error_of(future: asyncio.Future) -> BaseException | None:
    if future.cancelled():
        return asyncio.CancelledError()
    return future.exception()
