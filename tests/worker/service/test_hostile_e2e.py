"""Hostile input against the real worker and broker: a few dozen of the worst kinds of message,
interleaved with valid requests on one partition.

For each hostile message: an error (or expired) final on its reply topic, or a dead letter. The
worker stays up, the valid neighbours are answered, the committed offset passes every message,
the engine ends with every KV block free, and no topic outside the reply prefix is created or
written.
"""

from __future__ import annotations

import json
import time

import msgpack
import pytest
from aiokafka.admin import AIOKafkaAdminClient

from schemas.codec import JSON, MSGPACK
from schemas.contract import request_topics
from schemas.headers import request_headers
from tests.conftest import unique_name
from tests.worker.kafka_helpers import (
    PREFIX,
    SMALL_ENGINE,
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

pytestmark = pytest.mark.kafka

MAX_MESSAGE_BYTES = 64 << 10


def hostile_messages(reply_to: str, outside: str) -> list[tuple[str, bytes | None, str, str]]:
    """(kind, value, content type, expected: "final" | "dlq")."""

    def js(**fields) -> bytes:
        return json.dumps({"reply_to": reply_to, "prompt": "hi", **fields}).encode()

    def mp(**fields) -> bytes:
        return msgpack.packb({"reply_to": reply_to, "prompt": "hi", **fields})

    past_ms = int(time.time() * 1000) - 60_000
    return [
        ("garbage", b"\xc1\xff\x00garbage", MSGPACK, "dlq"),
        ("no value", None, MSGPACK, "dlq"),
        ("a list", b"[1, 2, 3]", JSON, "dlq"),
        ("a number", msgpack.packb(7), MSGPACK, "dlq"),
        ("no id", js(), JSON, "dlq"),
        ("id not a string", js(id=12), JSON, "dlq"),
        ("reply_to outside the prefix", js(id="h-out", reply_to=outside), JSON, "dlq"),
        ("reply_to an internal topic", js(id="h-int", reply_to="__consumer_offsets"), JSON, "dlq"),
        ("reply_to with a slash", js(id="h-slash", reply_to=PREFIX + "a/b"), JSON, "dlq"),
        ("reply_to '..'", js(id="h-dots", reply_to=".."), JSON, "dlq"),
        ("too large", js(id="h-big", prompt="x" * (MAX_MESSAGE_BYTES + 10)), JSON, "dlq"),
        (
            "deeply nested",
            b'{"id": "h-deep", "a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
            JSON,
            "dlq",
        ),
        ("invalid utf-8", b'{"id": "h-utf", "prompt": "\xff\xfe"}', JSON, "dlq"),
        ("bogus content type", mp(id="h-ct"), "text/x-bogus", "dlq"),
        ("huge deadline", js(id="h-deadline", deadline_ms=int("9" * 300)), JSON, "final"),
        ("NaN temperature", js(id="h-nan", temperature=float("nan")), JSON, "final"),
        ("infinite top_p", js(id="h-inf", top_p=float("inf")), JSON, "final"),
        ("huge top_k", js(id="h-topk", top_k=10**30), JSON, "final"),
        ("negative seed", mp(id="h-seed", seed=-1), MSGPACK, "final"),
        ("seed over 64 bits", js(id="h-seed64", seed=2**64), JSON, "final"),
        ("huge stop token id", js(id="h-stopid", stop_token_ids=[2**40]), JSON, "final"),
        ("max_tokens 0", mp(id="h-max0", max_tokens=0), MSGPACK, "final"),
        ("max_tokens over the limit", mp(id="h-maxbig", max_tokens=2**40), MSGPACK, "final"),
        ("too many stop strings", mp(id="h-stops", stop=["s"] * 100), MSGPACK, "final"),
        ("too long a prompt", mp(id="h-chars", prompt="y" * 40_000), MSGPACK, "final"),
        (
            "prompt and messages",
            mp(id="h-both", messages=[{"role": "user", "content": "x"}]),
            MSGPACK,
            "final",
        ),
        ("empty prompt", mp(id="h-empty", prompt=""), MSGPACK, "final"),
        (
            "role not a string",
            mp(id="h-role", prompt=None, messages=[{"role": 5, "content": "x"}]),
            MSGPACK,
            "final",
        ),
        ("unknown model", mp(id="h-model", model="gpt-9"), MSGPACK, "final"),
        ("past deadline", mp(id="h-past", deadline_ms=past_ms), MSGPACK, "final"),
        ("longer than the context", mp(id="h-ctx", prompt="word " * 3000), MSGPACK, "final"),
        ("schema_version huge", js(id="h-schema", schema_version=10**20), JSON, "final"),
        ("nested junk in stop", js(id="h-junk", stop=[[[[{"a": [1]}]]]]), JSON, "final"),
    ]


async def test_the_worst_kinds_of_input_are_answered_or_parked_and_nothing_is_lost(
    broker, tiny_model_dir
) -> None:
    """Guards against any hostile message stopping the worker or the partition, leaking KV
    blocks, or making the worker write outside the reply prefix."""
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        limits={"max_message_bytes": MAX_MESSAGE_BYTES},
    )  # fmt: skip
    engines = []

    def factory():
        from engine import LLMEngine

        engines.append(LLMEngine(str(tiny_model_dir), **SMALL_ENGINE))
        return engines[-1]

    outside = unique_name("outside")
    topics_before = await list_topics(broker.bootstrap_servers)
    async with (
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as replies,
    ):
        hostile = hostile_messages(replies.topic, outside)
        async with running_worker(settings, factory) as worker:
            neighbours = []
            for n, (_, value, content_type, _) in enumerate(hostile):
                key = f"h{n}".encode()
                await producer.send_raw(topic, value, key, request_headers(content_type))
                if n % 6 == 0:
                    neighbour = make_request(replies.topic, f"neighbour {n}", max_tokens=4)
                    neighbours.append(neighbour)
                    await producer.send(topic, neighbour, urgency="low")
            for request in neighbours:
                assert (await replies.final_of(request.id)).finish_reason == "length"
            for kind, value, _, expected in hostile:
                if expected == "final":
                    request_id = (json.loads(value) if value[:1] == b"{" else
                                  msgpack.unpackb(value))["id"]  # fmt: skip
                    final = await replies.final_of(request_id, timeout_s=30)
                    assert final.finish_reason in ("error", "expired"), kind
            num_dlq = sum(1 for *_, expected in hostile if expected == "dlq")
            dead = await dlq_records(broker.bootstrap_servers, settings.kafka.dlq_topic, num_dlq)
            assert len(dead) == num_dlq
            num_records = len(hostile) + len(neighbours)
            committed = await wait_for_commit(
                broker.bootstrap_servers, group_id, topic, 1, lambda c: c[0] == num_records
            )
            assert committed[0] == num_records
            assert not worker.failed.is_set() and all(not t.done() for t in worker._tasks)
            stats = engines[0].get_stats()  # the engine thread is idle: nothing runs
            assert stats.num_running == stats.num_waiting == 0
            assert stats.num_blocks_free == stats.num_blocks_total
    new_topics = await list_topics(broker.bootstrap_servers) - topics_before
    own = {*request_topics(topic), settings.kafka.control_topic, settings.kafka.dlq_topic}
    assert all(t.startswith(PREFIX) or t in own for t in new_topics), new_topics
    assert outside not in new_topics


async def list_topics(bootstrap_servers: str) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, request_timeout_ms=30_000)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()
