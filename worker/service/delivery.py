"""Messages sent again when a try fails: finals and dead letters, and token messages.

Finals and dead letters finish a request's offset only once the broker has them, so they tell
their caller how it ended: `await deliver(...)` gives None once acknowledged, or the last error
after `num_retries` more tries. Token messages are resent the same way so that a transient
failure leaves no gap in a stream, but nobody awaits them: `send_retrying` runs the same rule
from the publisher's callback, without a task or a future per message (a W2 step publishes 32
of them, and the task each once had was a good part of the event loop's cost per token:
loadtest/bench_reply_path.py). A message that ran out of its delivery deadline (or found its
topic's lane full) is not tried again: its topic is stuck, and the deadline is the whole
budget. One rule (`_gives_up`) for both, so the paths cannot drift apart.
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
        if _gives_up(error, num_tries, num_retries):
            return error
        num_tries += 1
        log.warning("delivery.retry", what=what, num_tries=num_tries, error=repr(error))
        acked = _publish(publisher, make_message())
    return None


def send_retrying(
    publisher: Publisher,
    make_message: Callable[[], Outgoing],
    num_retries: int,
    what: str,
    on_lost: Callable[[BaseException], None],
) -> None:
    """Publish `make_message()` like `deliver`, at most `1 + num_retries` times, with no task:
    each retry is queued from the failed try's callback. `on_lost(error)` is called once if
    every try failed."""

    def on_done(error: BaseException | None, num_tries: int = 0) -> None:
        if error is None:
            return
        if _gives_up(error, num_tries, num_retries):
            on_lost(error)
            return
        log.warning("delivery.retry", what=what, num_tries=num_tries + 1, error=repr(error))
        retry = make_message()
        retry.on_done = lambda error: on_done(error, num_tries + 1)
        publisher.publish(retry)

    message = make_message()
    message.on_done = on_done
    publisher.publish(message)


def _gives_up(error: BaseException, num_tries: int, num_retries: int) -> bool:
    """After `num_tries` retries failed with `error`, whether to stop trying."""
    return num_tries >= num_retries or isinstance(error, FINAL_ERRORS)


def _publish(publisher: Publisher, message: Outgoing) -> asyncio.Future[BaseException | None]:
    """Queue `message`; the future is set to its outcome (None, or the delivery error)."""
    acked: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    message.on_done = lambda error: acked.done() or acked.set_result(error)
    publisher.publish(message)
    return acked
