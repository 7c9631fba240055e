"""Dead letters never wedge a partition: an original that does not fit goes as a bounded stub,
a record aiokafka skipped is tracked and stubbed, and an unwritable DLQ fails the worker loudly
instead of holding the watermark while health says ready.

Unit tests over a fake publisher (exact and fast), then the field reproduction against the real
worker and broker.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import MessageSizeTooLargeError, RecordTooLargeError

from schemas.contract import DeadLetterReason
from schemas.headers import ERROR_REASON, ORIGINAL_BYTES, SOURCE_OFFSET, get_text_header
from tests.worker.kafka_helpers import (
    Producer,
    create_topic,
    dlq_records,
    fresh_topics,
    make_request,
    serving,
    wait_for_commit,
    worker_settings,
)
from tests.worker.service.test_undeliverable_final import refuse_topic
from tests.worker.workers import running_worker
from worker.offset_gaps import OffsetGaps
from worker.service.consumer import RequestConsumer, skipped_record
from worker.service.dead_letters import DeadLetterWriter
from worker.service.offsets import OffsetTracker
from worker.service.worker import Worker

TP = TopicPartition("requests", 0)
MAX_BYTES = 4096


class FakePublisher:
    """Acks every message on the next loop turn, or fails those `refuse` says no to."""

    def __init__(self, refuse=lambda message: False) -> None:
        self.sent: list = []
        self._refuse = refuse

    def publish(self, message) -> None:
        self.sent.append(message)
        error = MessageSizeTooLargeError("too large") if self._refuse(message) else None
        asyncio.get_running_loop().call_soon(message.on_done, error)


def make_writer(publisher, tracker, unwritable: list):
    telemetry = SimpleNamespace(dlq_messages=SimpleNamespace(add=lambda *a: None))
    return DeadLetterWriter(
        publisher, tracker, telemetry, "dlq", 2, MAX_BYTES, on_unwritable=unwritable.append
    )


def record(offset: int, value: bytes | None, headers=()) -> SimpleNamespace:
    return SimpleNamespace(offset=offset, key=b"k", value=value, headers=list(headers))


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_an_original_too_large_for_the_dlq_goes_as_a_bounded_stub() -> None:
    """Guards against a dead letter bigger than the producer's limit failing every try and
    leaving its offset unfinished for the life of the process."""
    tracker, publisher, unwritable = OffsetTracker(), FakePublisher(), []
    tracker.assign([TP])
    epoch = tracker.add(TP, 7)
    huge_header = ("x-big", b"h" * 5000)
    letter = record(7, b"v" * 100_000, [("content-type", b"application/json"), huge_header])
    make_writer(publisher, tracker, unwritable).write(
        TP, letter, DeadLetterReason.TOO_LARGE, "too big", epoch=epoch
    )
    await settle()
    (stub,) = publisher.sent
    assert stub.value == b"" and get_text_header(stub.headers, ORIGINAL_BYTES) == "100000"
    assert get_text_header(stub.headers, ERROR_REASON) == DeadLetterReason.TOO_LARGE
    assert get_text_header(stub.headers, SOURCE_OFFSET) == "7"
    assert get_text_header(stub.headers, "content-type") == "application/json"
    assert get_text_header(stub.headers, "x-big") is None  # headers are bounded too
    assert tracker.to_commit() == {TP: 8} and not unwritable


async def test_a_refused_original_falls_back_to_a_stub() -> None:
    """Guards against a broker that refuses the original (its own size limit) wedging it."""
    tracker, unwritable = OffsetTracker(), []
    publisher = FakePublisher(refuse=lambda m: bool(m.value))
    tracker.assign([TP])
    epoch = tracker.add(TP, 0)
    make_writer(publisher, tracker, unwritable).write(
        TP, record(0, b"garbage"), DeadLetterReason.MALFORMED, "bad", epoch=epoch
    )
    await settle()
    assert [m.value for m in publisher.sent] == [b"garbage"] * 3 + [b""]
    assert tracker.to_commit() == {TP: 1} and not unwritable


async def test_an_unwritable_dlq_is_reported_and_never_committed_over() -> None:
    """Guards against an unwritable DLQ silently pinning the watermark: the offset stays
    unfinished (redelivered later) and the worker is told, so it can fail loudly."""
    tracker, unwritable = OffsetTracker(), []
    publisher = FakePublisher(refuse=lambda m: True)
    tracker.assign([TP])
    epoch = tracker.add(TP, 0)
    make_writer(publisher, tracker, unwritable).write(
        TP, record(0, b"garbage"), DeadLetterReason.MALFORMED, "bad", epoch=epoch
    )
    await settle()
    assert len(publisher.sent) == 6  # 1 + 2 retries of the original, then of the stub
    assert len(unwritable) == 1 and tracker.to_commit() == {TP: 0}  # never past it


async def test_a_record_aiokafka_skipped_is_tracked_and_stubbed() -> None:
    """Guards against the watermark committing silently over a record aiokafka could not return
    (RecordTooLargeError): the offset is held until a stub for it is in the DLQ."""
    tracker, publisher, unwritable = OffsetTracker(), FakePublisher(), []
    tracker.assign([TP])
    tracker.add(TP, 4)
    writer = make_writer(publisher, tracker, unwritable)
    consumer = SimpleNamespace(tracker=tracker)
    consumer._dead_letter = lambda p, r, letter, epoch: writer.write(
        p, r, letter.reason, letter.message, epoch=epoch
    )
    error = RecordTooLargeError("messages at %s=%s larger than %s", TP, 5, 1 << 20)
    assert skipped_record(error) == (TP, 5)
    RequestConsumer.on_record_too_large(consumer, error)
    assert tracker.unfinished(TP) == [4, 5]
    await settle()
    (stub,) = publisher.sent
    assert get_text_header(stub.headers, SOURCE_OFFSET) == "5" and stub.value == b""
    assert tracker.unfinished(TP) == [4]


@pytest.mark.kafka
async def test_a_too_large_request_over_the_producer_limit_does_not_wedge_its_partition(
    broker, tiny_model_dir
) -> None:
    """The field reproduction: a request the broker accepted but bigger than the worker's
    `max_message_bytes` (plus framing) made a dead letter the worker's producer refused every
    try; its offset, and the partition's commits, stood still for the life of the process."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        limits={"max_message_bytes": MAX_BYTES},
    )  # fmt: skip
    worker = Worker(settings)
    async with serving(broker, worker, grace_s=5) as (producer, replies):
        big = make_request(replies.topic, "x" * 200_000, id="big")
        after = make_request(replies.topic, id="after", max_tokens=3)
        await producer.send(topic, big)
        await producer.send(topic, after)
        assert (await replies.final_of("after")).finish_reason == "length"
        (dead,) = await dlq_records(broker.bootstrap_servers, settings.kafka.dlq_topic, 1)
        committed = await wait_for_commit(
            broker.bootstrap_servers, group_id, topic, 1, lambda c: c[0] == 2
        )
    assert get_text_header(dead.headers, ERROR_REASON) == DeadLetterReason.TOO_LARGE
    assert dead.value == b"" and int(get_text_header(dead.headers, ORIGINAL_BYTES)) > 200_000
    assert committed[0] == 2 and not worker.failed.is_set()


