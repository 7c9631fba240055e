from __future__ import annotations

import pytest

from schemas import headers as h
from schemas.headers import Urgency

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_urgency_priorities_are_ordered() -> None:
    ordered = sorted(Urgency, key=lambda u: u.priority)
    assert ordered == [Urgency.CRITICAL, Urgency.HIGH, Urgency.NORMAL, Urgency.LOW]
    assert [u.priority for u in ordered] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"critical", Urgency.CRITICAL),
        (b" HIGH ", Urgency.HIGH),
        ("low", Urgency.LOW),
        (None, Urgency.NORMAL),
        (b"urgent!!", Urgency.NORMAL),
        (b"\xff\xfe", Urgency.NORMAL),
    ],
)
def test_urgency_parse(raw, expected: Urgency) -> None:
    assert Urgency.parse(raw) is expected


def test_read_request_headers_back() -> None:
    headers = h.request_headers("application/msgpack", "high", TRACEPARENT)
    assert h.read_content_type(headers) == "application/msgpack"
    assert h.read_urgency(headers) is Urgency.HIGH
    assert h.read_traceparent(headers) == TRACEPARENT
    assert all(isinstance(v, bytes) for _, v in headers)


def test_missing_and_repeated_headers() -> None:
    assert h.read_urgency([]) is Urgency.NORMAL
    assert h.read_content_type(None) is None
    assert h.read_traceparent([("traceparent", None)]) is None
    repeated = [("urgency", b"low"), ("Urgency", b"critical")]
    assert h.read_urgency(repeated) is Urgency.CRITICAL  # the last one wins, names ignore case


@pytest.mark.parametrize("bad", [b"garbage", b"00-xyz-00f067aa0ba902b7-01", b"\xff"])
def test_malformed_traceparent_is_dropped(bad: bytes) -> None:
    assert h.read_traceparent([("traceparent", bad)]) is None


def test_dlq_headers_keep_originals_and_replace_old_errors() -> None:
    original = [("content-type", b"application/json"), ("x-error-reason", b"old"), ("k", None)]
    headers = h.dlq_headers(
        original,
        reason="malformed",
        message="x" * 5000,
        topic="mini-infer.requests",
        partition=3,
        offset=42,
    )
    assert h.get_header(headers, "content-type") == b"application/json"
    assert ("k", None) in headers
    assert [v for k, v in headers if k == h.ERROR_REASON] == [b"malformed"]
    assert h.get_header(headers, h.SOURCE_PARTITION) == b"3"
    assert h.get_header(headers, h.SOURCE_OFFSET) == b"42"
    assert h.get_header(headers, h.SOURCE_TOPIC) == b"mini-infer.requests"
    assert len(h.get_header(headers, h.ERROR_MESSAGE)) == h.MAX_ERROR_MESSAGE_CHARS
