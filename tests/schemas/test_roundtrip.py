"""Every message survives encode -> decode unchanged, in both content types."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import JSON, MSGPACK, codec, decode_cancel, decode_reply, decode_request, encode
from schemas.messages import FinalReply, Request, TokenReply
from tests.schemas.strategies import cancels, final_replies, requests, token_replies

CONTENT_TYPES = st.sampled_from([MSGPACK, JSON])
EXAMPLES = settings(max_examples=60, deadline=None)


@EXAMPLES
@given(request=requests(), content_type=CONTENT_TYPES)
def test_request_round_trip(request: Request, content_type: str) -> None:
    assert decode_request(encode(request, content_type), content_type) == request


@EXAMPLES
@given(reply=token_replies | final_replies(), content_type=CONTENT_TYPES)
def test_reply_round_trip(reply: TokenReply | FinalReply, content_type: str) -> None:
    decoded = decode_reply(encode(reply, content_type), content_type)
    assert type(decoded) is type(reply)
    assert decoded == reply


@EXAMPLES
@given(cancel=cancels, content_type=CONTENT_TYPES)
def test_cancel_round_trip(cancel, content_type: str) -> None:
    assert decode_cancel(encode(cancel, content_type), content_type) == cancel


@settings(max_examples=200, deadline=None)
@given(reply=token_replies)
def test_token_messages_encode_to_the_bytes_of_the_models_own_dump(reply: TokenReply) -> None:
    """The hand-built map of a token message (the worker's per-token path) is byte for byte
    what pydantic's dump gives, with and without nonce, index and logprobs."""
    assert encode(reply, MSGPACK) == codec._encode_msgpack(reply)


def test_the_hand_built_token_map_knows_every_field_of_the_model() -> None:
    """A field added to TokenReply must be added to `_token_reply_map` too."""
    assert tuple(TokenReply.model_fields) == codec.TOKEN_REPLY_FIELDS


def test_msgpack_is_the_default_and_a_plain_map() -> None:
    request = Request(id="r1", reply_to="mini-infer.replies.c1", prompt="hi")
    value = encode(request)
    obj = msgpack.unpackb(value)
    assert obj["id"] == "r1" and obj["prompt"] == "hi" and obj["schema_version"] == 1
    assert "messages" not in obj  # absent fields are left out, not sent as nil
    assert decode_request(value, None) == request


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", "Application/JSON", b"application/json"]
)
def test_json_content_type_variants(content_type) -> None:
    request = Request(id="r1", reply_to="t", prompt="hi")
    assert decode_request(encode(request, JSON), content_type) == request


def test_cancel_needs_only_an_id() -> None:
    assert decode_cancel(msgpack.packb({"id": "r9"})).id == "r9"
