"""The dead-letter writer: one for the whole worker, used by the consumer (messages that cannot
be answered) and the pipeline (requests whose final the reply topic refused).

The dead letter is the original record, bytes untouched, with headers saying why and where it
came from (`schemas.headers.dlq_headers`), so an operator can find and replay it. Its offset is
finished once the broker acknowledges the dead letter.

A dead letter must never wedge its partition, so it degrades in two steps:
- the original does not fit (bigger than `max_message_bytes`, or the broker refused it every
  try): a bounded stub goes instead, with an empty value, the error and source headers, the
  original's size (`x-original-bytes`) and only those of its headers that are small;
- not even the stub can be written (the DLQ itself is unwritable): the offset stays unfinished,
  so it is redelivered, and `on_unwritable` is told. The worker then fails loudly (not ready,
  non-zero exit) instead of holding an in-flight slot and the watermark for the life of the
  process while health says ready.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog

from schemas.headers import ORIGINAL_BYTES, Headers, dlq_headers
from worker.service.delivery import deliver
from worker.service.offsets import OffsetTracker
from worker.service.publisher import Outgoing, Publisher
from worker.service.telemetry import Telemetry

log = structlog.get_logger(__name__)

# What of the original a stub keeps: the key up to this, and headers no bigger than this each.
MAX_STUB_KEY_BYTES = 1024
MAX_STUB_HEADER_BYTES = 1024
MAX_STUB_HEADERS = 32


def record_bytes(key: bytes | None, value: bytes | None, headers: Headers | None) -> int:
    """The payload size of a record, as the producer's size limit sees it (framing aside)."""
    header_bytes = sum(len(k.encode()) + len(v or b"") for k, v in headers or ())
    return len(key or b"") + len(value or b"") + header_bytes


def stub_headers(original: Headers | None) -> list[tuple[str, bytes | None]]:
    small = [(k, v) for k, v in original or () if len(k) + len(v or b"") <= MAX_STUB_HEADER_BYTES]
    return small[:MAX_STUB_HEADERS]


class DeadLetterWriter:
    def __init__(
        self,
        publisher: Publisher,
        tracker: OffsetTracker,
        telemetry: Telemetry,
        dlq_topic: str,
        num_retries: int,
        max_message_bytes: int,
        on_unwritable: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._publisher = publisher
        self._tracker = tracker
        self._telemetry = telemetry
        self._dlq_topic = dlq_topic
        self._num_retries = num_retries
        self._max_message_bytes = max_message_bytes
        self._on_unwritable = on_unwritable
        self._settling: set[asyncio.Task] = set()  # dead letters awaiting their outcome

    def write(self, partition: Any, record: Any, reason: str, message: str, *, epoch: Any) -> None:
        """Set `record` (consumed from `partition` in assignment `epoch`) aside; finishes its
        offset once acked."""
        log.warning("request.dead_lettered", reason=reason, error=message)
        self._telemetry.dlq_messages.add(1, {"reason": reason})
        headers = dlq_headers(
            record.headers, reason=reason, message=message,
            topic=partition.topic, partition=partition.partition, offset=record.offset,
        )  # fmt: skip
        full = Outgoing(self._dlq_topic, record.key, record.value, headers)
        stub = self._stub(partition, record, reason, message)
        fits = record_bytes(record.key, record.value, headers) <= self._max_message_bytes
        first = full if fits and record.value is not None else stub
        self._send(first, stub if first is full else None, partition, record.offset, epoch)

    def _stub(self, partition: Any, record: Any, reason: str, message: str) -> Outgoing:
        headers = dlq_headers(
            stub_headers(record.headers), reason=reason, message=message,
            topic=partition.topic, partition=partition.partition, offset=record.offset,
        )  # fmt: skip
        original_bytes = len(record.value) if record.value is not None else None
        if original_bytes is not None:
            headers.append((ORIGINAL_BYTES, str(original_bytes).encode()))
        key = record.key[:MAX_STUB_KEY_BYTES] if record.key is not None else None
        return Outgoing(self._dlq_topic, key, b"", headers)

    def _send(
        self, letter: Outgoing, fallback: Outgoing | None, partition: Any, offset: int, epoch: Any
    ) -> None:
        delivery = deliver(
            self._publisher,
            lambda: Outgoing(letter.topic, letter.key, letter.value, letter.headers),
            self._num_retries,
            "dead_letter",
        )  # queued now, in order; its outcome is awaited below
        task = asyncio.ensure_future(self._settle(delivery, fallback, partition, offset, epoch))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, delivery, fallback, partition: Any, offset: int, epoch: Any) -> None:
        """Acknowledged: the offset is done. Failed: the stub, if there is one still to try;
        else the offset is left unfinished (never committed, so redelivered after a restart)."""
        error = await delivery
        if error is None:
            self._tracker.finish(partition, offset, epoch)
        elif fallback is not None:
            log.warning("request.dead_letter_stubbed", offset=offset, error=repr(error))
            self._send(fallback, None, partition, offset, epoch)
        else:
            log.error("dlq.unwritable", offset=offset, error=repr(error))
            if self._on_unwritable is not None:
                self._on_unwritable(error)
