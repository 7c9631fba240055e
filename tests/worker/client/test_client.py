"""MiniInferClient against the embedded broker, with a scripted fake worker in place of the real
one (the real worker + client end-to-end tests live with the worker)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import structlog.testing

from schemas import JSON, InvalidRequestError, Request, Urgency, encode
from schemas.codec import MSGPACK
from schemas.contract import DEFAULT_SHARED_REPLY_TOPIC
from schemas.headers import read_content_type, read_traceparent, read_urgency
from schemas.messages import ErrorInfo, FinalReply, TokenLogprob, TokenReply
from tests.worker.client.client_fixtures import (  # noqa: F401 (the *_fixture names are fixtures)
    final_of,
    read_cancel,
    serve_fixture,
    tokens_of,
    topics_fixture,
)
from worker.client import (
    ClientError,
    ClientOptions,
    MiniInferClient,
    RequestFailedError,
    RequestTimeoutError,
    SyncMiniInferClient,
)
from worker.client.router import ReplyRouter

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_build_request_validates_locally() -> None:
    client = MiniInferClient("127.0.0.1:1")
    request = client.build_request("hi", max_tokens=5, stop=("x",), top_k=None)
    assert request.reply_to == client.reply_topic and request.reply_to.startswith(
        "mini-infer.replies."
    )
    assert request.max_tokens == 5 and request.stop == ["x"] and request.top_k == 0
    with pytest.raises(TypeError, match="max_token"):
        client.build_request("hi", max_token=5)
    with pytest.raises(ValueError, match="exactly one"):
        client.build_request()
    with pytest.raises(InvalidRequestError):
        client.build_request("hi", stop=[str(i) for i in range(17)])
    chat = client.build_request(messages=[{"role": "user", "content": "yo"}])
    assert chat.messages[0].content == "yo"


def test_clients_share_the_reply_topic_unless_they_opt_into_their_own() -> None:
    assert MiniInferClient("x:1").reply_topic == DEFAULT_SHARED_REPLY_TOPIC
    private = ClientOptions(private_reply_topic=True)
    assert (
        MiniInferClient("x:1", private).reply_topic != MiniInferClient("x:1", private).reply_topic
    )


async def test_router_routes_by_id_and_survives_garbage() -> None:
    router = ReplyRouter()
    queue = router.register("r1")
    reply = TokenReply(id="r1", attempt="w:0", seq=0, text="hi")
    router.route(b"\xc1 garbage", None)
    router.route(encode(reply.model_copy(update={"id": "someone-else"})), None)
    router.route(encode(reply, JSON), "application/json")
    assert await queue.get() == reply and queue.empty()
    with pytest.raises(ValueError, match="already in flight"):
        router.register("r1")


async def test_router_failure_reaches_waiting_and_later_streams() -> None:
    class BrokenConsumer:
        async def getmany(self, timeout_ms: int):
            raise OSError("connection reset")

    router = ReplyRouter()
    queue = router.register("r1")
    await router.run(BrokenConsumer(), ClientError)
    assert isinstance(await queue.get(), ClientError)
    with pytest.raises(ClientError, match="connection reset"):
        router.register("r2")


def test_reply_prefix_must_make_a_topic_name() -> None:
    with pytest.raises(ValueError, match="reply_prefix"):
        MiniInferClient("x:1", ClientOptions(reply_prefix="bad/prefix."))


@pytest.fixture
async def client(broker, topics):
    async with MiniInferClient(broker.bootstrap_servers, ClientOptions(**topics)) as running:
        yield running


def retry_that_diverges(request: Request) -> list[TokenReply | FinalReply]:
    """Attempt a:0 dies after two messages; attempt b:0 redoes it, diverging at the second."""
    died = tokens_of(request, "a:0", ["The ", "cat"])
    retry = tokens_of(request, "b:0", ["The ", "dog", "!"])
    last = final_of(request, "b:0", 3, "The dog!")
    return [*died, *retry, last, final_of(request, "a:0", 2, "The cat")]


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_stream_follows_the_retry_and_sends_headers(client, serve) -> None:
    seen = await serve(retry_that_diverges)
    text = ""
    deltas = []
    async for delta in client.stream("Hi", urgency="high", traceparent=TRACEPARENT, timeout_s=30):
        deltas.append(delta)
        text = delta.text if delta.is_restart else text + delta.text
    assert text == "The dog!"
    assert any(d.is_restart for d in deltas) and deltas[-1].final.attempt == "b:0"
    record, request = seen[0]
    assert record.key == request.id.encode() and request.prompt == "Hi"
    assert read_urgency(record.headers) is Urgency.HIGH
    assert record.topic == client.topic_for("high") == f"{client.request_topic}.high"  # its lane
    assert read_traceparent(record.headers) == TRACEPARENT
    assert read_content_type(record.headers) == "application/msgpack"


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_concurrent_generates_on_one_client(client, serve) -> None:
    def echo(request: Request):
        return [final_of(request, "w:0", 0, f"echo {request.prompt}")]

    seen = await serve(echo)
    results = await asyncio.gather(*(client.generate(f"p{i}", timeout_s=30) for i in range(8)))
    assert [r.text for r in results] == [f"echo p{i}" for i in range(8)]
    assert all(r.finish_reason == "stop" and r.usage.prompt_tokens == 2 for r in results)
    assert all(request.stream is False for _, request in seen)


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_error_final_raises(client, serve) -> None:
    def refuse(request: Request):
        error = ErrorInfo(code="prompt_too_long", message="the prompt has 9000 tokens")
        return [final_of(request, "w:0", 0, "", finish_reason="error", error=error)]

    await serve(refuse)
    with pytest.raises(RequestFailedError) as info:
        await client.generate("long", timeout_s=30)
    assert info.value.code == "prompt_too_long" and "9000" in info.value.message


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_timeout_raises_and_sends_a_cancel(broker, client, topics) -> None:
    with pytest.raises(RequestTimeoutError):
        await client.generate("nobody answers", request_id="req-timeout", timeout_s=0.5)
    assert await read_cancel(broker, topics) == (b"req-timeout", "req-timeout")


def replying_by_hand(monkeypatch, texts: list[str], with_final: bool) -> tuple:
    """A client never started: its `send` routes `texts` (and a final) to the stream itself, so
    they are queued before the stream's deadline is armed; its cancels are recorded."""
    client, cancelled = MiniInferClient("127.0.0.1:1"), []

    async def send(request: Request, urgency, traceparent) -> None:
        replies = tokens_of(request, "w:0", texts)
        if with_final:
            replies.append(final_of(request, "w:0", len(texts), "".join(texts)))
        for reply in replies:
            client._router.route(encode(reply, MSGPACK), MSGPACK)

    async def cancel(request_id: str) -> None:
        cancelled.append(request_id)

    monkeypatch.setattr(client, "send", send)
    monkeypatch.setattr(client, "_cancel_quietly", cancel)
    return client, cancelled


