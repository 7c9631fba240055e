"""Replies no one can forge (contract v1.2): the SDK sends a random nonce with every request,
the worker echoes it in every reply, and the SDK drops a reply of that request without it.

Guards against a producer that names another client's reply topic and request id making the
worker (or itself) publish a final of its choosing into that client's stream: before the nonce,
the SDK took the first final of any attempt.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import JSON, encode
from schemas.codec import InvalidRequestError, Limits, decode_request
from schemas.messages import FinalReply, Request, Timing, TokenReply, Usage
from tests.worker.client.client_fixtures import (  # noqa: F401 (the *_fixture names are fixtures)
    final_of,
    serve_fixture,
    tokens_of,
    topics_fixture,
)
from worker.client import ClientOptions, MiniInferClient
from worker.client.router import ReplyRouter
from worker.service.reply_stream import ReplyStream
from worker.service.routing import Rejected, RoutingPolicy, route

NONCES = st.none() | st.text(min_size=1, max_size=128)


def reply(nonce: str | None) -> TokenReply:
    return TokenReply(id="r1", attempt="w:0", seq=0, text="hi", nonce=nonce)


@given(expected=NONCES, carried=NONCES)
def test_the_router_takes_a_reply_only_with_the_nonce_its_request_sent(expected, carried) -> None:
    async def run() -> None:
        router = ReplyRouter()
        queue = router.register("r1", expected)
        router.route(encode(reply(carried)), None)
        is_taken = expected is None or carried == expected
        assert queue.qsize() == int(is_taken)
        assert router.num_forged == int(not is_taken)

    asyncio.run(run())


def test_every_request_of_the_sdk_carries_its_own_unguessable_nonce() -> None:
    client = MiniInferClient("127.0.0.1:1")
    nonces = {client.build_request("hi").nonce for _ in range(100)}
    assert len(nonces) == 100 and all(len(n) >= 22 for n in nonces)


def test_the_worker_echoes_the_nonce_in_every_reply_and_in_error_finals() -> None:
    stream = ReplyStream("r1", "w:1", 1, True, "secret")
    messages = stream.add("a", [1]) + stream.finish(
        "stop", Usage(prompt_tokens=1, completion_tokens=1), Timing(queued_ms=0, total_ms=1)
    )
    assert [m.nonce for m in messages] == ["secret", "secret"]
    # A request invalid beyond its routing fields is answered with an error final: echoed too.
    bad = {"id": "r2", "reply_to": "mini-infer.replies.x", "prompt": "hi", "max_tokens": -1}
    with pytest.raises(InvalidRequestError) as raised:
        decode_request(json.dumps({**bad, "nonce": "secret"}).encode(), JSON)
    assert raised.value.nonce == "secret"
    policy = RoutingPolicy(
        limits=Limits(),
        reply_topic_prefix="mini-infer.replies.",
        served_models=frozenset({"m"}),
    )
    request = Request(id="r3", reply_to="mini-infer.replies.x", prompt="hi", model="other")
    decision = route(encode(request.model_copy(update={"nonce": "secret"})), None, policy)
    assert isinstance(decision, Rejected) and decision.nonce == "secret"


@pytest.fixture
async def client(broker, topics):
    async with MiniInferClient(broker.bootstrap_servers, ClientOptions(**topics)) as running:
        yield running


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_a_forged_final_is_dropped_and_the_real_one_taken(client, serve) -> None:
    """A forger's final for the same id and reply topic, without the nonce, lands first."""

    def script(request: Request) -> list[TokenReply | FinalReply]:
        forged = final_of(request, "forger:1", 0, "forged", nonce=None)
        return [forged, *tokens_of(request, "w:1", ["real"]), final_of(request, "w:1", 1, "real")]

    await serve(script)
    result = await client.generate("hi")
    assert result.text == "real"
    assert client._router.num_forged == 1
