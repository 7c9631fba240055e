"""The publisher's lanes: a topic that never acknowledges holds only its own messages, each of
which fails with `DeliveryTimeout` at its deadline (a late ack is ignored), and a stuck topic
holds at most `max_num_lane_messages` of them (more fail at once with `LaneFull`). Neither error
is retried by `deliver`.

No broker: a fake producer whose sends to the stuck topic are never acknowledged (as an
idempotent producer retrying NOT_ENOUGH_REPLICAS forever), and whose sends block once that
topic's batch is "full" (as aiokafka's `send` waits for room). The end-to-end version, through
the fault-injecting proxy, is in test_stuck_reply_topic.py.
"""

from __future__ import annotations

import asyncio

from aiokafka.errors import KafkaTimeoutError
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.service.delivery import deliver
from worker.service.publisher import (
    MAX_BATCHED_BYTES,
    DeliveryTimeout,
    LaneFull,
    Outgoing,
    Publisher,
)
from worker.service.settings import WorkerSettings


class StuckProducer:
    """Sends to `stuck` are taken (their futures never complete) until `batch_size` are
    pending, then `send` itself blocks, as aiokafka's does on a full batch."""

    def __init__(self, stuck: str, batch_size: int = 2) -> None:
        self.stuck, self.batch_size = stuck, batch_size
        self.pending: list[asyncio.Future] = []
        self.sent: list[tuple[str, bytes]] = []
        self.never = asyncio.Event()

    async def send(self, topic, value, key=None, headers=None, partition=None):
        future = asyncio.get_running_loop().create_future()
        if topic == self.stuck:
            if len(self.pending) >= self.batch_size:
                await self.never.wait()
            self.pending.append(future)
        else:
            future.set_result(None)
        self.sent.append((topic, value))
        return future


def make_publisher(producer, delivery_timeout_s: float = 0.2, max_lane: int = 1000) -> Publisher:
    settings = WorkerSettings(
        publisher={"delivery_timeout_s": delivery_timeout_s, "max_num_lane_messages": max_lane}
    )
    publisher = Publisher(settings, "127.0.0.1:1")
    publisher._producer = producer
    return publisher


async def cancel_lanes(publisher: Publisher) -> None:
    """The test's end: the lane tasks still running (a stuck topic's) cancelled and awaited."""
    for task in publisher._lane_tasks:
        task.cancel()
    await asyncio.gather(*publisher._lane_tasks, return_exceptions=True)


async def test_a_stuck_topic_fails_at_its_deadline_and_the_others_are_acknowledged() -> None:
    producer = StuckProducer("stuck")
    publisher = make_publisher(producer)
    outcomes: dict[bytes, BaseException | None] = {}
    try:
        for i in range(6):  # more than fit in the stuck "batch": the stuck lane's send blocks
            for topic in ("stuck", "ok"):
                value = f"{topic}{i}".encode()
                publisher.publish(
                    Outgoing(topic, None, value, [], lambda e, v=value: outcomes.__setitem__(v, e))
                )
        assert await publisher.flush(5)  # bounded by the deadline, not by the stuck topic
        assert all(outcomes[f"ok{i}".encode()] is None for i in range(6))
        assert all(isinstance(outcomes[f"stuck{i}".encode()], DeliveryTimeout) for i in range(6))
        producer.pending[0].set_result(None)  # a late ack: already failed, not told twice
        await asyncio.sleep(0)
        assert len(outcomes) == 12 and publisher._num_unacked == 0
        assert not publisher.failed.is_set()
    finally:
        await cancel_lanes(publisher)


@settings(max_examples=20, deadline=None)
@given(max_lane=st.integers(1, 5), num_messages=st.integers(1, 12))
def test_a_stuck_lane_holds_at_most_its_bound(max_lane: int, num_messages: int) -> None:
    async def run() -> None:
        producer = StuckProducer("stuck", batch_size=0)  # every send to it blocks
        publisher = make_publisher(producer, delivery_timeout_s=30, max_lane=max_lane)
        errors: list[BaseException | None] = []
        try:
            for i in range(num_messages):
                publisher.publish(Outgoing("stuck", None, b"%d" % i, [], errors.append))
            await asyncio.sleep(0.01)
            assert publisher.num_queued == min(num_messages, max_lane)
            assert len(errors) == max(0, num_messages - max_lane)
            assert all(isinstance(e, LaneFull) for e in errors)
        finally:
            await cancel_lanes(publisher)

    asyncio.run(run())