@pytest.mark.kafka
async def test_an_unwritable_dlq_fails_the_worker_loudly(broker, tiny_model_dir) -> None:
    """Guards against a worker whose DLQ refuses everything staying 'ready' with its watermark
    pinned: it must stop being ready and fail (serve then exits non-zero), committing nothing
    past the record it could not set aside."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(tiny_model_dir, broker.bootstrap_servers, group_id, topic)
    async with (
        Producer(broker.bootstrap_servers) as producer,
        running_worker(settings) as worker,
    ):
        refuse_topic(worker, settings.kafka.dlq_topic)
        await producer.send_raw(topic, b"\xc1 not a request", b"garbage")
        await asyncio.wait_for(worker.failed.wait(), 30)
        assert not worker.health.is_started
        assert worker.tracker.unfinished(TopicPartition(topic, 0)) == [0]
    committed = await wait_for_commit(
        broker.bootstrap_servers, group_id, topic, 1, lambda c: False, timeout_s=0
    )
    assert committed[0] in (None, 0)


async def test_a_dead_letter_that_cannot_be_encoded_falls_back_to_a_stub_and_never_raises() -> None:
    """Guards against the dead letter written in `_handle`'s except branch raising itself (the
    strict header encoding refuses a lone surrogate in the error message) and killing the
    consumer task, and with it the worker."""
    tracker, publisher, unwritable = OffsetTracker(), FakePublisher(), []
    tracker.assign([TP])
    writer = make_writer(publisher, tracker, unwritable)
    consumer = SimpleNamespace(
        tracker=tracker, _consumer=SimpleNamespace(assignment=lambda: {TP}), _gaps=OffsetGaps()
    )
    consumer._dead_letter = lambda p, r, letter, epoch: writer.write(
        p, r, letter.reason, letter.message, epoch=epoch
    )
    consumer._dead_letter_bug = lambda *args: RequestConsumer._dead_letter_bug(consumer, *args)

    def buggy_route(*args) -> None:
        raise RuntimeError("bad \udcff text")

    consumer._route = buggy_route
    assert RequestConsumer._handle(consumer, TP, record(7, b"payload")) is True
    assert tracker.unfinished(TP) == [7]
    await settle()
    (stub,) = publisher.sent
    assert get_text_header(stub.headers, ERROR_REASON) == DeadLetterReason.INTERNAL
    assert get_text_header(stub.headers, SOURCE_OFFSET) == "7" and stub.value == b""
    assert tracker.unfinished(TP) == []
