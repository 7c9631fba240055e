"""Replies on the wire: encoding, reply headers, and the delivery rules of finals.

A final is the one message whose acknowledgement matters: only then may the request's offset be
committed. So a failed final is sent again (same `seq`: a client drops the duplicate if both
land), a final too large for the broker is replaced by a small error final, and a final that
still cannot be delivered is left unacknowledged: its offset is never committed and the request
is redelivered after the next rebalance or restart (at-least-once beats a silent loss).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from schemas.codec import MSGPACK, encode
from schemas.headers import CONTENT_TYPE, TRACEPARENT
from schemas.messages import ErrorInfo, FinalReply, TokenReply
from worker.job import Job
from worker.publisher import Outgoing, Publisher

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
        self.on_acked: Callable[[Job], None] = lambda job: None
        # Every retry failed: the caller dead-letters the request so its offset can move on.
        self.on_undeliverable: Callable[[Job, BaseException], None] = lambda job, error: None

    def send(self, job: Job, message: TokenReply | FinalReply) -> None:
        value = encode(message, MSGPACK)
        if isinstance(message, FinalReply) and len(value) > self._max_message_bytes:
            message = _too_large(message, len(value), self._max_message_bytes)
            value = encode(message, MSGPACK)
        on_done = None
        if isinstance(message, FinalReply):
            on_done = lambda error, m=message: self._final_done(job, m, error)  # noqa: E731
        self._publisher.publish(
            Outgoing(job.reply_to, job.request_id.encode(), value, job.reply_headers, on_done)
        )

    def _final_done(self, job: Job, final: FinalReply, error: BaseException | None) -> None:
        if error is None:
            self.on_acked(job)
            return
        if job.num_final_tries < self._num_final_retries:
            job.num_final_tries += 1
            log.warning(
                "final.retry", request_id=job.request_id, attempt=job.attempt, error=repr(error)
            )
            self.send(job, final)
            return
        log.error(
            "final.undeliverable",
            request_id=job.request_id,
            attempt=job.attempt,
            reply_to=job.reply_to,
            error=repr(error),
        )
        self.on_undeliverable(job, error)


def _too_large(final: FinalReply, num_bytes: int, max_bytes: int) -> FinalReply:
    message = (
        f"the final reply is {num_bytes} bytes, over the limit of {max_bytes}; lower max_tokens"
    )
    return final.model_copy(
        update={
            "finish_reason": "error",
            "text": "",
            "error": ErrorInfo(code=REPLY_TOO_LARGE, message=message),
        }
    )
