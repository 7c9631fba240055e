"""The two failure classes of `decode_request`, the limits, and forward compatibility."""

from __future__ import annotations

import json

import msgpack
import pytest

from schemas import (
    JSON,
    ErrorCode,
    InvalidRequestError,
    Limits,
    Request,
    UndecodableError,
    UndecodableReason,
    check_limits,
    decode_request,
    encode,
)

BASE = {"id": "req-1", "reply_to": "mini-infer.replies.abc", "prompt": "Hello"}


def packed(**fields) -> bytes:
    return msgpack.packb({**BASE, **fields})


def invalid(value: bytes, limits: Limits = Limits()) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        decode_request(value, None, limits)
    assert info.value.request_id == "req-1"
    assert info.value.reply_to == "mini-infer.replies.abc"
    return info.value


def undecodable(value: bytes | None, content_type=None, limits: Limits = Limits()) -> str:
    with pytest.raises(UndecodableError) as info:
        decode_request(value, content_type, limits)
    return info.value.reason


def test_minimal_request_gets_defaults() -> None:
    request = decode_request(packed())
    assert request.prompt == "Hello" and request.messages is None
    assert (request.max_tokens, request.temperature, request.top_p, request.top_k) == (
        256,
        1.0,
        1.0,
        0,
    )
    assert request.seed is None and request.deadline_ms is None and request.model is None
    assert request.stream is True and request.stop == [] and request.schema_version == 1


def test_unknown_fields_are_ignored() -> None:
    request = decode_request(packed(best_of=2, echo=True, future={"nested": [1, 2]}))
    assert request == decode_request(packed())


def test_logprobs_field_v1_1() -> None:
    assert decode_request(packed()).logprobs is None
    assert decode_request(packed(logprobs=5)).logprobs == 5
    for bad in (-1, 21):
        with pytest.raises(Exception, match="logprobs"):
            decode_request(packed(logprobs=bad))


def test_messages_instead_of_prompt() -> None:
    value = msgpack.packb({**BASE, "prompt": None, "messages": [{"role": "user", "content": "hi"}]})
    request = decode_request(value)
    assert request.prompt is None and request.messages[0].content == "hi"


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": None},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"prompt": None, "messages": []},
        {"prompt": ""},
    ],
)
def test_exactly_one_of_prompt_or_messages(fields) -> None:
    error = invalid(packed(**fields))
    assert error.code == ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", "5"),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("seed", -1),
        ("stop", 5),  # one string is a list of one since v1.2; a number is neither
        ("stop", ""),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("min_p", 1.5),
        ("logit_bias", {"7": 100.5}),
        ("logit_bias", {"x": 1}),
        ("top_logprobs", 21),
        ("response_format", {"type": "yaml"}),
        ("response_format", {"type": "regex", "regex": ""}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "n"}}),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("deadline_ms", -5),
        ("messages", [{"role": "user"}]),
    ],
)
def test_out_of_range_fields_name_the_field(field: str, value) -> None:
    fields = {field: value, "prompt": None} if field == "messages" else {field: value}
    error = invalid(packed(**fields))
    assert field in error.message


def test_limits_are_enforced_with_limit_exceeded() -> None:
    limits = Limits(max_prompt_chars=10, max_stop_strings=2, max_messages=2)
    assert invalid(packed(prompt="x" * 11), limits).code == ErrorCode.LIMIT_EXCEEDED
    assert invalid(packed(stop=["a", "b", "c"]), limits).code == ErrorCode.LIMIT_EXCEEDED
    chat = {"prompt": None, "messages": [{"role": "user", "content": "x"}] * 3}
    assert invalid(packed(**chat), limits).code == ErrorCode.LIMIT_EXCEEDED
    long_chat = {"prompt": None, "messages": [{"role": "user", "content": "x" * 6}] * 2}
    assert "characters" in invalid(packed(**long_chat), limits).message
    assert decode_request(packed(prompt="x" * 10, stop=["a", "b"]), None, limits).prompt == "x" * 10


def test_default_limit_on_stop_strings() -> None:
    assert invalid(packed(stop=[str(i) for i in range(17)])).code == ErrorCode.LIMIT_EXCEEDED
    request = Request(id="a", reply_to="b", prompt="x", stop=[str(i) for i in range(17)])
    with pytest.raises(InvalidRequestError):
        check_limits(request)


def test_too_big_is_undecodable_before_parsing() -> None:
    value = packed(prompt="x" * 2000)
    assert undecodable(value, limits=Limits(max_message_bytes=1000)) == UndecodableReason.TOO_LARGE
    # Same bytes, larger limit: fine. The size check is what rejected it.
    assert decode_request(value, None, Limits(max_message_bytes=4000)).prompt == "x" * 2000


def test_hostile_container_is_undecodable() -> None:
    huge_array = msgpack.packb({**BASE, "stop_token_ids": list(range(100_000))})
    assert undecodable(huge_array) == UndecodableReason.MALFORMED
    many_fields = msgpack.packb({**BASE, **{f"k{i}": i for i in range(1000)}})
    assert undecodable(many_fields) == UndecodableReason.MALFORMED


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (None, UndecodableReason.MALFORMED),
        (b"", UndecodableReason.MALFORMED),
        (b"\xc1", UndecodableReason.MALFORMED),
        (msgpack.packb(BASE) + b"\x00", UndecodableReason.MALFORMED),
        (msgpack.packb([BASE]), UndecodableReason.NOT_A_MAP),
        (msgpack.packb("hello"), UndecodableReason.NOT_A_MAP),
        (msgpack.packb({**BASE, "id": 7}), UndecodableReason.NO_ID),
        (msgpack.packb({**BASE, "id": ""}), UndecodableReason.NO_ID),
        (msgpack.packb({k: v for k, v in BASE.items() if k != "id"}), UndecodableReason.NO_ID),
        (msgpack.packb({**BASE, "reply_to": None}), UndecodableReason.BAD_REPLY_TO),
        (msgpack.packb({**BASE, "reply_to": "bad/name"}), UndecodableReason.BAD_REPLY_TO),
        (msgpack.packb({**BASE, "reply_to": ".."}), UndecodableReason.BAD_REPLY_TO),
        (msgpack.packb({**BASE, "reply_to": "x" * 250}), UndecodableReason.BAD_REPLY_TO),
    ],
)
def test_undecodable_reasons(value, reason: str) -> None:
    assert undecodable(value) == reason


def test_content_type_selects_the_codec() -> None:
    as_json = json.dumps(BASE).encode()
    assert decode_request(as_json, JSON).id == "req-1"
    assert undecodable(as_json, None) == UndecodableReason.MALFORMED  # msgpack by default
    assert undecodable(as_json, "text/plain") == UndecodableReason.UNSUPPORTED_CONTENT_TYPE


def test_json_hostile_nesting_is_undecodable() -> None:
    deep = b'{"id": "a", "reply_to": "b", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert undecodable(deep, JSON) == UndecodableReason.MALFORMED
    assert (
        undecodable(b'{"id": "a", "x": ' + b"9" * 5000 + b"}", JSON) == UndecodableReason.MALFORMED
    )


def test_error_message_does_not_echo_the_input() -> None:
    error = invalid(packed(max_tokens="SECRET-INPUT"))
    assert "SECRET-INPUT" not in error.message


def test_later_schema_version_is_accepted() -> None:
    request = Request(id="req-1", reply_to="r", prompt="p")
    value = msgpack.packb({**msgpack.unpackb(encode(request)), "schema_version": 2, "new": "x"})
    assert decode_request(value).schema_version == 2
