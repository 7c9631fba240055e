"""Demultiplex one client's reply topic: each reply goes to the queue of its request id.

One reader serves every concurrent stream of a client. If it dies, every waiting stream is told
at once (instead of each hanging until its timeout), and so is every later one.

A request registered with a nonce (contract v1.2) takes only replies that carry that nonce:
anyone allowed to produce requests can name this client's reply topic and request id, and
without the nonce could make a worker publish a final of their choosing into this stream.
Replies without it are dropped, logged and counted (`num_forged`).

An offset gap in the reply partition is fetched again before it is believed
(worker/offset_gaps.py): a token message the embedded broker hid from one fetch is not lost.

On a shared reply topic (v1.2) most records of the partition are other clients' replies: they
are skipped by their key, the request id, before any decoding.
"""

from __future__ import annotations

import asyncio
import hmac

import structlog
from aiokafka import AIOKafkaConsumer

from schemas.codec import UndecodableError, decode_reply
from schemas.headers import read_content_type
from schemas.messages import FinalReply, TokenReply
from worker.offset_gaps import OffsetGaps, records_of

log = structlog.get_logger(__name__)

Item = TokenReply | FinalReply | BaseException  # a BaseException ends the stream that reads it


class ReplyRouter:
    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._nonces: dict[str, str | None] = {}
        self.failure: BaseException | None = None
        self.num_forged = 0  # replies dropped for a missing or wrong nonce
        self.gaps = OffsetGaps(what="replies")

    def register(self, request_id: str, nonce: str | None = None) -> asyncio.Queue[Item]:
        """Call before sending the request: its first reply may arrive before the send returns."""
        if self.failure is not None:
            raise self.failure
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight on this client")
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[request_id] = queue
        self._nonces[request_id] = nonce
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._nonces.pop(request_id, None)

    def fail_all(self, error: BaseException) -> None:
        self.failure = error
        for queue in self._queues.values():
            queue.put_nowait(error)

    def is_waiting_for(self, key: bytes | None) -> bool:
        """False for a record keyed by a request id this client is not waiting for."""
        if key is None:  # not keyed as workers key replies: let the decoded id decide
            return True
        return key.decode("utf-8", "replace") in self._queues

    def route(self, value: bytes | None, content_type: str | None) -> None:
        try:
            reply = decode_reply(value, content_type)
        except UndecodableError as exc:
            log.warning("client.reply_undecodable", reason=exc.reason, error=exc.message)
            return
        queue = self._queues.get(reply.id)
        if queue is None:  # a late reply (a second final) of a finished request
            return
        expected = self._nonces.get(reply.id)
        if expected is not None and not _same(reply.nonce or "", expected):
            self.num_forged += 1
            log.warning("client.reply_without_nonce", request_id=reply.id, attempt=reply.attempt)
            return
        queue.put_nowait(reply)

    async def run(self, consumer: AIOKafkaConsumer, failure_type: type[Exception]) -> None:
        """Read until cancelled. A read error ends every stream with `failure_type`."""
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=1000)
                for record in records_of(consumer, self.gaps, batches):
                    if self.is_waiting_for(record.key):
                        self.route(record.value, read_content_type(record.headers))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("client.reader_failed", error=repr(exc))
            self.fail_all(failure_type(f"the reply reader stopped: {exc!r}"))


def _same(carried: str, expected: str) -> bool:
    """Constant-time equality (a forger learns nothing from how fast a guess is dropped)."""
    return hmac.compare_digest(
        carried.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass")
    )
