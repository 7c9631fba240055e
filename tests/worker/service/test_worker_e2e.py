"""One real worker (tiny random model) against the embedded broker: round trips, the wire
options, bad input, cancels, deadlines, trace propagation and urgency.

The worker is shared by the module (a group join costs ~5 s); each test uses its own reply
topic and request ids, so tests do not see each other's replies.
"""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine import LLM, SamplingParams
from schemas.codec import MSGPACK, encode
from schemas.headers import ERROR_REASON, SOURCE_OFFSET, get_text_header, request_headers
from schemas.messages import ChatMessage, ErrorCode, FinalReply, Request, TokenReply
from tests.worker.kafka_helpers import (
    Producer,
    ReplyReader,
    create_topic,
    dlq_records,
    fresh_topics,
    make_request,
    slow_engine_factory,
    stream_of,
    wait_for,
    wait_for_commit,
    worker_settings,
)
from tests.worker.workers import running_worker
from worker.client import ClientOptions, MiniInferClient
from worker.service.telemetry import Telemetry

pytestmark = [pytest.mark.kafka, pytest.mark.asyncio(loop_scope="module")]

NUM_PARTITIONS = 2
STEP_S = 0.01
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class Env:
    """The module's worker, its topics, a producer, and replies to a request sent before it ran."""

    def __init__(self, broker, worker, spans, producer, early_reader, early_id) -> None:
        self.bootstrap_servers = broker.bootstrap_servers
        self.worker = worker
        self.settings = worker.settings
        self.topic = worker.settings.kafka.request_topic
        self.spans = spans
        self.producer = producer
        self.early_reader = early_reader
        self.early_id = early_id


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(broker, tiny_model_dir):
    topic, group_id = fresh_topics()
    settings = worker_settings(
        tiny_model_dir, broker.bootstrap_servers, group_id, topic,
        kafka={"num_partitions": NUM_PARTITIONS}, engine={"max_num_seqs": 4}, worker_id="w-e2e",
    )  # fmt: skip
    await create_topic(broker.bootstrap_servers, topic, NUM_PARTITIONS)
    async with (
        Producer(broker.bootstrap_servers) as producer,
        ReplyReader(broker.bootstrap_servers) as early_reader,
    ):
        early = make_request(early_reader.topic, "Produced before any worker ran")
        await producer.send(topic, early)
        spans = InMemorySpanExporter()
        telemetry = Telemetry(settings.observability, "w-e2e", [SimpleSpanProcessor(spans)])
        # A pause per step makes "still running" a fact, not a race: a 1000-token request takes
        # at least 10 s, so a cancel or a 1 s deadline always finds it mid-stream.
        factory = slow_engine_factory(tiny_model_dir, STEP_S)
        async with running_worker(settings, factory, telemetry=telemetry) as worker:
            yield Env(broker, worker, spans, producer, early_reader, early.id)


@pytest_asyncio.fixture(loop_scope="module")
async def replies(env):
    async with ReplyReader(env.bootstrap_servers) as reader:
        yield reader


def check_stream(messages: list[TokenReply | FinalReply]) -> FinalReply:
    """One attempt's messages: seq 0..n contiguous, tokens then one final, texts concatenate."""
    assert [m.seq for m in messages] == list(range(len(messages)))
    *tokens, final = messages
    assert isinstance(final, FinalReply) and all(isinstance(t, TokenReply) for t in tokens)
    assert "".join(t.text for t in tokens) == final.text
    return final


def generate_directly(model_dir, prompts):
    llm = LLM(str(model_dir), kv_cache_memory_bytes=16 << 20)
    return llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))


async def test_request_produced_before_the_worker_started_is_served(env) -> None:
    final = await env.early_reader.final_of(env.early_id)
    assert final.finish_reason == "length" and final.usage.completion_tokens == 12


