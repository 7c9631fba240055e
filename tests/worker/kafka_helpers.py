"""Helpers for real-broker worker tests: settings for a tiny-model worker on fresh topics, a raw
request producer, and a reply-topic reader that keeps every message (the SDK would hide the
attempts and duplicates these tests look at)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import defaultdict
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from schemas.codec import JSON, MSGPACK, UndecodableError, decode_reply, encode
from schemas.headers import read_content_type, read_traceparent, request_headers
from schemas.messages import FinalReply, Request, TokenReply
from tests.conftest import unique_name
from worker.offset_gaps import OffsetGaps, records_of
from worker.topic_reader import TopicReader

PREFIX = "mini-infer.replies."
SMALL_ENGINE = {"kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 8}


def worker_settings(
    model_dir: Path, bootstrap_servers: str, group_id: str, request_topic: str, **overrides
):
    """A worker on its own topics and group, with fast test-friendly timings."""
    from worker.service.settings import WorkerSettings

    kafka = {
        "bootstrap_servers": bootstrap_servers,
        "enable_idempotence": False,
        "group_id": group_id,
        "request_topic": request_topic,
        "control_topic": request_topic + ".control",
        "dlq_topic": request_topic + ".dlq",
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 1000,
        **overrides.pop("kafka", {}),
    }
    engine = {**SMALL_ENGINE, **overrides.pop("engine", {})}
    return WorkerSettings(model=str(model_dir), kafka=kafka, engine=engine, **overrides)


def fresh_topics() -> tuple[str, str]:
    """(request topic, group id), never used before in this broker."""
    name = unique_name("req")
    return name, unique_name("group")


async def create_topic(bootstrap_servers: str, name: str, num_partitions: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, request_timeout_ms=30_000)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions, 1)])
    finally:
        await admin.close()


class Producer:
    """Sends requests the way any producer would: raw bytes, key = id, wire headers."""

    def __init__(self, bootstrap_servers: str) -> None:
        self._producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers, acks="all")

    async def __aenter__(self) -> Producer:
        await self._producer.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._producer.stop()

    async def send(
        self,
        topic: str,
        request: Request,
        urgency: str = "normal",
        traceparent: str | None = None,
        as_json: bool = False,
        partition: int | None = None,
    ) -> None:
        content_type = JSON if as_json else MSGPACK
        await self.send_raw(
            topic,
            encode(request, content_type),
            request.id.encode(),
            request_headers(content_type, urgency, traceparent),
            partition=partition,
        )

    async def send_raw(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers=None,
        partition: int | None = None,
    ) -> None:
        await self._producer.send_and_wait(
            topic, value, key=key, headers=headers or [], partition=partition
        )


async def wait_for(predicate, timeout_s: float = 60.0, what: str = "the condition") -> None:
    """Poll `predicate` (every 50 ms) until it holds; TimeoutError naming `what` otherwise."""
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


def make_request(reply_to: str, prompt: str = "Hello there", **fields) -> Request:
    return Request(
        id=fields.pop("id", unique_name("r")),
        reply_to=reply_to,
        prompt=prompt,
        **{"temperature": 0.0, "max_tokens": 12, **fields},
    )


class ReplyReader:
    """Reads one reply topic from the start; keeps every message and its traceparent header."""

    def __init__(self, bootstrap_servers: str, topic: str | None = None) -> None:
        self.topic = topic or unique_name(PREFIX.rstrip(".") + ".t")
        self.bootstrap_servers = bootstrap_servers
        self.messages: dict[str, list[TokenReply | FinalReply]] = defaultdict(list)
        self.traceparents: dict[str, set[str | None]] = defaultdict(set)
        self.raw_ids: set[str | None] = set()  # keys of every record read, replies or not
        self._reader = TopicReader(
            bootstrap_servers, self._on_record, partitions=[TopicPartition(self.topic, 0)]
        )
        self._changed = asyncio.Event()

    async def __aenter__(self) -> ReplyReader:
        await create_topic(self.bootstrap_servers, self.topic, 1)
        await self._reader.__aenter__()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._reader.__aexit__(*exc_info)

    def _on_record(self, record) -> None:
        self.raw_ids.add(record.key.decode() if record.key else None)
        self._changed.set()
        try:
            reply = decode_reply(record.value, read_content_type(record.headers))
        except UndecodableError:  # a marker the test wrote
            return
        self.messages[reply.id].append(reply)
        self.traceparents[reply.id].add(read_traceparent(record.headers))

    def finals(self, request_id: str) -> list[FinalReply]:
        return [m for m in self.messages.get(request_id, ()) if isinstance(m, FinalReply)]

    def tokens(self, request_id: str, attempt: str | None = None) -> list[TokenReply]:
        return [
            m
            for m in self.messages.get(request_id, ())
            if isinstance(m, TokenReply) and attempt in (None, m.attempt)
        ]

    async def wait_until(self, predicate, timeout_s: float = 60.0, what: str = "replies") -> None:
        deadline_s = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline_s:
                summary = {
                    k: [(m.type, m.attempt, m.seq) for m in v][-5:]
                    for k, v in self.messages.items()
                }
                raise TimeoutError(
                    f"timed out waiting for {what}; have {json.dumps(summary)[:2000]}"
                )
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 1.0)

    async def final_of(self, request_id: str, timeout_s: float = 60.0) -> FinalReply:
        await self.wait_until(
            lambda: self.finals(request_id), timeout_s, f"the final of {request_id}"
        )
        return self.finals(request_id)[0]


def stream_of(reader: ReplyReader, request_id: str, attempt: str) -> list[TokenReply | FinalReply]:
    return sorted(
        (m for m in reader.messages[request_id] if m.attempt == attempt), key=lambda m: m.seq
    )


async def committed_offsets(
    bootstrap_servers: str, group_id: str, topic: str, num_partitions: int
) -> dict[int, int | None]:
    """What the group committed, read by a separate consumer of that group (not joining it)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers, group_id=group_id, enable_auto_commit=False
    )
    await consumer.start()
    try:
        return {
            p: await consumer.committed(TopicPartition(topic, p)) for p in range(num_partitions)
        }
    finally:
        await asyncio.wait_for(consumer.stop(), 10)