async def test_deliver_does_not_retry_past_the_deadline() -> None:
    producer = StuckProducer("stuck")
    publisher = make_publisher(producer, delivery_timeout_s=0.05)
    try:
        outcome = deliver(publisher, lambda: Outgoing("stuck", None, b"f", []), 3, "final")
        error = await asyncio.wait_for(outcome, 2)
    finally:
        await cancel_lanes(publisher)
    assert isinstance(error, DeliveryTimeout)
    assert len(producer.sent) == 1  # tried once: the deadline was the whole budget


class OneRequestAtATimeProducer:
    """As aiokafka's sender: one request in flight per broker, so while a refused batch waits
    for its retry, nothing else of this producer is acknowledged. Sends to `refused` are never
    acknowledged; another topic's are, unless this producer holds a refused one."""

    def __init__(self, refused: str) -> None:
        self.refused = refused
        self.is_holding_refused = False
        self.waiting: list[asyncio.Future] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def send(self, topic, value, key=None, headers=None, partition=None):
        future = asyncio.get_running_loop().create_future()
        if topic == self.refused:
            self.is_holding_refused = True
        elif self.is_holding_refused:
            self.waiting.append(future)  # behind the refused batch's retries
        else:
            future.set_result(None)
        return future


async def test_a_refused_client_topic_does_not_hold_the_shared_reply_topic() -> None:
    """Guards against one producer for every topic: a per-client reply topic that refuses
    writes held every other topic's acknowledgements (aiokafka retries it one request at a
    time per broker), so the shared reply topic's tokens waited for the refused one's deadline
    and its finals failed with it."""
    settings = WorkerSettings(publisher={"delivery_timeout_s": 60, "num_private_producers": 2})
    publisher = Publisher(settings, "127.0.0.1:1")
    shared, refused = settings.kafka.shared_reply_topic_name, "mini-infer.replies.c-refused"
    publisher._producer = OneRequestAtATimeProducer(refused)
    publisher._private_producers = [OneRequestAtATimeProducer(refused) for _ in range(2)]
    assert publisher._producer_for(refused) is not publisher._producer
    assert publisher._producer_for(shared) is publisher._producer
    assert publisher._producer_for(settings.kafka.dlq_topic) is publisher._producer
    outcomes: dict[str, asyncio.Future] = {}
    try:
        for topic in (refused, shared, settings.kafka.dlq_topic):
            for i in range(3):
                outcome = outcomes[f"{topic}{i}"] = asyncio.get_running_loop().create_future()
                publisher.publish(
                    Outgoing(topic, None, b"v", [], lambda e, f=outcome: f.set_result(e))
                )
        others = [outcomes[f"{t}{i}"] for t in (shared, settings.kafka.dlq_topic) for i in range(3)]
        assert await asyncio.wait_for(asyncio.gather(*others), 10) == [None] * 6
        assert not any(outcomes[f"{refused}{i}"].done() for i in range(3))  # still refused
    finally:
        await cancel_lanes(publisher)


async def test_a_refused_client_topic_moves_the_topics_sharing_its_producer_to_a_fresh_one() -> (
    None
):
    """Guards against a refused per-client topic slowing, for good, every client topic that
    shares its private producer: once its message passed the delivery deadline there, the
    other topics go through a fresh producer, and the refused topic stays where it was (its
    order holds)."""
    settings = WorkerSettings(publisher={"delivery_timeout_s": 0.2, "num_private_producers": 1})
    publisher = Publisher(settings, "127.0.0.1:1")
    refused, other = "mini-infer.replies.c-refused", "mini-infer.replies.c-other"
    made: list[OneRequestAtATimeProducer] = []

    def make_producer(enable_idempotence: bool) -> OneRequestAtATimeProducer:
        made.append(OneRequestAtATimeProducer(refused))
        return made[-1]

    publisher._make_producer = make_producer
    publisher._producer = OneRequestAtATimeProducer(refused)
    publisher._private_producers = [make_producer(False)]
    assert publisher._producer_for(other) is publisher._producer_for(refused) is made[0]

    def publish(topic: str) -> asyncio.Future:
        outcome = asyncio.get_running_loop().create_future()
        publisher.publish(Outgoing(topic, None, b"v", [], lambda e: outcome.set_result(e)))
        return outcome

    try:
        assert isinstance(await asyncio.wait_for(publish(refused), 5), DeliveryTimeout)
        for _ in range(100):  # the fresh producer starts on the event loop
            if publisher._producer_for(other) is not made[0]:
                break
            await asyncio.sleep(0.01)
        assert await asyncio.wait_for(publish(other), 5) is None
        assert publisher._producer_for(refused) is made[0] and len(made) == 2
    finally:
        await cancel_lanes(publisher)


