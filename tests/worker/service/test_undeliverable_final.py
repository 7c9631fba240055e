"""A final that can never be delivered must not hold back its partition: after the retries the
request goes to the DLQ as it came, and the offset is committed past it.

The real worker and broker, with one fault injected: the worker's publisher fails every message
to one reply topic (as a broker refusing that topic would), and delivers everything else.
"""

from __future__ import annotations

import asyncio

import pytest

from schemas.codec import MSGPACK, encode
from schemas.contract import DeadLetterReason
from schemas.headers import ERROR_REASON, SOURCE_OFFSET, get_text_header
from tests.conftest import unique_name
from tests.worker.kafka_helpers import (
    PREFIX,
    create_topic,
    dlq_records,
    fresh_topics,
    make_request,
    serving,
    wait_for_commit,
    worker_settings,
)
from worker.service.worker import Worker

pytestmark = pytest.mark.kafka


def refuse_topic(worker: Worker, topic: str) -> list[str]:
    """Make the worker's publisher fail every message to `topic`; returns what it refused."""
    publish, refused = worker.publisher.publish, []

    def failing_publish(message) -> None:
        if message.topic != topic:
            publish(message)
            return
        refused.append(message.topic)
        if message.on_done is not None:  # failures arrive later, on the loop, like real ones
            asyncio.get_running_loop().call_soon(message.on_done, OSError("topic refused"))

    worker.publisher.publish = failing_publish
    return refused


async def test_an_undeliverable_final_is_dead_lettered_and_its_offset_committed(
    broker, tiny_model_dir
) -> None:
    topic, group_id = fresh_topics()
    await create_topic(broker.bootstrap_servers, topic, 1)
    settings = worker_settings(tiny_model_dir, broker.bootstrap_servers, group_id, topic)
    worker = Worker(settings)
    refused_topic = PREFIX + unique_name("refused")
    async with serving(broker, worker, grace_s=5) as (producer, replies):
        refused = refuse_topic(worker, refused_topic)
        lost = make_request(refused_topic, id="lost", max_tokens=4)
        after = make_request(replies.topic, id="after", max_tokens=4)
        for request in (lost, after):  # one partition: "after" sits behind "lost"
            await producer.send(topic, request)
        assert (await replies.final_of("after")).finish_reason == "length"
        (dead,) = await dlq_records(broker.bootstrap_servers, settings.kafka.dlq_topic, 1)
        committed = await wait_for_commit(
            broker.bootstrap_servers, group_id, topic, 1, lambda c: c[0] == 2
        )
    assert get_text_header(dead.headers, ERROR_REASON) == DeadLetterReason.FINAL_UNDELIVERABLE
    assert (
        dead.value == encode(lost, MSGPACK) and get_text_header(dead.headers, SOURCE_OFFSET) == "0"
    )
    # The first try and every retry of the final (the token messages before it failed too).
    num_final_tries = 1 + settings.publisher.num_final_retries
    assert len(refused) >= num_final_tries
    assert committed[0] == 2  # past both: nothing holds the partition back
    assert worker.tracker.num_unfinished == 0
