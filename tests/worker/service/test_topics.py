"""Reply topics: creation bounded (off, a limit, a rate), transient failures retried, and never
blocking the poll loop or the publisher on one topic."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgpack
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import RequestTimedOutError, TopicAuthorizationFailedError

from schemas.codec import decode_reply
from schemas.contract import DeadLetterReason
from schemas.headers import ERROR_REASON, get_text_header
from tests.conftest import unique_name
from tests.worker.kafka_helpers import (
    PREFIX,
    Producer,
    ReplyReader,
    create_topic,
    dlq_records,
    fresh_topics,
    make_request,
    wait_for_commit,
    worker_settings,
)
from tests.worker.workers import running_worker
from worker.offset_gaps import OffsetGaps, records_of
from worker.service.publisher import Outgoing, Publisher
from worker.service.settings import KafkaSettings, WorkerSettings
from worker.service.topics import TokenBucket, TopicAdmin, TopicCreationRefused


class FakeAdmin:
    """CreateTopics answers from a script: an exception to raise, or success. Metadata knows
    `existing` ({name: num_partitions}) and what was created."""

    def __init__(self, script=(), existing=None) -> None:
        self.script = list(script)
        self.calls: list[str] = []
        self.existing: dict[str, int] = dict(existing or {})
        self.num_metadata_requests = 0

    async def create_topics(self, new_topics):
        self.calls.append(new_topics[0].name)
        if self.script:
            raise self.script.pop(0)
        errors = [(t.name, 36 if t.name in self.existing else 0, "") for t in new_topics]
        self.existing.update({t.name: t.num_partitions for t in new_topics})
        return SimpleNamespace(topic_errors=errors)

    async def _send_request(self, request):  # the Metadata request of worker.topics
        assert request._allow_auto_topic_creation is False  # asking must not create it
        self.num_metadata_requests += 1
        topics = [
            {"topic": n, "error_code": 0 if n in self.existing else 3,
             "partitions": [{}] * self.existing.get(n, 0)}
            for n in request._topics
        ]  # fmt: skip
        return SimpleNamespace(to_object=lambda: {"topics": topics})


def make_admin(script=(), existing=None, **reply_topics) -> tuple[TopicAdmin, FakeAdmin]:
    kafka = KafkaSettings(
        bootstrap_servers="127.0.0.1:1", reply_topics={"retry_backoff_s": 0.001, **reply_topics}
    )
    admin = TopicAdmin("127.0.0.1:1", kafka)
    fake = FakeAdmin(script, existing)
    admin._admin = fake
    return admin, fake


async def test_transient_create_failures_are_retried_and_refusals_are_not() -> None:
    """Guards against one timeout of CreateTopics dead-lettering a request for good, and
    against retrying what the broker means (not authorised) for nothing."""
    admin, fake = make_admin([RequestTimedOutError(), RequestTimedOutError()])
    await admin.ensure_reply_topic("mini-infer.replies.a")
    assert fake.calls == ["mini-infer.replies.a"] * 3 and admin.is_known("mini-infer.replies.a")
    admin, fake = make_admin([TopicAuthorizationFailedError()])
    with pytest.raises(TopicAuthorizationFailedError):
        await admin.ensure_reply_topic("mini-infer.replies.b")
    assert len(fake.calls) == 1


async def test_reply_topic_creation_is_bounded() -> None:
    """Guards against producers creating broker topics without bound: off, a lifetime limit,
    and a rate, each refusing before the broker is asked."""
    admin, fake = make_admin(create=False)
    with pytest.raises(TopicCreationRefused, match="pre-provisioned"):
        await admin.ensure_reply_topic("mini-infer.replies.x")
    admin, fake = make_admin(max_created=2)
    for name in ("a", "b"):
        await admin.ensure_reply_topic(f"mini-infer.replies.{name}")
    await admin.ensure_reply_topic("mini-infer.replies.a")  # known: free
    with pytest.raises(TopicCreationRefused, match="limit of 2"):
        await admin.ensure_reply_topic("mini-infer.replies.c")
    admin, fake = make_admin(max_creation_burst=3, max_creations_per_s=0.001)
    for name in ("a", "b", "c"):
        await admin.ensure_reply_topic(f"mini-infer.replies.{name}")
    with pytest.raises(TopicCreationRefused, match="faster than"):
        await admin.ensure_reply_topic("mini-infer.replies.d")
    assert fake.calls == [f"mini-infer.replies.{n}" for n in "abc"]


async def test_an_existing_reply_topic_costs_no_budget_and_is_never_refused() -> None:
    """Guards against charging the creation budget for topics that exist (created by a client,
    ops or another worker since the last metadata refresh), and against `create=false`
    refusing such a topic."""
    existing = {f"mini-infer.replies.{n}": 1 for n in "abc"}
    admin, fake = make_admin(existing=existing, max_created=1, max_creation_burst=1)
    for name in existing:
        await admin.ensure_reply_topic(name)
    assert fake.calls == [] and all(admin.is_known(n) for n in existing)
    await admin.ensure_reply_topic("mini-infer.replies.new")  # the one creation it may make
    assert fake.calls == ["mini-infer.replies.new"]
    admin, fake = make_admin(existing=existing, create=False)
    await admin.ensure_reply_topic("mini-infer.replies.a")
    with pytest.raises(TopicCreationRefused, match="pre-provisioned"):
        await admin.ensure_reply_topic("mini-infer.replies.missing")
    assert fake.calls == []


async def test_a_reply_partition_must_exist() -> None:
    """Guards against publishing to a partition the topic lacks (aiokafka asserts on it):
    such a request is refused, and a valid one is admitted after one metadata lookup."""
    admin, fake = make_admin(existing={"mini-infer.replies.shared": 4}, create=False)
    await admin.ensure_reply_topic("mini-infer.replies.shared", 3)
    assert admin.is_known("mini-infer.replies.shared", 3)
    assert not admin.is_known("mini-infer.replies.shared", 4)
    with pytest.raises(TopicCreationRefused, match="4 partitions"):
        await admin.ensure_reply_topic("mini-infer.replies.shared", 4)
    assert fake.calls == []


def test_token_bucket_refills_at_its_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(2.0, 2, clock=lambda: now[0])
    assert bucket.take() and bucket.take() and not bucket.take()
    now[0] += 0.5  # one token back
    assert bucket.take() and not bucket.take()


class FakeProducer:
    """Topics in `slow` have no metadata, and sending to them waits for `release`."""

    def __init__(self, slow: set[str]) -> None:
        self.slow = slow
        self.release = asyncio.Event()
        self.sent: list[tuple[str, bytes]] = []
        self.client = SimpleNamespace(
            cluster=SimpleNamespace(partitions_for_topic=lambda t: None if t in self.slow else {0})
        )

    async def send(self, topic, value, key=None, headers=None, partition=None):
        if topic in self.slow:
            await self.release.wait()
        self.sent.append((topic, value))
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def test_one_topic_without_metadata_does_not_hold_up_the_others() -> None:
    """Guards against the single publisher waiting on one missing reply topic (up to
    request_timeout_ms) with every other request's replies queued behind it; and against a
    raising callback killing the publisher task."""
    publisher = Publisher(WorkerSettings(), "127.0.0.1:1")
    producer = FakeProducer(slow={"missing"})
    publisher._producer = producer
    acked: list[bytes] = []

    def on_done(error, value):
        acked.append(value)
        if value == b"f1":
            raise RuntimeError("a buggy callback")

    try:
        for topic, value in [("missing", b"m1"), ("ok", b"f1"), ("missing", b"m2"), ("ok", b"f2")]:
            publisher.publish(
                Outgoing(topic, None, value, [], on_done=lambda e, v=value: on_done(e, v))
            )
        await asyncio.wait_for(_until(lambda: acked == [b"f1", b"f2"]), 5)
        producer.release.set()
        assert await publisher.flush(5)
        assert [v for t, v in producer.sent if t == "missing"] == [b"m1", b"m2"]  # in order
        assert not publisher.failed.is_set()
    finally:
        for task in publisher._lane_tasks:
            task.cancel()


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


@pytest.mark.kafka
async def test_a_slow_reply_topic_does_not_stall_polling_and_a_refused_one_is_dead_lettered(
    broker, tiny_model_dir
) -> None:
    """Guards against topic creation awaited inline in the poll loop (one slow CreateTopics
    held every later request), and checks that a reply topic this worker may not create sends
    the request to the DLQ while its neighbours are answered and committed."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        kafka={"reply_topics": {"max_created": 1}},
    )  # fmt: skip
    slow_topic, refused_topic = PREFIX + unique_name("slow"), PREFIX + unique_name("refused")
    async with (
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
        running_worker(settings) as worker,
    ):
        gate = asyncio.Event()
        create = worker.topics.create

        async def slow_create(topics):
            if slow_topic in topics:
                await gate.wait()
            await create(topics)

        worker.topics.create = slow_create
        slow = make_request(slow_topic, id="slow", max_tokens=3)
        refused = make_request(refused_topic, id="refused", max_tokens=3)
        after = make_request(replies.topic, id="after", max_tokens=3)
        for request in (slow, refused, after):
            await producer.send(topic, request)
        assert (await replies.final_of("after")).finish_reason == "length"
        (dead,) = await dlq_records(broker.bootstrap_servers, settings.kafka.dlq_topic, 1)
        assert get_text_header(dead.headers, ERROR_REASON) == (
            DeadLetterReason.REPLY_TOPIC_UNAVAILABLE
        )
        assert dead.key == b"refused"
        gate.set()  # the slow topic is created now; its request is answered, and committed
        committed = await wait_for_commit(
            broker.bootstrap_servers, group_id, topic, 1, lambda c: c[0] == 3
        )
        assert committed[0] == 3


