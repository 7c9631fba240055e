"""Hostile input at scale, in-process: thousands of generated requests over the whole contract
(wrong types in every field, integers beyond 64 bits, NaN and infinities, nested containers,
unicode edge cases, oversized strings, bad `reply_to`s) through decoding, routing and admission.

Each must end as a dead letter, an error final, or a queued job with its prompt tokenized; none
may raise, reach the `internal` error path (a bug), or name a reply topic outside the prefix.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from types import SimpleNamespace

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.codec import JSON, MSGPACK, Limits
from schemas.contract import MAX_DEADLINE_MS, MAX_SEED, MAX_TEMPERATURE, MAX_TOKEN_ID
from schemas.headers import request_headers
from schemas.messages import ErrorCode
from worker.service.batcher import Batcher
from worker.service.job import JobState
from worker.service.offsets import OffsetTracker
from worker.service.pipeline import Pipeline
from worker.service.prompts import PromptRenderer
from worker.service.routing import Accepted, DeadLetter, Rejected, RoutingPolicy, route
from worker.service.settings import WorkerSettings
from worker.service.telemetry import Telemetry

PREFIX = "mini-infer.replies."
POLICY = RoutingPolicy(Limits(max_prompt_chars=2000), PREFIX, frozenset({"tiny"}))
FIELDS = [
    "id", "reply_to", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "stop_token_ids", "ignore_eos", "stream", "deadline_ms", "model", "schema_version",
]  # fmt: skip

nasty_ints = st.sampled_from(
    [
        2**31,
        2**63 - 1,
        2**63,
        2**64,
        -(2**63) - 1,
        10**300,
        -(10**300),
        MAX_DEADLINE_MS + 1,
        10**400,
        -(10**400),
    ]  # beyond a float: int / 1000 raises OverflowError
)
nasty_texts = st.sampled_from(
    ["", "\x00", "\u202e\u0041", "\x1b[31mred\n", "\ud7ff", "\U0010ffff", "\ufeff", "é" * 3000,
     "a" * 70_000, ".", "..", PREFIX, PREFIX + "x" * 300, PREFIX + "a/b", "__consumer_offsets"]
)  # fmt: skip
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), nasty_ints,
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30), nasty_texts,
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=6)
    ),
    max_leaves=30,
)
reply_tos = st.sampled_from(
    [PREFIX + "ok", "elsewhere", "__consumer_offsets", PREFIX + "../x", PREFIX, "mini-infer.dlq"]
)


@st.composite
def hostile_requests(draw) -> dict:
    """A valid request with one to four fields replaced by hostile values (or removed)."""
    obj = {"id": draw(st.text(min_size=1, max_size=20)), "reply_to": draw(reply_tos),
           "prompt": draw(st.text(min_size=1, max_size=100))}  # fmt: skip
    if draw(st.booleans()):
        obj.pop("prompt")
        obj["messages"] = [{"role": "user", "content": draw(st.text(max_size=50))}]
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4, unique=True)):
        if draw(st.integers(0, 9)) == 0:
            obj.pop(field, None)
        else:
            obj[field] = draw(values)
    return obj


def encode_any(obj: dict, as_json: bool) -> tuple[bytes, str]:
    """msgpack where it can carry the values (not ints beyond 64 bits), else JSON (with NaN)."""
    if not as_json:
        try:
            return msgpack.packb(obj, use_bin_type=True), MSGPACK
        except (OverflowError, TypeError, ValueError):
            pass
    return json.dumps(obj, default=repr).encode("utf-8", errors="surrogatepass"), JSON


class FakeBridge:
    def __init__(self) -> None:
        self.events: asyncio.Queue = asyncio.Queue()

    def queued_tokens_at_least_as_urgent_as(self, priority: int) -> int:
        return 0

    def submit(self, requests) -> None:
        pass

    def abort(self, request_id: str) -> None:
        pass


class FakeReplies:
    def __init__(self) -> None:
        self.finals: list = []

    def send(self, job, message):
        if message.type == "final":
            self.finals.append(message)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


@pytest.fixture(scope="module")
def admission(tiny_model_dir):
    from engine.loader import load_tokenizer

    loop = asyncio.new_event_loop()
    settings_ = WorkerSettings()
    replies, dead = FakeReplies(), []
    tracker = OffsetTracker()
    tracker.assign(["p"])

    async def build() -> Pipeline:
        return Pipeline(
            settings_, "w", FakeBridge(), replies,
            SimpleNamespace(write=lambda *a, **k: dead.append(a)), tracker,
            Telemetry(settings_.observability, "w"),
            PromptRenderer(load_tokenizer(str(tiny_model_dir))), Batcher(settings_.batcher),
        )  # fmt: skip

    pipeline = loop.run_until_complete(build())
    yield SimpleNamespace(loop=loop, pipeline=pipeline, replies=replies, tracker=tracker)
    loop.close()


NUM_OFFSETS = iter(range(10**9))


@given(hostile_requests(), st.booleans(), st.sampled_from(["critical", "low", "bogus", ""]))
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_hostile_requests_are_dead_lettered_answered_or_queued(
    admission, obj, as_json, urgency
) -> None:
    value, content_type = encode_any(obj, as_json)
    headers = request_headers(content_type) + [("urgency", urgency.encode())]
    decision = route(value, headers, POLICY)
    assert isinstance(decision, DeadLetter | Rejected | Accepted)
    if isinstance(decision, DeadLetter):
        return
    assert decision.reply_to.startswith(PREFIX)  # nothing is ever written outside the prefix
    if isinstance(decision, Accepted):
        check_bounded(decision)
    offset = next(NUM_OFFSETS)
    epoch = admission.tracker.add("p", offset)
    record = SimpleNamespace(offset=offset, key=None, value=value, headers=headers)
    partition = SimpleNamespace(topic="requests", partition=0)

    async def admit():
        num_finals = len(admission.replies.finals)
        if isinstance(decision, Accepted):
            job = admission.pipeline.accept(decision, partition, record, time.monotonic(), epoch)
            if job.rendering is not None:  # tokenized off the loop; admission goes on after
                await asyncio.wait([job.rendering])
        else:
            job = admission.pipeline.reject(decision, partition, record, time.monotonic(), epoch)
        if job.state is JobState.PENDING:
            assert job.prompt_token_ids and all(isinstance(t, int) for t in job.prompt_token_ids)
        else:
            (final,) = admission.replies.finals[num_finals:]
            assert final.finish_reason in ("error", "expired", "cancelled")
            assert final.error is None or final.error.code != ErrorCode.INTERNAL, final.error
        admission.pipeline.drop(admission.pipeline.active_jobs(), "test")

    admission.loop.run_until_complete(admit())


def check_bounded(accepted: Accepted) -> None:
    """What an accepted request carries fits every consumer (floats, int64, the engine)."""
    r = accepted.request
    assert math.isfinite(r.temperature) and 0 <= r.temperature <= MAX_TEMPERATURE
    assert math.isfinite(r.top_p) and 0 < r.top_p <= 1
    assert -1 <= r.top_k <= MAX_TOKEN_ID and r.max_tokens >= 1
    assert r.seed is None or 0 <= r.seed <= MAX_SEED
    assert r.deadline_ms is None or math.isfinite(float(r.deadline_ms) / 1000)
    assert all(0 <= t <= MAX_TOKEN_ID for t in r.stop_token_ids)
    assert 0 <= accepted.params.seed <= MAX_SEED


def test_deeply_nested_json_is_a_dead_letter() -> None:
    """Guards against recursion-limit errors from a deeply nested document escaping decoding."""
    value = b'{"id": "x", "reply_to": "mini-infer.replies.a", "prompt": ' + b"[" * 100_000
    value += b"]" * 100_000 + b"}"
    decision = route(value, request_headers(JSON), RoutingPolicy(Limits(), PREFIX, frozenset()))
    assert isinstance(decision, DeadLetter | Rejected)
