"""The shared reply topic (contract v1.2): clients create no topics by default, each reads only
its own replies on a shared partition, and a per-client topic is opt-in and deleted on close."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from hypothesis import given
from hypothesis import strategies as st

from schemas import InvalidRequestError, Request, UndecodableError, decode_request
from schemas.contract import (
    DEFAULT_SHARED_REPLY_TOPIC,
    MAX_REPLY_PARTITION,
    NUM_SHARED_REPLY_TOPIC_PARTITIONS,
    DeadLetterReason,
)
from tests.worker.client.client_fixtures import (  # noqa: F401 (the *_fixture names are fixtures)
    final_of,
    serve_fixture,
    topics_fixture,
)
from worker.client import ClientError, ClientOptions, MiniInferClient
from worker.client.client import partition_of

NUM_CLIENTS_IN_A_ROW = 1_000
ASK_EVERY = 100  # every 100th client also sends one request, answered by the fake worker


async def list_topics(bootstrap_servers: str) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


def echo(request: Request):
    return [final_of(request, "w:0", 0, f"echo {request.prompt}")]


def test_the_partition_is_a_stable_spread_of_the_instance_id() -> None:
    picks = [partition_of(f"{i:032x}", 16) for i in range(1_000)]
    assert picks == [partition_of(f"{i:032x}", 16) for i in range(1_000)]
    assert set(picks) == set(range(16))  # every partition used: no hot spot by construction


@given(st.integers(min_value=0, max_value=MAX_REPLY_PARTITION))
def test_a_valid_reply_partition_rides_along_even_on_an_invalid_request(partition: int) -> None:
    """Guards against the error final of an invalid request going where its client does not
    read: the routing fields (id, reply_to, reply_partition) survive the rest being bad."""
    bad = {"id": "r", "reply_to": DEFAULT_SHARED_REPLY_TOPIC, "reply_partition": partition}
    with pytest.raises(InvalidRequestError) as caught:
        decode_request(msgpack.packb(bad))  # neither prompt nor messages
    assert caught.value.reply_partition == partition
    good = decode_request(msgpack.packb({**bad, "prompt": "hi"}))
    assert good.reply_partition == partition


@given(
    st.one_of(
        st.integers(min_value=-(2**63), max_value=-1),
        st.integers(min_value=MAX_REPLY_PARTITION + 1, max_value=2**64 - 1),
        st.text(),
        st.floats(),
        st.booleans(),
        st.lists(st.integers(min_value=0, max_value=9), max_size=2),
    )
)
def test_a_bad_reply_partition_names_nobody_and_is_dead_lettered(value) -> None:
    """No reply can reach a client through a partition that cannot exist: dead letter."""
    request = {"id": "r", "reply_to": DEFAULT_SHARED_REPLY_TOPIC, "prompt": "hi"}
    with pytest.raises(UndecodableError) as caught:
        decode_request(msgpack.packb({**request, "reply_partition": value}))
    assert caught.value.reason == DeadLetterReason.BAD_REPLY_TO


@pytest.mark.kafka
@pytest.mark.timeout(240)
async def test_a_thousand_clients_in_a_row_create_no_topics(broker, topics, serve) -> None:
    """Guards against every SDK client creating (and leaving) a reply topic of its own: a
    thousand open and close, one in a hundred asks a question, and the broker's topics are
    exactly what they were."""
    await serve(echo)
    before = await list_topics(broker.bootstrap_servers)
    assert DEFAULT_SHARED_REPLY_TOPIC in before
    partitions = set()
    for i in range(NUM_CLIENTS_IN_A_ROW):
        async with MiniInferClient(broker.bootstrap_servers, ClientOptions(**topics)) as client:
            partitions.add(client.reply_partition)
            if i % ASK_EVERY == 0:
                result = await client.generate(f"p{i}", timeout_s=30)
                assert result.text == f"echo p{i}"
    assert await list_topics(broker.bootstrap_servers) == before
    assert partitions == set(range(NUM_SHARED_REPLY_TOPIC_PARTITIONS))


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_two_clients_on_one_partition_each_get_only_their_own_replies(
    broker, topics, serve
) -> None:
    """Guards against a client taking another's reply off a shared partition: both read
    partition 3, both send the same prompts at once, and each gets exactly its own finals
    (the other's records are skipped by key, before decoding)."""
    seen = await serve(echo)
    options = ClientOptions(**topics, reply_partition=3)
    async with (
        MiniInferClient(broker.bootstrap_servers, options) as a,
        MiniInferClient(broker.bootstrap_servers, options) as b,
    ):
        results = await asyncio.gather(
            *(
                c.generate(f"{name}{i}", timeout_s=30)
                for i in range(5)
                for c, name in ((a, "a"), (b, "b"))
            )
        )
        assert [r.text for r in results] == [f"echo {n}{i}" for i in range(5) for n in "ab"]
        assert a._router.num_forged == b._router.num_forged == 0
    assert {request.reply_partition for _, request in seen} == {3}
    assert {request.reply_to for _, request in seen} == {DEFAULT_SHARED_REPLY_TOPIC}


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_a_private_reply_topic_is_opt_in_and_deleted_on_close(broker, topics, serve) -> None:
    """Guards against per-client topics outliving their client."""
    await serve(echo)
    options = ClientOptions(**topics, private_reply_topic=True)
    async with MiniInferClient(broker.bootstrap_servers, options) as client:
        assert client.reply_topic != DEFAULT_SHARED_REPLY_TOPIC
        assert client.reply_topic in await list_topics(broker.bootstrap_servers)
        assert (await client.generate("hi", timeout_s=30)).text == "echo hi"
        assert client.build_request("x").reply_partition is None  # old workers need none
    assert client.reply_topic not in await list_topics(broker.bootstrap_servers)


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_a_missing_shared_topic_or_partition_is_a_clear_error_and_not_created(
    broker, topics
) -> None:
    """Guards against a client creating the shared topic (auto-creation by a Metadata request
    included) or reading a partition that does not exist."""
    missing = ClientOptions(**topics, reply_topic="mini-infer.replies.nobody-made-this")
    with pytest.raises(ClientError, match="does not exist"):
        await MiniInferClient(broker.bootstrap_servers, missing).start()
    assert missing.reply_topic not in await list_topics(broker.bootstrap_servers)
    too_far = ClientOptions(**topics, reply_partition=NUM_SHARED_REPLY_TOPIC_PARTITIONS)
    with pytest.raises(ClientError, match="not one of the 16 partitions"):
        await MiniInferClient(broker.bootstrap_servers, too_far).start()
