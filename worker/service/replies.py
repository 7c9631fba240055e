"""Replies on the wire: encoding, reply headers, and the delivery rules of finals.

A final is the one message whose acknowledgement matters: only then may the request's offset be
committed. So a failed final is sent again (same `seq`: a client drops the duplicate if both
land), and a final too large for the broker is replaced by a small error final. `send` returns
the final's delivery (awaited: None, or the last error); when every try failed, the pipeline
dead-letters the request (reason `final_undeliverable`) so that its partition's commits can
move on.

Token messages are resent on failure too (same `seq`), so a transient failure leaves no gap in
an attempt's stream. A resent token can land after later ones; clients order by `seq` (the SDK
keeps early messages until the gap fills), and the final's text is authoritative anyway.
"""

from __future__ import annotations

import asyncio

import structlog

from schemas.codec import MSGPACK, encode
from schemas.headers import CONTENT_TYPE, TRACEPARENT
from schemas.messages import ErrorInfo, FinalReply, TokenReply
from worker.service.delivery import deliver, send_retrying
from worker.service.job import Job
from worker.service.publisher import Outgoing, Publisher

log = structlog.get_logger(__name__)

REPLY_TOO_LARGE = "reply_too_large"


def reply_headers(traceparent: str | None) -> list[tuple[str, bytes]]:
    headers = [(CONTENT_TYPE, MSGPACK.encode())]
    if traceparent is not None:
        headers.append((TRACEPARENT, traceparent.encode()))
    return headers


class ReplyWriter:
    def __init__(
        self, publisher: Publisher, max_message_bytes: int, num_final_retries: int
    ) -> None:
        self._publisher = publisher
        self._max_message_bytes = max_message_bytes
        self._num_final_retries = num_final_retries

    def send(
        self, job: Job, message: TokenReply | FinalReply
    ) -> asyncio.Task[BaseException | None] | None:
        """Publish one reply. For a final, returns its delivery outcome (see `deliver`)."""
        value = encode(message, MSGPACK)
        if isinstance(message, TokenReply):  # a lost token is logged, never raised
            send_retrying(
                self._publisher, lambda: _outgoing(job, value), self._num_final_retries, "token",
                _token_lost,
            )  # fmt: skip
            return None
        if len(value) > self._max_message_bytes:
            message = _too_large(message, len(value), self._max_message_bytes)
            value = encode(message, MSGPACK)
        return deliver(
            self._publisher,
            lambda: _outgoing(job, value),
            self._num_final_retries,
            "final",
        )


def _outgoing(job: Job, value: bytes) -> Outgoing:
    return Outgoing(
        job.reply_to, job.request_id.encode(), value, job.reply_headers,
        partition=job.reply_partition,
    )  # fmt: skip


def _token_lost(error: BaseException) -> None:
    log.warning("reply.token_lost", error=repr(error))


def _too_large(final: FinalReply, num_bytes: int, max_bytes: int) -> FinalReply:
    message = (
        f"the final reply is {num_bytes} bytes, over the limit of {max_bytes}; lower max_tokens"
    )
    return final.model_copy(
        update={
            "finish_reason": "error",
            "text": "",
            "choices": None,  # v1.2 n > 1: the choices' texts are the bulk too
            "error": ErrorInfo(code=REPLY_TOO_LARGE, message=message),
        }
    )
