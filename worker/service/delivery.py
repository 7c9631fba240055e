"""Messages whose acknowledgement matters: finals and dead letters.

Both finish a request's offset only once the broker has them, so both are sent again when a
try fails, and both tell their caller how it ended: `await deliver(...)` gives None once
acknowledged, or the last error after `num_retries` more tries. A message that ran out of
its delivery deadline (or found its topic's lane full) is not tried again: its topic is stuck,
and the deadline is the whole budget. One helper, so the two paths cannot drift apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from worker.service.publisher import FINAL_ERRORS, Outgoing, Publisher

log = structlog.get_logger(__name__)


def deliver(
    publisher: Publisher,
    make_message: Callable[[], Outgoing],
    num_retries: int,
    what: str,
) -> asyncio.Task[BaseException | None]:
    """Publish `make_message()` until the broker acknowledges it, at most `1 + num_retries`
    times. The first try is queued before this returns, so messages go out in the order
    their callers made them. The task's result is None (acknowledged) or the last error; it
    never raises."""
    first = _publish(publisher, make_message())
    return asyncio.ensure_future(
        _until_acknowledged(publisher, make_message, first, num_retries, what)
    )


async def _until_acknowledged(
    publisher: Publisher,
    make_message: Callable[[], Outgoing],
    acked: asyncio.Future[BaseException | None],
    num_retries: int,
    what: str,
) -> BaseException | None:
    num_tries = 0  # retries so far
    while (error := await acked) is not None:
        if num_tries >= num_retries or isinstance(error, FINAL_ERRORS):
            return error
        num_tries += 1
        log.warning("delivery.retry", what=what, num_tries=num_tries, error=repr(error))
        acked = _publish(publisher, make_message())
    return None


def _publish(publisher: Publisher, message: Outgoing) -> asyncio.Future[BaseException | None]:
    """Queue `message`; the future is set to its outcome (None, or the delivery error)."""
    acked: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    message.on_done = lambda error: acked.done() or acked.set_result(error)
    publisher.publish(message)
    return acked
