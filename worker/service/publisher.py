"""The worker's producers: replies, finals and dead letters, in the order they were made.

Callers hand messages over synchronously (`publish`), from any callback on the event loop; one
task feeds them to aiokafka in that order: one `send` each, or, for small messages that name
their partition (replies to the shared reply topic: a step's tokens), one batch per partition of
the messages waiting (`send_batch`), outcomes still told per message. aiokafka keeps
per-partition order (one in-flight batch per partition), and replies are keyed by request id, so
a request's `seq` order holds on the wire. `acks="all"` and, on real Kafka, idempotence: a
retried batch is neither lost nor doubled. A caller that must know the broker has the message
(a final, before its offset is committed) passes `on_done`, called with None or the delivery
error.

One topic must not hold up the others. aiokafka's `send` waits (up to `request_timeout_ms`) for
the metadata of a topic it does not know yet, and for room when a partition's batch is full; an
idempotent producer retries a retriable error (`NOT_ENOUGH_REPLICAS` on a topic whose replicas
are short) forever, so a refused topic's batches never drain. So every topic has a lane of its
own (a deque and one task while it holds messages, in order within the topic), bounded at
`max_num_lane_messages` (a message beyond it fails at once with `LaneFull`), and every message
has a delivery deadline (`delivery_timeout_s` from `publish`): past it, it fails with
`DeliveryTimeout` wherever it is (in its lane, or in aiokafka waiting for an ack that may never
come; a late ack is then ignored). Both errors are final: `deliver` does not retry them, so a
final to a refused topic is dead-lettered (`final_undeliverable`) within the deadline and its
partition's commits move on, while the other topics' lanes go on. A callback that raises is
logged and never kills a lane.

Lanes keep a stuck topic's messages away from the others' in the worker, but not inside
aiokafka: a producer has one produce request in flight per broker, and after a batch came back
with a retriable error it waits `retry_backoff_ms` before that broker gets the next request,
every other topic's batches included. A topic that keeps refusing writes thus throttled every
topic of the producer to one request per backoff. So per-client reply topics (under the reply
topic prefix, other than the shared one) go through producers of their own
(`num_private_producers`, a topic always to the same one, so its order holds): the shared reply
topic and the DLQ never wait on a client's topic. A refused client topic would still slow the
client topics that share its producer: so once one of its messages passed the delivery deadline
inside a private producer, that topic stays on it (its order holds) and the producer's slot gets
a fresh producer, which takes the other topics from then on (`MAX_NUM_RETIRED_PRODUCERS` at
most; retired ones close with the publisher).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from worker.service.settings import WorkerSettings

log = structlog.get_logger(__name__)

# Room for the record and batch framing around a message of `max_message_bytes`.
_FRAMING_BYTES = 64 * 1024
# Private producers set aside because a topic stuck them; past this many, no more are replaced
# (each holds connections and, on Kafka, the stuck topic's batches retried for good).
MAX_NUM_RETIRED_PRODUCERS = 8
# Messages up to this size go out in batches of their own making (`_is_batched`): aiokafka's
# default `max_batch_size`, which the producers keep, so such a message never needs a batch
# larger than aiokafka would have made for it.
MAX_BATCHED_BYTES = 16 * 1024


@dataclass
class Outgoing:
    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]
    on_done: Callable[[BaseException | None], None] | None = None
    is_done: bool = field(default=False, compare=False)
    deadline_s: float = field(default=0.0, compare=False, repr=False)  # the loop's clock
    partition: int | None = None  # None: aiokafka's partitioner picks one by key
    producer: object = field(default=None, compare=False, repr=False)  # once handed to one


class DeliveryTimeout(TimeoutError):
    """Not acknowledged within `delivery_timeout_s`: undeliverable, not to be retried."""


class LaneFull(BufferError):
    """Its topic already holds `max_num_lane_messages` unsent messages (the topic is stuck)."""


FINAL_ERRORS = (DeliveryTimeout, LaneFull)


class Publisher:
    def __init__(self, settings: WorkerSettings, bootstrap_servers: str) -> None:
        self._settings = settings
        self._bootstrap_servers = bootstrap_servers
        self._delivery_timeout_s = settings.publisher.delivery_timeout_s
        self._max_num_lane_messages = settings.publisher.max_num_lane_messages
        self._producer: AIOKafkaProducer | None = None  # the shared reply topic, the DLQ, ...
        self._private_producers: list[AIOKafkaProducer] = []  # per-client reply topics
        self._pinned: dict[str, AIOKafkaProducer] = {}  # a stuck topic -> the producer it stuck
        self._retired: list[AIOKafkaProducer] = []  # replaced in their slot: closed at stop
        self._replacements: set[asyncio.Task] = set()
        self._num_unacked = 0
        self._all_acked = asyncio.Event()
        self._all_acked.set()
        self._lanes: dict[str, deque[Outgoing]] = {}  # per topic: messages not yet sent
        # (topic, partition) -> the last batch or message handed to aiokafka there, while it is
        # unacknowledged (`_send_batched`)
        self._unacked_by_partition: dict[tuple[str, int], asyncio.Future] = {}
        # Every message not yet done, in publish order, which is deadline order (each gets the
        # same `delivery_timeout_s`): one timer, armed for the oldest, expires them. (A timer
        # per message was ~9% of the event loop's time per streamed token.)
        self._by_deadline: deque[Outgoing] = deque()
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._lane_tasks: set[asyncio.Task] = set()
        self.is_idempotent = False
        # Set when a lane died: its later finals would wait forever, so the worker treats it as
        # fatal.
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
        for _ in range(self._settings.publisher.num_private_producers):
            producer = self._make_producer(self.is_idempotent)
            await producer.start()
            self._private_producers.append(producer)
        log.info(
            "producer.started", is_idempotent=self.is_idempotent,
            num_private_producers=len(self._private_producers),
        )  # fmt: skip

    def _producer_for(self, topic: str) -> AIOKafkaProducer:
        kafka = self._settings.kafka
        is_private = topic.startswith(kafka.reply_topic_prefix) and (
            topic != kafka.shared_reply_topic_name
        )
        if not is_private or not self._private_producers:
            return self._producer
        pinned = self._pinned.get(topic)
        if pinned is not None:
            return pinned
        return self._private_producers[zlib.crc32(topic.encode()) % len(self._private_producers)]

    def _isolate(self, message: Outgoing) -> None:
        """`message` passed its deadline inside a private producer: that producer is stuck on
        its topic (aiokafka holds the producer's other topics behind the refused batch's
        retries). The topic stays pinned to it; its slot is given a fresh producer."""
        stuck = message.producer
        if stuck is None or stuck not in self._private_producers:
            return  # never sent (its lane waited), the shared producer's, or replaced already
        if len(self._retired) + len(self._replacements) >= MAX_NUM_RETIRED_PRODUCERS:
            log.warning("producer.isolation_exhausted", topic=message.topic)
            return
        self._pinned[message.topic] = stuck
        task = asyncio.create_task(self._replace(stuck), name="publisher-replace")
        self._replacements.add(task)
        task.add_done_callback(self._replacements.discard)

    async def _replace(self, stuck: AIOKafkaProducer) -> None:
        fresh = self._make_producer(self.is_idempotent)
        try:
            await fresh.start()
        except KafkaError as error:
            log.warning("producer.replace_failed", error=repr(error))
            return
        slot = self._private_producers.index(stuck) if stuck in self._private_producers else None
        if slot is None:  # the publisher is stopping
            await fresh.stop()
            return
        self._private_producers[slot] = fresh
        self._retired.append(stuck)
        log.warning("producer.replaced", slot=slot, num_retired=len(self._retired))

    def publish(self, message: Outgoing) -> None:
        """Queue `message` on its topic's lane; `on_done` is called exactly once."""
        self._num_unacked += 1
        self._all_acked.clear()
        lane = self._lanes.get(message.topic)
        if lane is None:
            lane = self._lanes[message.topic] = deque()
            task = asyncio.create_task(self._drain_lane(message.topic, lane), name="publisher")
            self._lane_tasks.add(task)
            task.add_done_callback(self._lane_tasks.discard)
            task.add_done_callback(self._on_task_done)
        elif len(lane) >= self._max_num_lane_messages:
            error = LaneFull(f"{len(lane)} messages to {message.topic} not sent yet")
            asyncio.get_running_loop().call_soon(self._done, message, error)
            return
        loop = asyncio.get_running_loop()
        message.deadline_s = loop.time() + self._delivery_timeout_s
        by_deadline = self._by_deadline
        while by_deadline and by_deadline[0].is_done:  # acknowledged since: forget them
            by_deadline.popleft()
        by_deadline.append(message)
        if self._deadline_timer is None:
            self._deadline_timer = loop.call_at(by_deadline[0].deadline_s, self._expire_due)
        lane.append(message)

    @property
    def num_queued(self) -> int:
        """Messages in lanes, not yet handed to aiokafka."""
        return sum(len(lane) for lane in self._lanes.values())

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
        """Flush, fail what is left, close the producer: all within `timeout_s`. aiokafka's
        own stop flushes too, and waits forever on a batch a broker keeps refusing: bounded."""
        deadline_s = time.monotonic() + timeout_s
        await self.flush(timeout_s)
        tasks = [*self._lane_tasks, *self._replacements]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        producers = [
            p for p in (self._producer, *self._private_producers, *self._retired) if p is not None
        ]
        try:
            await asyncio.wait_for(
                asyncio.gather(*(p.stop() for p in producers)),
                max(0.1, deadline_s - time.monotonic()),
            )
        except TimeoutError:
            log.warning("producer.stop_timeout", num_unacked=self._num_unacked)

    def _on_task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("producer.task_died", task=task.get_name(), error=repr(task.exception()))
            self.failed.set()

    async def _drain_lane(self, topic: str, lane: deque[Outgoing]) -> None:
        try:
            while lane:
                head = lane[0]
                if head.is_done:  # expired while it waited: skipped
                    lane.popleft()
                elif _is_batched(head):
                    await self._send_batched(topic, lane)
                else:
                    await self._send(head)
                    lane.popleft()
        finally:
            del self._lanes[topic]
            for message in lane:  # cancelled (stop): fail what never went out
                self._done(message, asyncio.CancelledError())

    def _expire_due(self) -> None:
        """Fail every message past its deadline; arm the timer for the next one."""
        self._deadline_timer = None
        loop = asyncio.get_running_loop()
        by_deadline = self._by_deadline
        while by_deadline:
            message = by_deadline[0]
            if not message.is_done and message.deadline_s > loop.time():
                self._deadline_timer = loop.call_at(message.deadline_s, self._expire_due)
                return
            by_deadline.popleft()
            if not message.is_done:
                self._expire(message)

    def _expire(self, message: Outgoing) -> None:
        error = DeliveryTimeout(f"not acknowledged within {self._delivery_timeout_s} s")
        self._done(message, error)
        self._isolate(message)

    async def _send_batched(self, topic: str, lane: deque[Outgoing]) -> None:
        """The run of batched messages at the head of `lane` (`_is_batched`), handed to aiokafka
        as one batch per partition (`send_batch`), each in the lane's order, then taken off the
        lane. `send` costs a coroutine, a metadata check and a future per message: at W2 (a
        step's 32 token messages at once, over the shared reply topic's partitions) the
        batches took the event loop's CPU a message from 46 to 34 us in aiokafka alone
        (loadtest/JOURNAL.md). Outcomes stay per message: a batch's ack or error is told to
        each of its messages, and a deadline still fails a message on its own.

        `send_batch` waits until the partition's last batch has left for the broker, and a
        broker takes one produce request at a time from a producer: where a partition still has
        something of ours unacknowledged, a batch would hold the lane, every partition behind
        it, for a slow broker's round trip (Kafka spreads a topic's partitions over brokers).
        So that partition's messages take `send` this time (appended to aiokafka's open batch,
        no wait), and so do the ones that did not fit in the batch."""
        producer = self._producer_for(topic)
        by_partition: dict[int, list[Outgoing]] = {}
        count = 0
        for message in lane:
            if not _is_batched(message):
                break
            count += 1
            if not message.is_done:
                by_partition.setdefault(message.partition, []).append(message)
        for partition, messages in by_partition.items():
            where = (topic, partition)
            last = self._unacked_by_partition.get(where)
            num_batched = 0
            if last is None or last.done():  # nothing of ours waits in aiokafka there
                batch = producer.create_batch()
                for message in messages:
                    metadata = batch.append(
                        key=message.key, value=message.value, timestamp=None,
                        headers=message.headers,
                    )  # fmt: skip
                    if metadata is None:  # full (a batch's first message always fits)
                        break
                    message.producer = producer
                    num_batched += 1
                batched = messages[:num_batched]
                self._track(where, await self._submit(producer, batch, topic, partition, batched))
            for message in messages[num_batched:]:
                self._track(where, await self._send(message))
        for _ in range(count):  # handed over (a cancelled stop fails what is still here)
            lane.popleft()

    def _track(self, where: tuple[str, int], delivery: asyncio.Future | None) -> None:
        """`delivery` is the last thing handed to aiokafka for partition `where`: remembered
        until it is acknowledged (or failed), and forgotten then, unless a later one took
        its place."""
        if delivery is None:
            return
        self._unacked_by_partition[where] = delivery

        def forget(future: asyncio.Future) -> None:
            if self._unacked_by_partition.get(where) is future:
                del self._unacked_by_partition[where]

        delivery.add_done_callback(forget)

    async def _submit(
        self, producer, batch, topic: str, partition: int, messages: list[Outgoing]
    ) -> asyncio.Future | None:
        try:
            delivery = await producer.send_batch(batch, topic, partition=partition)
        except (KafkaError, ValueError, TypeError, AssertionError) as error:
            for message in messages:
                self._done(message, error)
            return None

        def done(future: asyncio.Future) -> None:
            error = _error_of(future)
            for message in messages:
                self._done(message, error)

        delivery.add_done_callback(done)
        return delivery

    async def _send(self, message: Outgoing) -> asyncio.Future | None:
        message.producer = self._producer_for(message.topic)
        try:
            delivery = await message.producer.send(
                message.topic, message.value, key=message.key, headers=message.headers,
                partition=message.partition,
            )  # fmt: skip
        # e.g. too large, no metadata; aiokafka asserts that a chosen partition exists
        except (KafkaError, ValueError, TypeError, AssertionError) as error:
            self._done(message, error)
            return None
        delivery.add_done_callback(lambda fut, m=message: self._done(m, _error_of(fut)))
        return delivery

    def _done(self, message: Outgoing, error: BaseException | None) -> None:
        if message.is_done:  # expired, then acknowledged (or failed) late: already told
            return
        message.is_done = True
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


def _is_batched(message: Outgoing) -> bool:
    """Whether `message` goes out in a batch (`Publisher._send_batched`): it names its
    partition (replies to the shared reply topic do) and is small. The others take `send`:
    its partitioner picks the partition by key, and it checks a message against
    `max_request_size` (a batch is not checked before the broker sees it)."""
    return message.partition is not None and (
        len(message.value) + len(message.key or b"") <= MAX_BATCHED_BYTES
    )


def _error_of(future: asyncio.Future) -> BaseException | None:
    if future.cancelled():
        return asyncio.CancelledError()
    return future.exception()
