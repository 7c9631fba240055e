"""Untrusted bytes never raise anything but the two decode errors."""

from __future__ import annotations

import contextlib
import json

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
    JSON,
    MSGPACK,
    InvalidRequestError,
    Request,
    UndecodableError,
    decode_cancel,
    decode_reply,
    decode_request,
    encode,
)

CONTENT_TYPES = st.sampled_from([MSGPACK, JSON, None])

# Values msgpack/JSON can carry, nested, to build maps that parse but are wrong in every way.
scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
)
trees = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)
keys = st.sampled_from(
    ["id", "reply_to", "prompt", "messages", "max_tokens", "stop", "top_p", "seed", "x"]
)


@settings(max_examples=300, deadline=None)
@given(value=st.binary(max_size=200), content_type=CONTENT_TYPES)
def test_arbitrary_bytes_raise_only_decode_errors(value: bytes, content_type) -> None:
    for decode in (decode_request, decode_reply, decode_cancel):
        with contextlib.suppress(UndecodableError, InvalidRequestError):
            decode(value, content_type)


@settings(max_examples=150, deadline=None)
@given(obj=st.dictionaries(keys, trees, max_size=9), content_type=st.sampled_from([MSGPACK, JSON]))
def test_arbitrary_maps_raise_only_decode_errors(obj: dict, content_type: str) -> None:
    value = json.dumps(obj).encode() if content_type == JSON else msgpack.packb(obj)
    try:
        request = decode_request(value, content_type)
    except UndecodableError as exc:
        # No reply is possible only when id or reply_to is missing or unusable.
        assert exc.reason in {"no_id", "bad_reply_to"}
    except InvalidRequestError as exc:
        assert exc.request_id == obj["id"] and exc.reply_to == obj["reply_to"]
    else:
        assert isinstance(request, Request)


@settings(max_examples=100, deadline=None)
@given(cut=st.integers(0, 80), flip=st.integers(0, 255))
def test_truncated_or_corrupted_messages(cut: int, flip: int) -> None:
    value = encode(Request(id="r", reply_to="t", prompt="hello world", stop=["a"]))
    corrupted = [value[:cut], value[:cut] + bytes([flip]) + value[cut + 1 :]]
    for candidate in corrupted:
        with contextlib.suppress(UndecodableError, InvalidRequestError):
            decode_request(candidate)