async def wait_for_commit(
    bootstrap_servers: str,
    group_id: str,
    topic: str,
    num_partitions: int,
    is_done,
    timeout_s: float = 20.0,
) -> dict[int, int | None]:
    """Poll the group's committed offsets until `is_done(committed)` or the timeout (the commit
    follows the acks within a poll interval or so); returns the last offsets read."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        committed = await committed_offsets(bootstrap_servers, group_id, topic, num_partitions)
        if is_done(committed) or time.monotonic() > deadline_s:
            return committed
        await asyncio.sleep(0.2)


async def dlq_records(
    bootstrap_servers: str, topic: str, num_expected: int, timeout_s: float = 30.0
) -> list:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap_servers, group_id=None, auto_offset_reset="earliest"
    )
    await consumer.start()
    records: list = []
    gaps = OffsetGaps(what="dead letters")  # written live by several workers' producers
    try:
        deadline_s = time.monotonic() + timeout_s
        while len(records) < num_expected and time.monotonic() < deadline_s:
            batches = await consumer.getmany(timeout_ms=500)
            records.extend(records_of(consumer, gaps, batches))
        return records
    finally:
        await asyncio.wait_for(consumer.stop(), 10)


class SlowEngine:
    """The real engine, with a pause per step: slow enough to be caught mid-stream. With
    `gate`, each step first waits for it to be set (at most 60 s): held until the test says."""

    def __init__(self, engine, step_s: float, gate: threading.Event | None = None) -> None:
        self._engine = engine
        self._step_s = step_s
        self._gate = gate

    def step(self):
        if self._gate is not None:
            self._gate.wait(timeout=60)
        time.sleep(self._step_s)
        return self._engine.step()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


class HeldEngine:
    """The real engine, held in two places so that "still running" is a fact: it takes no step
    until `num_requests` requests were added (they all start together), steps until each of
    them has had text (a token message closes only once it holds some: reply_stream.py), then
    takes empty steps (it still reads its inbox: aborts are served) until `release` is set, and
    runs freely after that."""

    IDLE_STEP_S = 0.005

    def __init__(self, engine, num_requests: int, release: threading.Event) -> None:
        self._engine = engine
        self._num_requests = num_requests
        self.release = release
        self._added: set[str] = set()
        self._streaming: set[str] = set()
        self.held = threading.Event()  # set once every request has had text
        self.num_finished_before_release = 0  # none, unless a request outran the hold

    def add_request(self, request_id, *args, **kwargs) -> None:
        self._engine.add_request(request_id, *args, **kwargs)
        self._added.add(request_id)

    def step(self):
        if not self.release.is_set() and (
            len(self._added) < self._num_requests or self._added <= self._streaming
        ):
            if self._added and self._added <= self._streaming:
                self.held.set()
            time.sleep(self.IDLE_STEP_S)
            return []
        deltas = self._engine.step()
        self._streaming.update(d.request_id for d in deltas if d.text)
        if not self.release.is_set():
            self.num_finished_before_release += sum(1 for d in deltas if d.finished)
        return deltas

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def slow_engine_factory(model_dir, step_s: float = 0.03):
    def build():
        from engine import LLMEngine

        return SlowEngine(LLMEngine(str(model_dir), **SMALL_ENGINE), step_s)

    return build


@contextlib.asynccontextmanager
async def serving(broker, worker, grace_s: float | None = None):
    """`worker` started and holding its partitions, with a producer and a reply reader; on exit
    the worker stops (draining for `grace_s`), then both clients close."""
    async with (
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
    ):
        await worker.start()
        try:
            await worker.wait_assigned()
            yield producer, replies
        finally:
            await worker.stop(grace_s=grace_s)
