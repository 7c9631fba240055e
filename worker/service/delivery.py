"""Messages whose acknowledgement matters: finals and dead letters.

Both finish a request's offset only once the broker has them, so both are sent again when a
try fails, and both tell their caller how it ended through a future: done with None once
acknowledged, or with the last error after `num_retries` more tries. A message that ran out of
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
) -> asyncio.Future[None]:
    """Publish `make_message()` until the broker acknowledges it, at most `1 + num_retries`
    times. The future never raises into the event loop: read it with `.exception()`."""
    outcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    num_tries = 0

    def send() -> None:
        message = make_message()
        message.on_done = on_done
        publisher.publish(message)

    def on_done(error: BaseException | None) -> None:
        nonlocal num_tries
        if outcome.done():
            return
        if error is None:
            outcome.set_result(None)
        elif num_tries < num_retries and not isinstance(error, FINAL_ERRORS):
            num_tries += 1
            log.warning("delivery.retry", what=what, num_tries=num_tries, error=repr(error))
            send()
        else:
            outcome.set_exception(error)

    send()
    return outcome