class HeldProducer:
    """Takes every send; the test acknowledges them, by index, when it likes."""

    def __init__(self) -> None:
        self.futures: list[asyncio.Future] = []

    async def send(self, topic, value, key=None, headers=None, partition=None):
        future = asyncio.get_running_loop().create_future()
        self.futures.append(future)
        return future


operations = st.lists(
    st.one_of(
        st.just(("publish", 0)),
        st.tuples(st.just("ack"), st.integers(0, 30)),  # of the messages sent so far, modulo
        st.tuples(st.just("advance"), st.integers(1, 15)),  # tenths of the timeout
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_every_message_ends_once_acknowledged_or_at_its_own_deadline(ops) -> None:
    """One timer serves every message's deadline: whatever the order of publishes, acks and
    time passing, a message fails with DeliveryTimeout exactly when its own deadline passed
    unacknowledged, and each is told once. The loop's clock is the test's, so nothing races."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        now = [loop.time()]
        loop.time = lambda: now[0]  # timers fire when the test moves the clock
        producer = HeldProducer()
        publisher = make_publisher(producer, delivery_timeout_s=1.0)
        outcomes: list[list] = []  # per message: what it was told
        published_at: list[float] = []
        acked_at: dict[int, float] = {}

        async def settle() -> None:
            for _ in range(5):
                await asyncio.sleep(0)

        try:
            for op, arg in ops:
                if op == "publish":
                    told: list = []
                    outcomes.append(told)
                    published_at.append(now[0])
                    publisher.publish(Outgoing("t", None, b"m", [], told.append))
                elif op == "ack" and producer.futures:
                    index = arg % len(producer.futures)
                    if not producer.futures[index].done():
                        producer.futures[index].set_result(None)
                        acked_at[index] = now[0]
                else:
                    now[0] += arg / 10
                await settle()
            now[0] += 1.5  # every deadline passes
            await settle()
            for i, told in enumerate(outcomes):
                assert len(told) == 1, (i, told)
                if i in acked_at and acked_at[i] < published_at[i] + 1.0:
                    assert told[0] is None
                else:
                    assert isinstance(told[0], DeliveryTimeout)
            assert publisher._num_unacked == 0
        finally:
            await cancel_lanes(publisher)

    asyncio.run(run())


class BatchingProducer:
    """aiokafka's two ways in: `send` one message, or `create_batch` / `send_batch` (a batch
    holds `capacity` messages: `append` returns None past it). Every hand-over is recorded in
    order as (how, topic, partition, values); futures are acknowledged at once, or failed with
    `error`, or held (`hold`: never completed); `refuse` makes `send_batch` itself raise.
    `waited` counts the `send_batch` calls that aiokafka would have made wait (the partition
    still had something unacknowledged)."""

    class Batch:
        def __init__(self, capacity: int) -> None:
            self.capacity, self.values = capacity, []

        def append(self, *, key, value, timestamp, headers):
            if len(self.values) >= self.capacity:
                return None
            self.values.append(value)
            return object()

    def __init__(self, capacity: int = 1000, error=None, hold=False, refuse=None) -> None:
        self.capacity, self.error, self.hold, self.refuse = capacity, error, hold, refuse
        self.handed: list[tuple[str, str, int | None, list[bytes]]] = []
        self.futures: list[asyncio.Future] = []
        self.by_partition: dict[tuple[str, int | None], list[asyncio.Future]] = {}
        self.waited = 0

    def _future(self, topic, partition) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if self.error is not None:
            future.set_exception(self.error)
        elif not self.hold:
            future.set_result(None)
        self.futures.append(future)
        self.by_partition.setdefault((topic, partition), []).append(future)
        return future

    async def send(self, topic, value, key=None, headers=None, partition=None):
        self.handed.append(("send", topic, partition, [value]))
        return self._future(topic, partition)

    def create_batch(self):
        return self.Batch(self.capacity)

    async def send_batch(self, batch, topic, *, partition):
        if self.refuse is not None:
            raise self.refuse
        assert batch.values, "an empty batch was submitted"
        self.waited += not all(f.done() for f in self.by_partition.get((topic, partition), []))
        self.handed.append(("batch", topic, partition, list(batch.values)))
        return self._future(topic, partition)


messages = st.lists(
    st.tuples(
        st.sampled_from(["shared", "dlq"]),
        st.one_of(st.none(), st.integers(0, 3)),  # None: aiokafka's partitioner (send)
        st.booleans(),  # larger than a batch takes: send
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(messages, st.integers(1, 5))
def test_messages_naming_their_partition_go_in_batches_in_order_each_told_once(
    specs, capacity
) -> None:
    """Whatever the mix of partitions, sizes and batch capacity: every message is handed over
    once, each partition's messages in publish order, each told once; batches hold only small
    messages that name their partition (never none, never over capacity), the others go by
    `send`, and so do those past a full batch; no batch is handed over where aiokafka would
    make it wait."""

    async def run() -> None:
        producer = BatchingProducer(capacity)
        publisher = make_publisher(producer, delivery_timeout_s=30)
        told: dict[bytes, list] = {}
        big = b"x" * (MAX_BATCHED_BYTES + 1)
        expected: dict[tuple[str, int | None], list[bytes]] = {}
        try:
            for i, (topic, partition, is_big) in enumerate(specs):
                value = (big if is_big else b"") + b"%d" % i
                told[value] = []
                expected.setdefault((topic, partition), []).append(value)
                publisher.publish(Outgoing(topic, b"k", value, [], told[value].append,
                                           partition=partition))  # fmt: skip
            assert await publisher.flush(5)
            assert all(outcome == [None] for outcome in told.values())
            handed: dict[tuple[str, int | None], list[bytes]] = {}
            for how, topic, partition, values in producer.handed:
                assert 1 <= len(values) <= capacity
                is_small = all(len(v) <= MAX_BATCHED_BYTES for v in values)
                if how == "batch":  # (a `send`: any message; big ones and None always)
                    assert partition is not None and is_small
                else:
                    assert len(values) == 1
                handed.setdefault((topic, partition), []).extend(values)
            assert handed == expected
            assert publisher._num_unacked == 0 and producer.waited == 0
            assert not publisher._unacked_by_partition  # every ack forgotten
        finally:
            await cancel_lanes(publisher)

    asyncio.run(run())


async def test_a_batch_that_fails_tells_each_of_its_messages() -> None:
    for producer in (
        BatchingProducer(error=KafkaTimeoutError()),  # the batch's future fails
        BatchingProducer(refuse=KafkaTimeoutError()),  # send_batch itself raises
    ):
        publisher = make_publisher(producer, delivery_timeout_s=30)
        told: list[list] = [[] for _ in range(5)]
        for i in range(5):
            publisher.publish(Outgoing("shared", b"k", b"%d" % i, [], told[i].append, partition=1))
        assert await publisher.flush(5)
        assert all(len(t) == 1 and isinstance(t[0], KafkaTimeoutError) for t in told), told
        assert publisher._num_unacked == 0 and not publisher.failed.is_set()


async def test_a_batched_message_fails_at_its_own_deadline_and_a_late_ack_is_ignored() -> None:
    producer = BatchingProducer(hold=True)  # batches taken, never acknowledged
    publisher = make_publisher(producer, delivery_timeout_s=0.2)
    told: list[list] = [[] for _ in range(4)]
    try:
        for i in range(4):
            publisher.publish(Outgoing("shared", b"k", b"%d" % i, [], told[i].append, partition=i % 2))
        assert await publisher.flush(5)  # bounded by the deadline
        assert all(len(t) == 1 and isinstance(t[0], DeliveryTimeout) for t in told), told
        for future in producer.futures:
            future.set_result(None)  # late: already failed, not told twice
        await asyncio.sleep(0)
        assert all(len(t) == 1 for t in told) and publisher._num_unacked == 0
    finally:
        await cancel_lanes(publisher)


async def test_a_partition_with_an_unacknowledged_batch_takes_send_and_never_waits() -> None:
    """aiokafka's `send_batch` waits until the partition's last batch left for the broker: a
    lane must not wait there (every partition behind it would). While partition 0's first batch
    is unacknowledged, its next messages go by `send`; partition 1, with nothing pending, still
    gets a batch; once everything is acknowledged, partition 0 is batched again."""
    producer = BatchingProducer(hold=True)
    publisher = make_publisher(producer, delivery_timeout_s=30)
    told: list[list] = []

    def publish(partition: int) -> None:
        told.append([])
        value = b"%d" % len(told)
        publisher.publish(Outgoing("shared", b"k", value, [], told[-1].append, partition=partition))

    try:
        publish(0)
        publish(0)
        await asyncio.sleep(0.01)
        assert [h[0] for h in producer.handed] == ["batch"]  # both in one batch, held
        publish(0)
        publish(1)
        await asyncio.sleep(0.01)
        assert [(h[0], h[2]) for h in producer.handed[1:]] == [("send", 0), ("batch", 1)]
        for future in producer.futures:
            future.set_result(None)
        await asyncio.sleep(0.01)
        assert not publisher._unacked_by_partition
        publish(0)
        await asyncio.sleep(0.01)
        assert producer.handed[-1][:3] == ("batch", "shared", 0)
        producer.futures[-1].set_result(None)
        assert await publisher.flush(5)
        assert all(t == [None] for t in told) and producer.waited == 0
    finally:
        await cancel_lanes(publisher)
