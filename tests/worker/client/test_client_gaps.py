"""A reply batch that one of the client's fetches did not show still reaches its stream.

The embedded broker can answer a fetch that races a write with a later batch while an earlier
one is still being stored (worker/offset_gaps.py). Here the fault-injecting proxy makes that a
fact between the client and the broker: the client's fetches are held until the (fake) worker
has written every reply, each in a batch of its own, so the next fetch holds them all, and the
proxy drops one of them. The client fetches the gap again: every token message reaches the
stream, in order. Without the refetch the stream showed no token after the gap: the client
waits for the missing `seq`, and the final ended the stream (with the whole text, so only the
streaming was lost).
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition

from tests.worker.client.client_fixtures import (  # noqa: F401 (the *_fixture names are fixtures)
    final_of,
    serve_fixture,
    tokens_of,
    topics_fixture,
)
from tests.worker.kafka_helpers import wait_for
from tests.worker.kafka_proxy import FETCH, KafkaProxy
from worker.client import ClientOptions, MiniInferClient
from worker.topic_reader import TopicReader

TEXTS = ["The ", "quick ", "brown ", "fox"]


@pytest.mark.kafka
@pytest.mark.timeout(60)
@pytest.mark.parametrize("hidden", [1, 0], ids=["second batch", "first batch"])
async def test_a_reply_batch_hidden_from_a_fetch_still_reaches_the_stream(
    broker, topics, serve, hidden
) -> None:
    await serve(lambda r: [*tokens_of(r, "w:0", TEXTS), final_of(r, "w:0", 4, "".join(TEXTS))])
    options = ClientOptions(**topics, private_reply_topic=True)  # read from its start
    async with (
        KafkaProxy(broker.bootstrap_servers) as proxy,
        MiniInferClient(proxy.bootstrap_servers, options) as client,
    ):
        written: list[int] = []  # the replies' offsets, read past the proxy
        reader = TopicReader(
            broker.bootstrap_servers, lambda r: written.append(r.offset),
            partitions=[TopicPartition(client.reply_topic, 0)],
        )  # fmt: skip
        released = asyncio.Event()
        proxy.hold(FETCH, released)
        proxy.hide_batch(client.reply_topic, hidden)
        async with reader:
            deltas = []

            async def read_stream() -> None:
                async for delta in client.stream("Hi", timeout_s=30):
                    deltas.append(delta)

            streaming = asyncio.create_task(read_stream())
            await wait_for(lambda: len(written) == len(TEXTS) + 1, 30, "every reply written")
            released.set()  # the client's next fetch holds every reply batch
            await asyncio.wait_for(streaming, 30)
        assert proxy.num_hidden_batches == 1  # the fault happened
        assert [d.text for d in deltas if d.final is None] == TEXTS
        assert deltas[-1].final is not None and deltas[-1].final.text == "".join(TEXTS)
        assert client._router.gaps.num_refetches == 1