async def test_a_stream_past_its_deadline_gets_what_came_before_it_then_times_out(
    monkeypatch,
) -> None:
    """One timer per stream: at the deadline the timeout queues behind the replies already
    there, so a slow reader still gets them, then the timeout (and a cancel goes out)."""
    client, cancelled = replying_by_hand(monkeypatch, ["never", " ending"], with_final=False)
    texts = []
    with pytest.raises(RequestTimeoutError):
        async for delta in client.stream("x", request_id="late", timeout_s=0.05):
            texts.append(delta.text)
            await asyncio.sleep(0.1)  # the deadline passes while the reader is busy
    assert texts == ["never", " ending"] and cancelled == ["late"]


async def test_a_finished_stream_leaves_no_deadline_behind(monkeypatch) -> None:
    client, cancelled = replying_by_hand(monkeypatch, ["a", "b"], with_final=True)
    with structlog.testing.capture_logs() as logs:
        deltas = [d async for d in client.stream("x", request_id="done", timeout_s=0.05)]
        await asyncio.sleep(0.1)  # past the deadline: its timer was cancelled with the stream
    assert deltas[-1].final is not None and cancelled == []
    assert not [e for e in logs if e["event"] == "client.request_timeout"]


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_leaving_the_stream_early_cancels(broker, client, topics, serve) -> None:
    await serve(lambda request: tokens_of(request, "w:0", ["never", " ending"]))
    async with contextlib.aclosing(client.stream("x", request_id="req-left", timeout_s=30)) as it:
        async for delta in it:
            assert delta.text == "never"
            break
    assert await read_cancel(broker, topics) == (b"req-left", "req-left")


def with_logprobs(replies: list[TokenReply]) -> list[TokenReply]:
    return [
        r.model_copy(
            update={
                "logprobs": [TokenLogprob(token_id=t, logprob=-0.5 * (t + 1)) for t in r.token_ids]
            }
        )
        for r in replies
    ]


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_generate_returns_the_logprobs_of_the_winning_attempt(client, serve) -> None:
    def diverging_with_logprobs(request: Request):
        died = with_logprobs(tokens_of(request, "a:0", ["The ", "cat"]))
        retry = with_logprobs(tokens_of(request, "b:0", ["The ", "dog", "!"]))
        return [*died, *retry, final_of(request, "b:0", 3, "The dog!")]

    seen = await serve(diverging_with_logprobs)
    result = await client.generate("Hi", logprobs=True, top_logprobs=2, timeout_s=30)
    assert result.text == "The dog!" and result.token_ids == [0, 1, 2]
    assert [e.logprob for e in result.logprobs] == [-0.5, -1.0, -1.5]
    request = seen[0][1]
    assert request.stream is True and request.num_logprobs == 2  # logprobs need token replies
    plain = await client.generate("Hi", timeout_s=30)
    assert plain.logprobs is None


@pytest.mark.kafka
@pytest.mark.timeout(90)
async def test_sync_client_generates_and_streams(broker, topics, serve) -> None:
    await serve(retry_that_diverges)

    def use_it() -> tuple[str, str]:
        with SyncMiniInferClient(broker.bootstrap_servers, ClientOptions(**topics)) as client:
            result = client.generate("Hi", timeout_s=30)
            text = ""
            for delta in client.stream("Hi", timeout_s=30):
                text = delta.text if delta.is_restart else text + delta.text
            with pytest.raises(ValueError, match="max_tokens"):
                client.generate("Hi", max_tokens=0)  # validated in the caller's thread
        with pytest.raises(ClientError, match="closed"):
            client.generate("Hi")  # closed: its loop is gone
        return result.text, text

    assert await asyncio.to_thread(use_it) == ("The dog!", "The dog!")
