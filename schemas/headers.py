"""Kafka header names and values of contract v1, and helpers to read them.

Headers arrive from aiokafka as `list[tuple[str, bytes]]` (a value may be `None`, and a name may
repeat). The helpers take that shape without importing aiokafka, so a producer that uses another
Kafka client can still depend on `schemas` alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import StrEnum

Headers = Sequence[tuple[str, bytes | None]]

CONTENT_TYPE = "content-type"
URGENCY = "urgency"
TRACEPARENT = "traceparent"

# Dead-letter headers: why a message was set aside and where it came from, so an operator can
# find and replay it. The DLQ value is the original bytes, untouched.
ERROR_REASON = "x-error-reason"
ERROR_MESSAGE = "x-error-message"
SOURCE_TOPIC = "x-source-topic"
SOURCE_PARTITION = "x-source-partition"
SOURCE_OFFSET = "x-source-offset"
# On a stub dead letter (the original did not fit, or could not be read at all): the original
# value's size in bytes. A stub has an empty value; its headers still say where to find the
# original (topic, partition, offset) for as long as the source topic retains it.
ORIGINAL_BYTES = "x-original-bytes"

# W3C trace context, version 00: version-traceid-parentid-flags, lowercase hex.
_TRACEPARENT_RE = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
MAX_ERROR_MESSAGE_CHARS = 1000


class Urgency(StrEnum):
    """How soon a request should run. The batcher orders by `priority`: 0 runs first."""

    CRITICAL = "critical"
    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"

    @property
    def priority(self) -> int:
        return _PRIORITY[self]

    @classmethod
    def parse(cls, value: str | bytes | None) -> Urgency:
        """A missing or unknown urgency is `normal`: a typo in a header must not lose a request."""
        if isinstance(value, bytes):
            value = value.decode("utf-8", errors="replace")
        try:
            return cls(value.strip().lower()) if value is not None else cls.NORMAL
        except ValueError:
            return cls.NORMAL


_PRIORITY = {Urgency.CRITICAL: 0, Urgency.HIGH: 1, Urgency.NORMAL: 2, Urgency.LOW: 3}


def get_header(headers: Headers | None, name: str) -> bytes | None:
    """The value of the last header called `name` (names compared case-insensitively), or None.

    The last one wins so that a proxy which appends a header overrides the original.
    """
    wanted = name.lower()
    found = None
    for key, value in headers or ():
        if key.lower() == wanted:
            found = value
    return found


def get_text_header(headers: Headers | None, name: str) -> str | None:
    value = get_header(headers, name)
    if value is None:
        return None
    return value.decode("utf-8", errors="replace")


def read_content_type(headers: Headers | None) -> str | None:
    return get_text_header(headers, CONTENT_TYPE)


def read_urgency(headers: Headers | None) -> Urgency:
    return Urgency.parse(get_header(headers, URGENCY))


def read_traceparent(headers: Headers | None) -> str | None:
    """A well-formed W3C traceparent, or None: a malformed one would poison every span."""
    value = get_text_header(headers, TRACEPARENT)
    if value is None:
        return None
    value = value.strip().lower()
    return value if _TRACEPARENT_RE.fullmatch(value) else None


def request_headers(
    content_type: str, urgency: Urgency | str = Urgency.NORMAL, traceparent: str | None = None
) -> list[tuple[str, bytes]]:
    """Headers for a request message, in the shape aiokafka's `send(headers=...)` takes."""
    headers = [
        (CONTENT_TYPE, content_type.encode()),
        (URGENCY, Urgency.parse(urgency).value.encode()),
    ]
    if traceparent is not None:
        headers.append((TRACEPARENT, traceparent.encode()))
    return headers


def dlq_headers(
    original: Headers | None, *, reason: str, message: str, topic: str, partition: int, offset: int
) -> list[tuple[str, bytes | None]]:
    """The original headers (so content-type and traceparent survive) plus where and why.

    Error headers already on the message (a replay from the DLQ failing again) are replaced.
    """
    ours = {ERROR_REASON, ERROR_MESSAGE, SOURCE_TOPIC, SOURCE_PARTITION, SOURCE_OFFSET}
    return [
        *((k, v) for k, v in original or () if k.lower() not in ours),
        (ERROR_REASON, reason.encode()),
        (ERROR_MESSAGE, message[:MAX_ERROR_MESSAGE_CHARS].encode()),
        (SOURCE_TOPIC, topic.encode()),
        (SOURCE_PARTITION, str(partition).encode()),
        (SOURCE_OFFSET, str(offset).encode()),
    ]
