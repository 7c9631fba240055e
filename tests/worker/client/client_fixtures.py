"""Kafka fixtures for client tests (on the session broker of tests/conftest.py): fresh topics, and a scripted fake
worker that answers requests in place of the real one."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from schemas import Request, decode_cancel, decode_request, encode
from schemas.contract import request_topics
from schemas.headers import read_content_type
from schemas.messages import FinalReply, Timing, TokenReply, Usage

# The embedded broker answers a fetch only after fetch_max_wait_ms even when data is waiting,
# so the fake worker polls briskly, as the real one does.
FETCH_MAX_WAIT_MS = 20

# A script maps a request to what the fake worker writes back, in order.
Script = Callable[[Request], list[TokenReply | FinalReply]]


def final_of(request: Request, attempt: str, seq: int, text: str, **fields) -> FinalReply:
    return FinalReply(
        id=request.id,
        attempt=attempt,
        seq=seq,
        nonce=fields.pop("nonce", request.nonce),  # echoed, as a worker does (contract v1.2)
        finish_reason=fields.pop("finish_reason", "stop"),
        text=text,
        usage=Usage(prompt_tokens=2, completion_tokens=seq),
        timing=Timing(queued_ms=0.5, ttft_ms=1.0, total_ms=2.0),
        **fields,
    )


def tokens_of(request: Request, attempt: str, texts: list[str]) -> list[TokenReply]:
    return [
        TokenReply(
            id=request.id, attempt=attempt, seq=i, text=t, token_ids=[i], nonce=request.nonce
        )
        for i, t in enumerate(texts)
    ]


@pytest.fixture(name="topics")
async def topics_fixture(broker):
    """Fresh single-partition request and control topics per test (never delete live topics)."""
    suffix = uuid.uuid4().hex[:8]
    names = {"request_topic": f"test.requests.{suffix}", "control_topic": f"test.control.{suffix}"}
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap_servers)
    await admin.start()
    try:
        lanes = request_topics(names["request_topic"])  # the urgency lanes and the base topic
        await admin.create_topics([NewTopic(n, 1, 1) for n in {*lanes, *names.values()}])
    finally:
        await admin.close()
    return names


async def fake_worker(broker, topics, script: Script, seen: list) -> None:
    """Answer every request on the request topic (and its urgency lanes) with `script(request)`."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=broker.bootstrap_servers,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
    )
    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap_servers)
    await consumer.start()
    await producer.start()
    consumer.assign([TopicPartition(t, 0) for t in request_topics(topics["request_topic"])])
    try:
        async for record in consumer:
            request = decode_request(record.value, read_content_type(record.headers))
            seen.append((record, request))
            for reply in script(request):
                await producer.send_and_wait(
                    request.reply_to, encode(reply), key=record.key,
                    partition=request.reply_partition,  # v1.2: where the client reads
                )  # fmt: skip
    finally:
        await asyncio.wait_for(consumer.stop(), 5)
        await producer.stop()


@pytest.fixture(name="serve")
async def serve_fixture(broker, topics):
    """`await serve(script)` starts a fake worker; returns the list of (record, request) seen."""
    tasks = []

    async def start(script: Script) -> list:
        seen: list = []
        tasks.append(asyncio.create_task(fake_worker(broker, topics, script, seen)))
        return seen

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def read_cancel(broker, topics) -> tuple[bytes, str]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=broker.bootstrap_servers, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topics["control_topic"], 0)])
        record = await asyncio.wait_for(consumer.getone(), 20)
    finally:
        await asyncio.wait_for(consumer.stop(), 5)
    return record.key, decode_cancel(record.value, read_content_type(record.headers)).id