async def test_round_trip_streams_the_engines_own_greedy_output(
    env, replies, tiny_model_dir
) -> None:
    prompts = ["Hello there", "The quick brown fox", "Kafka streams prompts"]
    requests = [make_request(replies.topic, p, max_tokens=16) for p in prompts]
    for request in requests:
        await env.producer.send(env.topic, request, traceparent=TRACEPARENT)
    for request in requests:
        await replies.final_of(request.id)
    expected = await asyncio.to_thread(generate_directly, tiny_model_dir, prompts)
    for request, want in zip(requests, expected, strict=True):
        (final,) = replies.finals(request.id)
        assert check_stream(stream_of(replies, request.id, final.attempt)) == final
        assert final.text == want.text
        assert [i for t in replies.tokens(request.id) for i in t.token_ids] == want.token_ids
        assert final.finish_reason == want.finish_reason == "length"
        assert final.usage.completion_tokens == 16 and final.usage.prompt_tokens > 0
        assert final.timing.total_ms >= final.timing.ttft_ms >= 0 and final.timing.queued_ms >= 0
        assert final.attempt.startswith("w-e2e:")
        # The producer's trace continues on every reply (same trace id, the worker's span).
        (traceparent,) = replies.traceparents[request.id]
        assert traceparent.split("-")[1] == TRACE_ID
    worker_spans = [
        s
        for s in env.spans.get_finished_spans()
        if s.attributes.get("mini_infer.request_id") in {r.id for r in requests}
    ]
    assert len(worker_spans) == 3 and all(
        format(s.context.trace_id, "032x") == TRACE_ID for s in worker_spans
    )


async def test_stream_false_json_and_chat_messages(env, replies) -> None:
    quiet = make_request(replies.topic, stream=False)
    as_json = make_request(replies.topic, "JSON please")
    chat = Request(
        id="chat-" + quiet.id,
        reply_to=replies.topic,
        messages=[ChatMessage(role="user", content="hi")],
        max_tokens=5,
        temperature=0,
    )
    await env.producer.send(env.topic, quiet)
    await env.producer.send(env.topic, as_json, as_json=True)
    await env.producer.send(env.topic, chat)
    final = await replies.final_of(quiet.id)
    assert replies.messages[quiet.id] == [final] and final.seq == 0 and final.text
    assert (
        check_stream(
            stream_of(replies, as_json.id, (await replies.final_of(as_json.id)).attempt)
        ).usage.completion_tokens
        == 12
    )
    chat_final = await replies.final_of(chat.id)
    assert (
        chat_final.finish_reason in ("stop", "length") and chat_final.usage.prompt_tokens > 5
    )  # template applied


async def test_bad_input_goes_to_dlq_or_error_finals_and_offsets_move_past_it(env, replies) -> None:
    topic, p = env.topic, env.producer
    good_before = make_request(replies.topic, id="good-before")
    good_after = make_request(replies.topic, id="good-after")
    invalid = {"id": "invalid", "reply_to": replies.topic, "prompt": "x", "max_tokens": 0}
    too_long = make_request(replies.topic, "word " * 2000, id="too-long")
    other_model = make_request(replies.topic, id="other-model", model="gpt-17")
    # Everything to partition 0, so the watermark must pass each bad message in turn.
    values = [
        encode(good_before, MSGPACK),
        b"\xc1 not msgpack",
        msgpack.packb({"id": "outside", "reply_to": "mini-infer.requests", "prompt": "x"}),
        msgpack.packb(invalid),
        encode(too_long, MSGPACK),
        encode(other_model, MSGPACK),
        None,  # a tombstone
        encode(good_after, MSGPACK),
    ]
    for value in values:
        await p.send_raw(topic, value, b"k", request_headers(MSGPACK), partition=0)
    for request_id in ("good-before", "good-after"):
        assert (await replies.final_of(request_id)).finish_reason == "length"
    codes = {
        rid: (await replies.final_of(rid)).error.code
        for rid in ("invalid", "too-long", "other-model")
    }
    assert codes == {
        "invalid": ErrorCode.INVALID_REQUEST,
        "too-long": ErrorCode.PROMPT_TOO_LONG,
        "other-model": ErrorCode.MODEL_NOT_SERVED,
    }
    assert all(replies.finals(rid)[0].finish_reason == "error" for rid in codes)
    assert "outside" not in replies.messages
    dead = await dlq_records(env.bootstrap_servers, env.settings.kafka.dlq_topic, 3)
    reasons = sorted(get_text_header(r.headers, ERROR_REASON) for r in dead)
    assert reasons == ["bad_reply_to", "malformed", "malformed"]
    assert b"\xc1 not msgpack" in [r.value for r in dead]  # the original bytes, untouched
    assert all(get_text_header(r.headers, SOURCE_OFFSET) is not None for r in dead)
    last_offset = max(int(get_text_header(r.headers, SOURCE_OFFSET)) for r in dead)
    committed = await wait_for_commit(
        env.bootstrap_servers, env.settings.kafka.group_id, topic, NUM_PARTITIONS,
        lambda c: c[0] is not None and c[0] > last_offset + 1,
    )  # fmt: skip
    assert committed[0] is not None and committed[0] > last_offset + 1  # past good-after too