async def test_a_dead_publisher_loop_is_reported() -> None:
    """Guards against an unsupervised publisher task dying silently, after which every final
    would wait forever: its death is reported (the worker then fails)."""
    publisher = Publisher(WorkerSettings(), "127.0.0.1:1")
    publisher._producer = SimpleNamespace()  # no `send`: the lane task raises, a bug
    publisher.publish(Outgoing("t", None, b"v", []))
    await asyncio.wait_for(publisher.failed.wait(), 5)


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_the_worker_creates_the_shared_reply_topic_and_answers_on_the_named_partition(
    broker, tiny_model_dir
) -> None:
    """Guards against replies (an error final included) landing where the client does not read
    on a shared reply topic (contract v1.2), against a partition the topic lacks reaching the
    producer (aiokafka asserts), and against `create=false` refusing a topic that exists."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    shared = PREFIX + unique_name("shared")
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        kafka={"shared_reply_topic": shared, "num_shared_reply_partitions": 4,
               "reply_topics": {"create": False}},
    )  # fmt: skip
    async with running_worker(settings):
        async with Producer(broker.bootstrap_servers) as producer:
            await producer.send(topic, make_request(shared, id="good", reply_partition=2))
            invalid = {"id": "invalid", "reply_to": shared, "reply_partition": 2, "max_tokens": 0}
            await producer.send_raw(topic, msgpack.packb(invalid), b"invalid")
            await producer.send(topic, make_request(shared, id="nowhere", reply_partition=4))
        (dead,) = await dlq_records(broker.bootstrap_servers, settings.kafka.dlq_topic, 1)
        assert dead.key == b"nowhere"
        assert get_text_header(dead.headers, ERROR_REASON) == (
            DeadLetterReason.REPLY_TOPIC_UNAVAILABLE
        )
        records = await read_all_partitions(
            broker.bootstrap_servers, shared, 4, {b"good", b"invalid"}
        )
        assert {(r.partition, r.key) for r in records} == {(2, b"good"), (2, b"invalid")}
        await wait_for_commit(broker.bootstrap_servers, group_id, topic, 1, lambda c: c[0] == 3)


async def read_all_partitions(bootstrap_servers, topic, num_partitions, finals_of) -> list:
    """Every record of `topic` until each id of `finals_of` has its final."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers, group_id=None, auto_offset_reset="earliest"
    )
    await consumer.start()
    consumer.assign([TopicPartition(topic, p) for p in range(num_partitions)])
    records, finished = [], set()
    gaps = OffsetGaps(what="replies")
    try:
        while finished != finals_of:
            batches = await asyncio.wait_for(consumer.getmany(timeout_ms=200), 30)
            for record in records_of(consumer, gaps, batches):
                records.append(record)
                if decode_reply(record.value).type == "final":
                    finished.add(record.key)
    finally:
        await asyncio.wait_for(consumer.stop(), 10)
    return records
