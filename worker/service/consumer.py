"""The request consumer: one aiokafka group member that polls, routes, applies backpressure and
commits watermarks.

- Commits are manual and only up to each partition's watermark (`OffsetTracker`): a request's
  offset counts as done once its final (or dead letter) is acknowledged by the broker.
- At `max_num_inflight` unfinished messages, or `max_inflight_bytes` of their estimated memory,
  the assigned partitions are paused, so the worker never buffers without bound, and resumed as
  soon as there is room. Below the bounds it reads ahead of the engine, so that the batcher can
  admit by urgency (see `LimitSettings`).
- Urgency lanes (contract v1.2): the worker consumes `<request topic>.critical`, `.high` and
  the base topic. A poll's records are handled most urgent lane first, and the lanes pause in
  reverse: the base topic at the bounds, the high lane `num_urgent_reserve / 2` requests later,
  the critical lane `num_urgent_reserve` later. So a backlog of bulk work, paused in Kafka,
  never stands in front of a critical request.
- On revocation, finished work is committed first (after letting in-flight finals land). The
  rebalance is eager (every partition revoked, most given back): the revoked partitions are
  suspended, and only those that did not come back have their unfinished jobs dropped (the next
  owner redoes them); jobs of the others run on, and fetching resumes after them.
- A bad message is routed (DLQ or error final), never raised: the poll loop catches only what a
  broker can throw at it, and logs and goes on. Handling one record is total: a bug while
  handling it dead-letters that record (reason `internal`), so no message can kill the task and,
  with it, every worker that takes the partition over.
- Every record is stamped with its partition's assignment epoch (`OffsetTracker`); a record of a
  partition revoked meanwhile (during an await) is not ours any more and is left alone. A record
  of a partition aiokafka says is ours but the tracker does not hold yet (mid-listener) is never
  dropped: the partition is sought back to it, so it comes again (logged and counted).
- aiokafka marks a new assignment done before it awaits `on_partitions_assigned`, so `getmany`
  returns records of newly assigned partitions while the listener awaits: those partitions are
  tracked before the listener's first await.
- An offset gap within an epoch (a record past the one after the last seen) is fetched again,
  up to `kafka.max_gap_refetches` times (3), before it is believed (worker/offset_gaps.py):
  the embedded broker can hide a batch from a fetch that races its write, and the watermark
  would then commit over requests never read. A real gap (a transaction marker, compaction)
  stays and is accepted. An epoch's first record is checked against the partition's
  position at the assignment (its committed offset).
- A record aiokafka cannot return (`RecordTooLargeError`: bigger than the fetch size) is skipped
  by aiokafka; its offset is tracked and a stub dead letter written for it, so the watermark
  never commits over it silently.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import IllegalStateError, KafkaError, RecordTooLargeError

from schemas.contract import DeadLetterReason
from worker.offset_gaps import OffsetGaps
from worker.service.dead_letters import DeadLetterWriter
from worker.service.offsets import OffsetTracker
from worker.service.pipeline import Pipeline, max_prompt_memory
from worker.service.publisher import Publisher
from worker.service.routing import DeadLetter, Rejected, RoutingPolicy, route, safe_for_log
from worker.service.settings import WorkerSettings
from worker.service.telemetry import Telemetry
from worker.service.topics import TopicAdmin, TopicCreationRefused

log = structlog.get_logger(__name__)

REVOKE_FLUSH_TIMEOUT_S = 5.0
EXPECT_START_TIMEOUT_S = 5.0  # all of an assignment's start positions, together


class RequestConsumer:
    def __init__(
        self,
        settings: WorkerSettings,
        bootstrap_servers: str,
        pipeline: Pipeline,
        publisher: Publisher,
        dead_letters: DeadLetterWriter,
        topics: TopicAdmin,
        policy: RoutingPolicy,
        telemetry: Telemetry,
        tracker: OffsetTracker,
    ) -> None:
        kafka = settings.kafka
        self._settings = settings
        self._pipeline = pipeline
        self._publisher = publisher
        self._dead_letters = dead_letters
        self._topics = topics
        self._policy = policy
        self._telemetry = telemetry
        self.tracker = tracker
        # The last request done: the next fetch waits as an idle worker's does, not the busy
        # wait (the poll that would set it may still be waiting: `poll_timeout_ms`).
        tracker.on_idle = self._on_idle
        self._max_num_inflight = settings.limits.max_num_inflight
        self._max_inflight_bytes = settings.limits.max_inflight_bytes
        limits = settings.limits
        self._max_job_bytes = limits.max_message_bytes + max_prompt_memory(limits.max_prompt_chars)
        # topic -> its lane's rank (0: the most urgent lane; the base topic is last).
        self._lane_ranks = {t: r for r, t in enumerate(kafka.request_topics)}
        self._num_extra = lane_reserves(len(self._lane_ranks), limits.num_urgent_reserve)
        self._is_polling = True
        self._admissions: set[asyncio.Task] = set()  # requests waiting for their reply topic
        self._is_paused = False
        # What the fetches were last told to wait; None: aiokafka's fetcher cannot be told.
        self.fetch_wait_ms: int | None = kafka.fetch_max_wait_ms
        self.poll_timeout_ms: int = kafka.fetch_max_wait_ms  # the last poll's (poll_timeout_ms)
        self._held: set[TopicPartition] = set()  # paused until the rebalance listener settles them
        self._gaps = OffsetGaps(settings.kafka.max_gap_refetches, what="requests")
        self._in_flight_at_revoke: dict[TopicPartition, int] = {}
        self.last_poll_ok_s: float | None = None  # monotonic; readiness asks how recent it is
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap_servers,
            group_id=kafka.group_id,
            group_instance_id=kafka.group_instance_id,
            client_id=f"{kafka.client_id}-consumer",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=kafka.session_timeout_ms,
            heartbeat_interval_ms=kafka.heartbeat_interval_ms,
            max_poll_interval_ms=kafka.max_poll_interval_ms,
            request_timeout_ms=kafka.request_timeout_ms,
            fetch_max_wait_ms=kafka.fetch_max_wait_ms,
            max_partition_fetch_bytes=max(1 << 20, settings.limits.max_message_bytes + (64 << 10)),
            **kafka.client_options(),
        )

    @property
    def assignment(self) -> set[TopicPartition]:
        return set(self._consumer.assignment())

    @property
    def is_paused(self) -> bool:
        """Whether backpressure paused the assigned partitions."""
        return bool(self._consumer.paused())

    async def start(self) -> None:
        await self._consumer.start()
        self._consumer.subscribe(list(self._lane_ranks), listener=_Rebalance(self))

    def stop_polling(self) -> None:
        self._is_polling = False

    async def run(self) -> None:
        while self._is_polling:
            self._apply_backpressure()
            wait_ms = fetch_wait_ms(self._settings.kafka, self.tracker.num_unfinished)
            self._set_fetch_wait(wait_ms)
            room = self._room()
            self.poll_timeout_ms = poll_timeout_ms(
                self._settings.kafka, wait_ms, is_any_paused=bool(self._consumer.paused())
            )
            try:
                batches = await poll_lanes_first(
                    self._consumer, *self._urgent_lanes(), room, self.poll_timeout_ms
                )
            except RecordTooLargeError as error:
                self.on_record_too_large(error)
                continue
            except KafkaError as error:
                log.warning("consumer.poll_failed", error=repr(error))
                await asyncio.sleep(1.0)
                continue
            self.last_poll_ok_s = time.monotonic()
            # Most urgent lane first: a critical request is admitted before the bulk read with it.
            for partition in sorted(batches, key=self._lane_rank):
                for record in batches[partition]:
                    if not self._handle(partition, record):
                        break  # sought back: the rest of this batch comes again
            await self.commit()

    def _set_fetch_wait(self, wait_ms: int) -> None:
        """The wait aiokafka's next fetch requests carry. aiokafka takes it only at construction
        (its fetcher's `_fetch_max_wait_ms`, read for each request: 0.14's Fetcher); where that
        attribute is missing, the fetches keep the idle wait and this says so once."""
        if self.fetch_wait_ms in (wait_ms, None):
            return
        fetcher = getattr(self._consumer, "_fetcher", None)
        if not hasattr(fetcher, "_fetch_max_wait_ms"):
            log.warning("consumer.fetch_wait_fixed", reason="aiokafka's fetcher changed")
            self.fetch_wait_ms = None
            return
        fetcher._fetch_max_wait_ms = wait_ms
        self.fetch_wait_ms = wait_ms

    def _on_idle(self) -> None:
        """Nothing in flight any more: fetches from now on wait the idle time. On a broker that
        holds a fetch for most of its wait (the embedded one), a request sent just after the
        last one finished otherwise waited in a fetch that still carried the busy wait: the
        poll that resets it waits as long (`poll_timeout_ms`), and one-stream TTFT through the
        worker rose by ~30 ms at the median when the poll began to follow the fetch wait."""
        self._set_fetch_wait(fetch_wait_ms(self._settings.kafka, 0))

    def fetcher_wait_ms(self) -> int | None:
        """What aiokafka's next fetch request will carry (for tests and diagnostics)."""
        return getattr(getattr(self._consumer, "_fetcher", None), "_fetch_max_wait_ms", None)

    def _handle(self, partition: TopicPartition, record) -> bool:
        """Track and route one record; False when it was not taken (the rest of its batch
        must not be either)."""
        received_s = time.monotonic()
        expected = self.tracker.next_offset(partition)
        if expected is None:  # the epoch's first record: against the assignment's position
            expected = self._gaps.expected(partition)
        back = self._gaps.check_expected(partition, record.offset, expected)
        if back is not None:  # a gap: fetched again before it is believed
            return self._fetch_again(partition, back, "offset_gap")
        epoch = self.tracker.add(partition, record.offset)
        if epoch is None:
            return self._untracked(partition, record.offset)
        with structlog.contextvars.bound_contextvars(
            request_id=None, partition=partition.partition, offset=record.offset
        ):
            try:
                self._route(partition, record, received_s, epoch)
            except Exception as error:  # a bug: park this record, keep the partition moving
                log.exception("request.handling_failed")
                self._dead_letter_bug(partition, record, f"{type(error).__name__}: {error}", epoch)
        return True

    def _dead_letter_bug(self, partition, record, message: str, epoch) -> None:
        """Dead-letter a record whose handling hit a bug; never raises. The letter can fail on
        what made the handling fail (a header or message the strict encoding refuses): then a
        stub goes (no original key, value or headers; an ASCII message). If even that raises,
        the offset stays unfinished: redelivered after a restart, never committed over."""
        letter = DeadLetter(DeadLetterReason.INTERNAL, message)
        try:
            self._dead_letter(partition, record, letter, epoch)
            return
        except Exception:
            log.exception("request.dead_letter_failed", fallback="stub")
        stub = DeadLetter(DeadLetterReason.INTERNAL, ascii(message)[:500])
        try:
            self._dead_letter(partition, _SkippedRecord(record.offset), stub, epoch)
        except Exception:
            log.exception("request.dead_letter_failed", fallback=None)

    def _untracked(self, partition: TopicPartition, offset: int) -> bool:
        """A record the tracker does not take. Its partition revoked meanwhile: the next owner's,
        left alone. Still assigned (a rebalance listener has not settled it yet): aiokafka's
        position has moved past it, so seek back to it; it is fetched again, never lost."""
        if partition not in self._consumer.assignment():
            return False
        log.warning("consumer.record_refetched", partition=partition.partition, offset=offset)
        return self._fetch_again(partition, offset, "untracked")

    def _fetch_again(self, partition: TopicPartition, offset: int, reason: str) -> bool:
        """Seek `partition` back to `offset` (counted by `reason`): what follows is fetched
        again. False: the record in hand, and the rest of its batch, are not taken."""
        self._telemetry.records_refetched.add(
            1, {"messaging.destination.name": partition.topic, "reason": reason}
        )
        self._consumer.seek(partition, offset)
        return False

    def _route(self, partition: TopicPartition, record, received_s: float, epoch) -> None:
        decision = route(record.value, record.headers, self._policy)
        if isinstance(decision, DeadLetter):
            self._dead_letter(partition, record, decision, epoch)
            return
        structlog.contextvars.bind_contextvars(request_id=safe_for_log(decision.request_id))
        if self._topics.is_known(decision.reply_to, decision.reply_partition):
            self._admit(partition, record, decision, received_s, epoch)
            return
        # A reply topic to create: out of line, so that polling (and every other request) goes
        # on while the broker answers; the offset is tracked already, so nothing is committed
        # past it meanwhile.
        task = asyncio.create_task(
            self._admit_after_topic(partition, record, decision, received_s, epoch)
        )
        self._admissions.add(task)
        task.add_done_callback(self._admissions.discard)

    async def _admit_after_topic(self, partition, record, decision, received_s, epoch) -> None:
        with structlog.contextvars.bound_contextvars(
            request_id=safe_for_log(decision.request_id), partition=partition.partition,
            offset=record.offset,
        ):  # fmt: skip
            try:
                try:
                    await self._topics.ensure_reply_topic(
                        decision.reply_to, decision.reply_partition
                    )
                except (TopicCreationRefused, KafkaError, OSError, TimeoutError) as error:
                    if self.tracker.is_current(partition, epoch):
                        letter = DeadLetter(DeadLetterReason.REPLY_TOPIC_UNAVAILABLE, repr(error))
                        self._dead_letter(partition, record, letter, epoch)
                    return
                self._admit(partition, record, decision, received_s, epoch)
            except Exception as error:  # a bug: park this record, keep the partition moving
                log.exception("request.handling_failed")
                if self.tracker.is_current(partition, epoch):
                    self._dead_letter_bug(partition, record, type(error).__name__, epoch)

    def _admit(self, partition, record, decision, received_s: float, epoch) -> None:
        if not self.tracker.is_current(partition, epoch):
            return  # revoked meanwhile: the next owner handles it
        if isinstance(decision, Rejected):
            self._pipeline.reject(decision, partition, record, received_s, epoch)
        else:
            self._pipeline.accept(decision, partition, record, received_s, epoch)

    def _dead_letter(self, partition: TopicPartition, record, letter: DeadLetter, epoch) -> None:
        self._dead_letters.write(partition, record, letter.reason, letter.message, epoch=epoch)

    def on_record_too_large(self, error: RecordTooLargeError) -> None:
        """aiokafka skipped a record it cannot return (it already moved past it): track its
        offset and dead-letter a stub for it, so the commit passes it only once that is done."""
        skipped = skipped_record(error)
        log.error("consumer.record_too_large", error=str(error)[:500])
        if skipped is None:
            return
        partition, offset = skipped
        epoch = self.tracker.add(partition, offset)
        if epoch is None:
            return
        record = _SkippedRecord(offset)
        message = f"record at offset {offset} is larger than the fetch size; not read"
        self._dead_letter(partition, record, DeadLetter(DeadLetterReason.TOO_LARGE, message), epoch)

    def _lane_rank(self, partition: TopicPartition) -> int:
        return self._lane_ranks.get(partition.topic, len(self._lane_ranks))

    def _bounds_of(self, rank: int) -> tuple[int, int]:
        """(requests, bytes) the lane of `rank` may hold in flight before it pauses."""
        extra = self._num_extra[min(rank, len(self._num_extra) - 1)]
        return (
            self._max_num_inflight + extra,
            self._max_inflight_bytes + extra * self._max_job_bytes,
        )

    def _is_full(self, rank: int) -> bool:
        max_num, max_bytes = self._bounds_of(rank)
        return self.tracker.num_unfinished >= max_num or self._pipeline.inflight_bytes >= max_bytes

    def _room_of(self, rank: int) -> int:
        """How many more records the lane of `rank` may take. One poll may overshoot the byte
        budget by at most one message: no more records than could each be as large as the
        largest request and still fit."""
        max_num, max_bytes = self._bounds_of(rank)
        room = max_num - self.tracker.num_unfinished
        return min(room, (max_bytes - self._pipeline.inflight_bytes) // self._max_job_bytes)

    def _room(self) -> int:
        """Records the next poll may return: the room of the least urgent lane still open (a
        poll cannot say which partitions its records come from)."""
        open_ranks = [self._lane_rank(p) for p in self.assignment - self._consumer.paused()]
        return max(1, self._room_of(max(open_ranks, default=len(self._lane_ranks) - 1)))

    def _urgent_lanes(self) -> tuple[list[list[TopicPartition]], list[int]]:
        """The assigned partitions of each urgency lane (not the base topic), most urgent
        first, and each lane's room."""
        base_rank = len(self._lane_ranks) - 1
        lanes: list[list[TopicPartition]] = [[] for _ in range(base_rank)]
        for partition in self.assignment:
            rank = self._lane_rank(partition)
            if rank < base_rank:
                lanes[rank].append(partition)
        return lanes, [self._room_of(rank) for rank in range(base_rank)]

    def _apply_backpressure(self) -> None:
        """Pause each lane at its bound (the base topic first), resume it below."""
        paused = self._consumer.paused()
        to_pause, to_resume = [], []
        for partition in self.assignment:
            is_lane_full = self._is_full(self._lane_rank(partition))
            if is_lane_full and partition not in paused:
                to_pause.append(partition)
            elif not is_lane_full and partition in paused and partition not in self._held:
                to_resume.append(partition)
        if to_pause:
            self._consumer.pause(*to_pause)
        if to_resume:
            self._consumer.resume(*to_resume)
        is_full = self._is_full(len(self._lane_ranks) - 1)
        if is_full != self._is_paused:
            self._is_paused = is_full
            log.info(
                "consumer.paused" if is_full else "consumer.resumed",
                num_inflight=self.tracker.num_unfinished,
                inflight_bytes=self._pipeline.inflight_bytes,
            )

    async def commit(self, partitions: set[TopicPartition] | None = None) -> None:
        """Commit the watermarks that moved, of `partitions` (default: all assigned ones)."""
        offsets = self.tracker.to_commit(self.assignment if partitions is None else partitions)
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
        except KafkaError as error:  # mid-rebalance: the next commit, or the next owner, catches up
            log.warning("consumer.commit_failed", error=repr(error))
            return
        self.tracker.mark_committed(offsets)

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """The start of a rebalance. aiokafka's protocol is eager: every partition is revoked,
        most come back at the end of the same rebalance. So nothing is dropped here: finished
        work is committed, the partitions' epochs are suspended and their jobs run on;
        `on_assigned` drops only the jobs of partitions that moved."""
        if not revoked:
            return
        # Finals already on their way are finished work: let them land, then commit them.
        await self._publisher.flush(timeout_s=REVOKE_FLUSH_TIMEOUT_S)
        await self.commit(revoked)
        self.tracker.suspend(revoked)
        for partition in revoked:  # a kept one goes on from the tracker's epoch
            self._gaps.forget(partition)
        self._in_flight_at_revoke = {p: len(self._pipeline.jobs_of([p])) for p in revoked}
        log.info(
            "consumer.revoked",
            partitions=sorted(p.partition for p in revoked),
            num_in_flight=sum(self._in_flight_at_revoke.values()),
        )

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        """The end of a rebalance. A suspended partition that came back, with the group's
        committed offset still the one this worker committed (nobody else took it meanwhile),
        resumes its epoch: its jobs go on and fetching continues after the last record seen
        (not from the committed offset: those records are in flight here). The jobs of every
        other suspended partition are dropped without a final: the new owner redoes them.

        Partitions new to this worker are tracked before the first await: aiokafka already
        returns their records while this listener awaits."""
        self.tracker.assign(assigned - self.tracker.suspended)
        # The ones that may come back are not fetched until known (from the committed offset,
        # or, if kept, from after the last record seen).
        self._held = assigned & self.tracker.suspended
        self._consumer.pause(*self._held)
        try:
            kept = await self._settle(assigned)
        finally:
            self._consumer.resume(*self._held)
            self._held = set()
        self._drop_moved(assigned, kept)
        await self._expect_starts(assigned - set(kept))

    async def _expect_starts(self, partitions: set[TopicPartition]) -> None:
        """Where each partition of a new epoch starts (its committed offset, or the reset's),
        so that a gap before its first record is fetched again too. Skipped for a partition
        that already has records, and on any error (the check then starts at the first record)."""
        deadline_s = time.monotonic() + EXPECT_START_TIMEOUT_S  # for them all: bounded
        for partition in sorted(partitions):
            if self.tracker.next_offset(partition) is not None:
                continue
            try:
                position = await asyncio.wait_for(
                    self._consumer.position(partition), max(0.0, deadline_s - time.monotonic())
                )
            except (KafkaError, TimeoutError, AssertionError, IllegalStateError) as error:
                log.debug(
                    "consumer.start_unknown", partition=partition.partition, error=repr(error)
                )
                continue
            if self.tracker.next_offset(partition) is None:  # still nothing read meanwhile
                self._gaps.expect(partition, position)

    async def _settle(self, assigned: set[TopicPartition]) -> list[TopicPartition]:
        """Resume the suspended partitions that came back unchanged; returns them."""
        kept = []
        for partition in sorted(assigned & self.tracker.suspended):
            if await self._committed_unchanged(partition):
                next_offset = self.tracker.resume(partition)
                if next_offset is not None:
                    self._consumer.seek(partition, next_offset)
                kept.append(partition)
        return kept

    def _drop_moved(self, assigned: set[TopicPartition], kept: list[TopicPartition]) -> None:
        """Drop the jobs of suspended partitions that did not come back unchanged."""
        moved = self.tracker.forget_suspended()
        num_dropped = self._pipeline.drop(self._pipeline.jobs_of(moved), "revoked")
        self.tracker.assign(assigned)
        log.info(
            "consumer.assigned",
            partitions=sorted(p.partition for p in assigned),
            kept=sorted(p.partition for p in kept),
            # jobs in flight at the revocation that went on: not dropped, not redone
            num_kept=sum(self._in_flight_at_revoke.get(p, 0) for p in kept),
            moved=sorted(p.partition for p in moved),
            num_dropped=num_dropped,
        )

    async def _committed_unchanged(self, partition: TopicPartition) -> bool:
        try:
            committed = await self._consumer.committed(partition)
        except KafkaError as error:  # unknown: treat as moved (redone: at-least-once)
            log.warning("consumer.committed_unknown", error=repr(error))
            return False
        return committed == self.tracker.committed_when_suspended(partition)

    def lags(self) -> dict[TopicPartition, int]:
        """Per assigned partition: the broker's high watermark (from the last fetch) minus the
        next offset to consume. A hint only: some brokers report the watermark late."""
        lags = {}
        for partition in self.assignment:
            highwater = self._consumer.highwater(partition)
            position = self.tracker.next_offset(partition)
            if highwater is not None and position is not None:
                lags[partition] = max(0, highwater - position)
        return lags

    @property
    def num_paused(self) -> int:
        return len(self._consumer.paused())

    async def close(self) -> None:
        """Leave the group. aiokafka can hang here when a topic vanished, so it is bounded."""
        for task in list(self._admissions):
            task.cancel()
        await asyncio.gather(*self._admissions, return_exceptions=True)
        try:
            await asyncio.wait_for(
                self._consumer.stop(), self._settings.kafka.consumer_stop_timeout_s
            )
        except TimeoutError:
            log.warning("consumer.stop_timeout")


def fetch_wait_ms(kafka, num_unfinished: int) -> int:
    """How long the next fetch may wait for data: `fetch_max_wait_ms` while the worker has
    nothing in flight, the longer `fetch_max_wait_busy_ms` while it works. A fetch that finds
    nothing costs the event loop and the broker CPU on the cores the engine steps on, and an
    empty fetch every 20 ms was half of both (W2 through the embedded broker); while the engine
    is busy a request read later joins a later step anyway. Apache Kafka answers as soon as
    data arrive, so there the longer wait costs no latency; the embedded broker holds an empty
    fetch for the whole wait, so a request arriving while the worker works waits up to it."""
    if num_unfinished == 0:
        return kafka.fetch_max_wait_ms
    return max(kafka.fetch_max_wait_ms, kafka.fetch_max_wait_busy_ms)


async def poll_lanes_first(
    consumer: AIOKafkaConsumer,
    lanes: list[list[TopicPartition]],
    lane_rooms: list[int],
    room: int,
    wait_ms: int,
) -> dict[TopicPartition, list]:
    """One poll, the urgency lanes' records first. aiokafka hands out what it has fetched
    partition by partition, in the order the fetches came back, up to `max_records`: a critical
    record fetched together with a thousand low ones (the read-ahead) came out only after them,
    polls later (0.8 s in the 2,000-request backlog run). So each lane's partitions (most urgent
    lane first) are drained on their own, without waiting, up to the lane's room; then a plain
    poll takes the rest up to `room`, waiting up to `wait_ms` only when the lanes had nothing."""
    batches: dict[TopicPartition, list] = {}
    for partitions, lane_room in zip(lanes, lane_rooms, strict=True):
        if partitions:
            got = await consumer.getmany(*partitions, timeout_ms=0, max_records=max(1, lane_room))
            _merge(batches, got)
    rest = await consumer.getmany(timeout_ms=0 if batches else wait_ms, max_records=max(1, room))
    _merge(batches, rest)
    return batches


def _merge(batches: dict[TopicPartition, list], more: dict[TopicPartition, list]) -> None:
    for partition, records in more.items():
        batches.setdefault(partition, []).extend(records)


def poll_timeout_ms(kafka, fetch_wait: int, is_any_paused: bool) -> int:
    """How long one poll may wait for records: as long as the fetches wait (`fetch_wait`), so
    the loop wakes once per fetch and not every `fetch_max_wait_ms` as well. A poll returns as
    soon as records come, so nothing is read later for it; what waits is the loop's own
    bookkeeping: commits (at-least-once either way: a later commit only means more redone after
    a crash) and, with a partition paused, the resume once there is room again. So with any
    partition paused (the bounds reached, or held through a rebalance) the short idle wait
    stands, and a freed slot is filled as soon as before; and when the last request in flight is
    done, the fetches go back to the idle wait at once (`_on_idle`), not at the next poll. One
    stream of 1,024 tokens through the embedded broker, 2 alternating runs: the loop's CPU
    0.41-0.43 s against 0.46-0.50 with a poll every 20 ms throughout, the broker's 0.38-0.42
    against 0.42-0.45."""
    if is_any_paused:
        return kafka.fetch_max_wait_ms
    return fetch_wait


def lane_reserves(num_lanes: int, num_reserve: int) -> list[int]:
    """Per lane rank (0 = most urgent): how many requests it may read past the bounds. The most
    urgent lane gets the whole reserve, the base topic (last) none, those between a share."""
    if num_lanes <= 1:
        return [0] * num_lanes
    return [num_reserve * (num_lanes - 1 - r) // (num_lanes - 1) for r in range(num_lanes)]


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, owner: RequestConsumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked) -> None:
        await self._owner.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        await self._owner.on_assigned(set(assigned))


class _SkippedRecord:
    """Stands in for a record aiokafka skipped: only its offset is known."""

    key = None
    value = None
    headers: list = []

    def __init__(self, offset: int) -> None:
        self.offset = offset


def skipped_record(error: RecordTooLargeError) -> tuple[TopicPartition, int] | None:
    """(partition, offset) of the record aiokafka skipped, from the error's arguments."""
    partitions = [a for a in error.args if isinstance(a, TopicPartition)]
    offsets = [a for a in error.args if isinstance(a, int) and not isinstance(a, bool)]
    if not partitions or not offsets:
        return None
    return partitions[0], offsets[0]