async def test_cancel_and_deadlines(env, replies) -> None:
    long = dict(max_tokens=1000, ignore_eos=True)  # >= 10 s of steps
    cancelled = make_request(replies.topic, id="to-cancel", **long)
    expired_before = make_request(
        replies.topic, id="expired-before", deadline_ms=int(time.time() * 1000) - 1
    )
    expires_midway = make_request(
        replies.topic, id="expires-midway", deadline_ms=int(time.time() * 1000) + 1000, **long
    )
    options = ClientOptions(request_topic=env.topic, control_topic=env.settings.kafka.control_topic)
    async with MiniInferClient(env.bootstrap_servers, options) as client:
        for request in (cancelled, expired_before, expires_midway):
            await env.producer.send(env.topic, request)
        await replies.wait_until(
            lambda: len(replies.tokens("to-cancel")) >= 3, what="tokens of to-cancel"
        )
        await client.cancel("to-cancel")
        # A cancel that overtakes its request still wins: the worker remembers it.
        await client.cancel("cancel-first")
        await wait_for(
            lambda: env.worker.pipeline.is_cancelled("cancel-first"), 30, "the cancel to arrive"
        )
        await env.producer.send(env.topic, make_request(replies.topic, id="cancel-first"))
        finals = {
            rid: await replies.final_of(rid)
            for rid in ("to-cancel", "expired-before", "expires-midway", "cancel-first")
        }
    assert {rid: f.finish_reason for rid, f in finals.items()} == {
        "to-cancel": "cancelled", "expired-before": "expired", "expires-midway": "expired", "cancel-first": "cancelled",
    }  # fmt: skip
    assert finals["to-cancel"].usage.completion_tokens < 1000
    assert finals["expired-before"].usage.completion_tokens == 0
    for rid in ("to-cancel", "expires-midway"):
        check_stream(stream_of(replies, rid, finals[rid].attempt))


async def test_critical_overtakes_a_backlog_of_low(env, replies) -> None:
    backlog = [
        make_request(replies.topic, f"backlog {i}", id=f"low-{i}", max_tokens=200, ignore_eos=True)
        for i in range(12)
    ]
    for request in backlog:
        await env.producer.send(env.topic, request, urgency="low")
    await replies.wait_until(
        lambda: any(replies.tokens(r.id) for r in backlog), what="the backlog to start"
    )
    critical = make_request(replies.topic, "urgent!", id="critical", max_tokens=4)
    await env.producer.send(env.topic, critical, urgency="critical")
    await replies.wait_until(
        lambda: replies.tokens("critical"), what="the critical request's first token"
    )
    num_low_done = sum(1 for r in backlog if replies.finals(r.id))
    assert num_low_done < len(backlog) // 2, (
        f"{num_low_done} of {len(backlog)} low requests finished first"
    )
    for request in backlog:  # all answered eventually
        assert (await replies.final_of(request.id)).finish_reason == "length"


