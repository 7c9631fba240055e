"""The routing function: any bytes -> DLQ, error final or accepted; never an exception."""

from __future__ import annotations

import json

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec import JSON, MSGPACK, Limits, UndecodableReason, encode
from schemas.headers import request_headers
from schemas.messages import ErrorCode, Request
from tests.schemas.strategies import requests
from worker.service.routing import Accepted, DeadLetter, Rejected, RoutingPolicy, derive_seed, route

PREFIX = "mini-infer.replies."
POLICY = RoutingPolicy(
    Limits(max_message_bytes=4096, max_prompt_chars=500), PREFIX, frozenset({"tiny"})
)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

header_lists = st.lists(
    st.tuples(
        st.sampled_from(["content-type", "urgency", "traceparent", "x"]),
        st.none() | st.binary(max_size=40),
    ),
    max_size=4,
)


@given(st.binary(max_size=300) | st.none(), header_lists)
@settings(max_examples=300)
def test_arbitrary_bytes_never_raise(value, headers) -> None:
    assert isinstance(route(value, headers, POLICY), DeadLetter | Rejected | Accepted)


@given(
    st.dictionaries(
        st.sampled_from(
            [
                "id",
                "reply_to",
                "prompt",
                "messages",
                "max_tokens",
                "temperature",
                "seed",
                "stop",
                "model",
            ]
        ),
        st.none()
        | st.booleans()
        | st.integers(-5, 2**64 - 1)
        | st.floats()
        | st.text(max_size=30)
        | st.lists(st.text(max_size=5), max_size=3),
    ),
    st.sampled_from([MSGPACK, JSON]),
)
@settings(max_examples=300)
def test_arbitrary_maps_give_a_dead_letter_or_a_final_to_an_allowed_topic(
    fields, content_type
) -> None:
    fields = dict(fields, reply_to=PREFIX + "x") if "reply_to" in fields else fields
    raw = json.dumps(fields).encode() if content_type == JSON else msgpack.packb(fields)
    decision = route(raw, request_headers(content_type), POLICY)
    if isinstance(decision, Rejected | Accepted):
        assert decision.reply_to.startswith(PREFIX)  # never written outside the prefix


@given(requests())
@settings(max_examples=200)
def test_valid_requests_are_accepted_or_rejected_never_dead_lettered(request: Request) -> None:
    request = request.model_copy(update={"reply_to": PREFIX + "c1", "model": None})
    decision = route(encode(request, MSGPACK), request_headers(MSGPACK, "low", TRACEPARENT), POLICY)
    if len(encode(request, MSGPACK)) > POLICY.limits.max_message_bytes:
        assert isinstance(decision, DeadLetter) and decision.reason == UndecodableReason.TOO_LARGE
        return
    assert isinstance(decision, Accepted | Rejected), decision
    assert decision.request_id == request.id
    if isinstance(decision, Accepted):
        assert decision.urgency == "low" and decision.traceparent == TRACEPARENT
        expected_seed = request.seed if request.seed is not None else derive_seed(request.id)
        assert decision.params.seed == expected_seed
        assert_v1_2_fields_reach_the_engine(request, decision.params)


def assert_v1_2_fields_reach_the_engine(request: Request, params) -> None:
    assert params.stop == tuple(request.stop)
    assert params.logprobs == request.num_logprobs
    assert params.presence_penalty == request.presence_penalty
    assert params.frequency_penalty == request.frequency_penalty
    assert params.repetition_penalty == request.repetition_penalty
    assert params.min_p == request.min_p
    assert dict(params.logit_bias) == {int(t): b for t, b in request.logit_bias.items()}
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        assert params.structured_output is None
        return
    assert params.structured_output.type == fmt.type
    if fmt.type == "json_schema":
        assert json.loads(params.structured_output.spec) == fmt.json_schema.json_schema


def request_bytes(**fields) -> bytes:
    base = {"id": "r1", "reply_to": PREFIX + "c1", "prompt": "hello"}
    return encode(Request(**{**base, **fields}), MSGPACK)


def test_reply_to_outside_the_prefix_goes_to_the_dlq_even_when_invalid() -> None:
    outside = route(request_bytes(reply_to="mini-infer.requests"), None, POLICY)
    assert isinstance(outside, DeadLetter) and outside.reason == UndecodableReason.BAD_REPLY_TO
    invalid = msgpack.packb({"id": "r1", "reply_to": "elsewhere", "max_tokens": 0})
    assert isinstance(route(invalid, None, POLICY), DeadLetter)


def test_invalid_requests_get_an_error_final() -> None:
    no_prompt = msgpack.packb({"id": "r1", "reply_to": PREFIX + "c1"})
    decision = route(no_prompt, request_headers(MSGPACK, "high", TRACEPARENT), POLICY)
    assert isinstance(decision, Rejected) and decision.code == ErrorCode.INVALID_REQUEST
    assert decision.urgency == "high" and decision.traceparent == TRACEPARENT
    too_long = route(request_bytes(prompt="x" * 501), None, POLICY)
    assert isinstance(too_long, Rejected) and too_long.code == ErrorCode.LIMIT_EXCEEDED
    other_model = route(request_bytes(model="gpt-9"), None, POLICY)
    assert isinstance(other_model, Rejected) and other_model.code == ErrorCode.MODEL_NOT_SERVED
    assert isinstance(route(request_bytes(model="tiny"), None, POLICY), Accepted)


def test_garbage_and_json_are_told_apart_by_content_type() -> None:
    assert route(b"\xc1\xff garbage", None, POLICY).reason == UndecodableReason.MALFORMED
    as_json = json.dumps({"id": "j", "reply_to": PREFIX + "c", "prompt": "hi"}).encode()
    assert isinstance(route(as_json, request_headers(JSON), POLICY), Accepted)
    assert isinstance(route(as_json, None, POLICY), DeadLetter)  # msgpack by default


def test_derived_seeds_are_stable_and_in_range() -> None:
    assert derive_seed("abc") == derive_seed("abc") != derive_seed("abd")
    assert 0 <= derive_seed("abc") < 2**63


def test_openai_request_shapes_translate() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    decision = route(
        request_bytes(
            stop="###", logprobs=True, top_logprobs=3, logit_bias={"42": -100},
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        ),
        None, POLICY,
    )  # fmt: skip
    assert isinstance(decision, Accepted)
    params = decision.params
    assert params.stop == ("###",) and params.logprobs == 3 and params.logit_bias == ((42, -100.0),)
    assert params.structured_output.type == "json_schema"
    assert json.loads(params.structured_output.spec) == schema
    assert route(request_bytes(logprobs=True), None, POLICY).params.logprobs == 0
    choice = route(
        request_bytes(response_format={"type": "choice", "choice": ["y", "n"]}), None, POLICY
    )
    assert choice.params.structured_output.spec == ("y", "n")


def test_a_schema_that_is_not_json_is_an_error_final() -> None:
    # msgpack can carry bytes inside the schema; JSON cannot: an invalid request, not a crash.
    fields = {
        "id": "r1", "reply_to": PREFIX + "c1", "prompt": "x",
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"x": b"\x00"}}},
    }  # fmt: skip
    decision = route(msgpack.packb(fields, use_bin_type=True), None, POLICY)
    assert isinstance(decision, Rejected) and decision.code == ErrorCode.INVALID_REQUEST
    assert "schema" in decision.message
