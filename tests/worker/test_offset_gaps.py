"""Offset gaps are fetched again before they are believed (worker/offset_gaps.py).

A model partition log with real gaps (offsets that hold no record, as a transaction marker
leaves) and batches a fetch may not see yet (as the embedded broker answers a fetch that races a
write from another connection), read through `records_of` by a fake consumer that moves its
position the way aiokafka does: past the last batch it returned. Then the same through the
fault-injecting proxy and the real broker, with `TopicReader`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from aiokafka import TopicPartition
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.kafka_helpers import create_topic, unique_name
from tests.worker.kafka_proxy import KafkaProxy
from worker.offset_gaps import DEFAULT_MAX_REFETCHES, OffsetGaps, records_of
from worker.topic_reader import TopicReader

TP = TopicPartition("t", 0)


@dataclass
class Record:
    offset: int
    value: int


@dataclass
class Batch:
    records: list[Record]
    hidden_for: int = 0  # fetches that do not see it yet

    @property
    def next_offset(self) -> int:
        return self.records[-1].offset + 1


@dataclass
class FakeConsumer:
    """One partition; `getmany` returns up to `max_batches` batches from the position, leaving
    out those still hidden, and moves the position past the last one it returned."""

    batches: list[Batch]
    max_batches: int
    position: int = 0
    num_fetches: int = 0
    seeks: list[int] = field(default_factory=list)

    def getmany(self) -> dict[TopicPartition, list[Record]]:
        self.num_fetches += 1
        visible = []
        for batch in self.batches:
            if batch.next_offset <= self.position:
                continue
            if batch.hidden_for > 0:
                batch.hidden_for -= 1
                continue
            visible.append(batch)
            if len(visible) == self.max_batches:
                break
        if not visible:
            return {}
        start, self.position = self.position, visible[-1].next_offset
        return {TP: [r for b in visible for r in b.records if r.offset >= start]}

    def seek(self, partition: TopicPartition, offset: int) -> None:
        assert partition == TP
        self.seeks.append(offset)
        self.position = offset


@st.composite
def logs(draw) -> tuple[list[Batch], set[int]]:
    """Batches of 1-4 records, each possibly hidden from up to `DEFAULT_MAX_REFETCHES` fetches,
    some separated by a real gap of 1-3 offsets."""
    batches, real_gaps, offset = [], set(), 0
    for value in range(draw(st.integers(1, 12))):
        if batches and draw(st.booleans()) and draw(st.booleans()):
            gap = draw(st.integers(1, 3))
            real_gaps.update(range(offset, offset + gap))
            offset += gap
        size = draw(st.integers(1, 4))
        records = [Record(offset + i, value * 10 + i) for i in range(size)]
        offset += size
        batches.append(Batch(records, draw(st.integers(0, DEFAULT_MAX_REFETCHES))))
    batches[0].hidden_for = 0  # the first record read is where the reader starts
    return batches, real_gaps


@settings(max_examples=300, deadline=None)
@given(log=logs(), max_batches=st.integers(1, 5))
def test_every_record_is_read_once_in_order_and_real_gaps_are_accepted(log, max_batches):
    batches, real_gaps = log
    consumer = FakeConsumer(batches, max_batches)
    gaps = OffsetGaps()
    read = []
    for _ in range(10_000):
        if consumer.position >= batches[-1].next_offset:
            break
        read.extend(records_of(consumer, gaps, consumer.getmany()))
    assert [r.offset for r in read] == [r.offset for b in batches for r in b.records]
    # Each real gap (a run of missing offsets before a record) is accepted once, after its
    # refetches; hidden batches cost refetches, never records.
    num_real_gaps = sum(1 for o in real_gaps if o - 1 not in real_gaps)
    assert gaps.num_accepted == num_real_gaps
    assert gaps.num_refetches >= num_real_gaps * DEFAULT_MAX_REFETCHES


def test_a_batch_hidden_longer_than_the_refetches_is_accepted_as_a_gap() -> None:
    """The bound: a reader never waits on a gap for good (on Apache Kafka a transaction
    marker is one); the record behind it is then not read."""
    batches = [
        Batch([Record(0, 0)]),
        Batch([Record(1, 1)], hidden_for=DEFAULT_MAX_REFETCHES + 5),
        Batch([Record(2, 2)]),
    ]
    consumer = FakeConsumer(batches, max_batches=3)
    gaps = OffsetGaps()
    read = []
    while consumer.position < 3:
        read.extend(records_of(consumer, gaps, consumer.getmany()))
    assert [r.offset for r in read] == [0, 2]
    assert consumer.seeks == [1] * DEFAULT_MAX_REFETCHES
    assert gaps.num_accepted == 1


def test_a_seek_elsewhere_is_not_a_gap_once_forgotten() -> None:
    gaps = OffsetGaps()
    assert gaps.check(TP, 5) is None
    gaps.forget(TP)
    assert gaps.check(TP, 50) is None and gaps.num_refetches == 0
    assert gaps.check(TP, 52) == 51  # but a gap after it is
    assert gaps.check(TP, 40) is None  # going back (a seek, a reset log) is taken as it comes
    gaps.expect(TP, 100)  # a position known before the first record (an assignment)
    assert gaps.check(TP, 101) == 100 and gaps.expected(TP) == 100


def test_no_refetches_when_turned_off() -> None:
    """`kafka.max_gap_refetches = 0` (a request topic of transactional producers on Kafka):
    every gap is accepted at once."""
    gaps = OffsetGaps(max_refetches=0)
    assert gaps.check(TP, 0) is None
    assert gaps.check(TP, 2) is None
    assert (gaps.num_refetches, gaps.num_accepted) == (0, 1)


def test_the_reply_router_refetches_a_gap_before_routing() -> None:
    """The client's reply reader: a token message hidden from one fetch still reaches its
    stream, in order."""
    from schemas.codec import MSGPACK, encode
    from schemas.headers import CONTENT_TYPE
    from schemas.messages import TokenReply
    from worker.client.router import ReplyRouter

    @dataclass
    class KafkaRecord:
        offset: int
        key: bytes
        value: bytes
        headers: list

    def token(seq: int) -> KafkaRecord:
        reply = TokenReply(id="r1", attempt="w:1", seq=seq, text=f"t{seq}", token_ids=[seq])
        return KafkaRecord(seq, b"r1", encode(reply, MSGPACK), [(CONTENT_TYPE, MSGPACK.encode())])

    batches = [Batch([token(0)]), Batch([token(1), token(2)], hidden_for=1), Batch([token(3)])]
    consumer = FakeConsumer(batches, max_batches=3)
    router = ReplyRouter()
    queue = router.register("r1")

    async def getmany(timeout_ms: int):
        if consumer.position >= 4:
            await asyncio.sleep(3600)
        return consumer.getmany()

    async def read() -> list[int]:
        consumer_api = type("C", (), {"getmany": staticmethod(getmany), "seek": consumer.seek})
        task = asyncio.create_task(router.run(consumer_api, RuntimeError))
        seqs = [(await asyncio.wait_for(queue.get(), 10)).seq for _ in range(4)]
        task.cancel()
        return seqs

    assert asyncio.run(read()) == [0, 1, 2, 3]
    assert router.gaps.num_refetches == 1 and consumer.seeks == [1]


@pytest.mark.kafka
@pytest.mark.parametrize("hidden", [1, 0], ids=["second batch", "first batch"])
async def test_topic_reader_reads_a_batch_a_fetch_did_not_show(broker, hidden) -> None:
    """Through the proxy, on the real broker: one fetch loses a batch in the middle (as the
    embedded broker's fetch does when it races a write); the reader still reads every record."""
    from aiokafka import AIOKafkaProducer

    topic = unique_name("gaps")
    await create_topic(broker.bootstrap_servers, topic, 1)
    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap_servers, acks="all")
    await producer.start()
    try:
        for i in range(5):  # each its own batch
            await producer.send_and_wait(topic, str(i).encode(), partition=0)
    finally:
        await producer.stop()
    read: list[int] = []
    async with KafkaProxy(broker.bootstrap_servers) as proxy:
        proxy.hide_batch(topic, hidden)
        reader = TopicReader(
            proxy.bootstrap_servers, lambda r: read.append(r.offset),
            partitions=[TopicPartition(topic, 0)],
        )  # fmt: skip
        async with reader:
            for _ in range(200):
                if len(read) >= 5:
                    break
                await asyncio.sleep(0.05)
    assert proxy.num_hidden_batches == 1  # the fault happened
    assert read == [0, 1, 2, 3, 4]
    assert reader.gaps.num_refetches == 1