async def test_logprobs_ride_on_token_replies(env, replies) -> None:
    """Contract v1.1: a request asking for `logprobs` gets one entry per streamed token, with the
    k most likely alternatives. Guards against the worker dropping them between engine and wire."""
    request = make_request(replies.topic, id="with-logprobs", max_tokens=6, logprobs=2)
    plain = make_request(replies.topic, id="without-logprobs", max_tokens=3)
    for r in (request, plain):
        await env.producer.send(env.topic, r)
    final = await replies.final_of(request.id)
    tokens = stream_of(replies, request.id, final.attempt)[:-1]
    assert tokens and all(len(t.logprobs) == len(t.token_ids) for t in tokens)
    entries = [e for t in tokens for e in t.logprobs]
    assert [e.token_id for e in entries] == [i for t in tokens for i in t.token_ids]
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    # Greedy: the sampled token is the most likely one.
    assert all(e.top_logprobs[0].token_id == e.token_id for e in entries)
    await replies.final_of(plain.id)
    assert all(t.logprobs is None for t in replies.tokens(plain.id))


async def test_structured_output_through_the_worker(env, replies) -> None:
    """Contract v1.2: `response_format` reaches the engine (a choice the random model would never
    write on its own) and a schema that does not compile is an `invalid_request` final."""
    choice = make_request(
        replies.topic, id="with-choice", max_tokens=8, temperature=0.0,
        response_format={"type": "choice", "choice": ["yes", "no"]},
    )  # fmt: skip
    broken = make_request(
        replies.topic, id="with-bad-schema", max_tokens=8,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    )  # fmt: skip
    for r in (choice, broken):
        await env.producer.send(env.topic, r)
    final = await replies.final_of(choice.id)
    assert final.finish_reason == "stop" and final.text in ("yes", "no")
    refused = await replies.final_of(broken.id)
    assert refused.finish_reason == "error" and refused.error.code == ErrorCode.INVALID_REQUEST
    assert "json_schema" in refused.error.message


async def test_n_choices_through_the_worker_and_the_sdk(env, replies, tiny_model_dir) -> None:
    """Contract v1.2 `n`: each choice streams under its index and the final lists them; they are
    the engine's own n samples (sample i seeded seed + i); a cancel ends every choice."""
    request = make_request(replies.topic, "Kafka streams", id="two-choices", max_tokens=8,
                           temperature=0.8, seed=7, n=2, ignore_eos=True)  # fmt: skip
    long = make_request(replies.topic, id="two-to-cancel", n=2, max_tokens=1000, ignore_eos=True)
    for r in (request, long):
        await env.producer.send(env.topic, r)
    final = await replies.final_of(request.id)
    messages = stream_of(replies, request.id, final.attempt)
    assert [m.seq for m in messages] == list(range(len(messages)))
    llm = await asyncio.to_thread(LLM, str(tiny_model_dir), kv_cache_memory_bytes=16 << 20)
    direct = llm.generate("Kafka streams", SamplingParams(
        max_tokens=8, temperature=0.8, seed=7, n=2, ignore_eos=True))[0]  # fmt: skip
    assert [c.index for c in final.choices] == [0, 1] and final.text == final.choices[0].text
    for choice, want in zip(final.choices, direct.choices, strict=True):
        mine = [m for m in messages[:-1] if m.index == choice.index]
        assert "".join(m.text for m in mine) == choice.text == want.text
        assert [t for m in mine for t in m.token_ids] == want.token_ids
        assert choice.finish_reason == "length" and choice.completion_tokens == 8
    assert final.usage.completion_tokens == 16
    await replies.wait_until(lambda: len(replies.tokens(long.id)) >= 4, what="both streaming")
    options = ClientOptions(request_topic=env.topic, control_topic=env.settings.kafka.control_topic)
    async with MiniInferClient(env.bootstrap_servers, options) as client:
        await client.cancel(long.id)
        cancelled = await replies.final_of(long.id)
        result = await client.generate("Kafka streams", max_tokens=8, temperature=0.8, seed=7,
                                       n=2, ignore_eos=True, stream=True)  # fmt: skip
    assert [c.finish_reason for c in cancelled.choices] == ["cancelled", "cancelled"]
    assert [(c.index, c.text, c.token_ids) for c in result.choices] == [
        (i, want.text, want.token_ids) for i, want in enumerate(direct.choices)
    ]
    assert result.text == direct.choices[0].text and result.token_ids == direct.token_ids
