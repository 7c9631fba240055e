"""The urgency batcher: holds decoded requests for a short window, then releases them to the
engine most urgent first, then earliest deadline, then first come, within a token budget.

Why hold at all, when the engine batches continuously? Because order is decided at release: a
`critical` request that arrives while a backlog of `low` ones waits here overtakes all of them,
and the engine's own priority scheduling (urgency is the engine priority) keeps it ahead inside
the scheduler too. The window is the longest a request waits for more company, by urgency:
critical never waits, low waits longest (50 ms by default, invisible next to a forward pass).

The token budget keeps the engine's queue short, so that ordering here still matters: a flush
releases prompt tokens only up to `max_batch_tokens` minus those already handed to the engine
and not yet started. It adapts to prompt lengths: when the engine has nothing queued the head
of the queue is released however long its prompt, so a long prompt is never starved.

The budget is per urgency: an item is held back only by queued work at least as urgent as
itself. A saturated worker (the engine's queue full of `low` prompts) still releases a
`critical` request at once; the engine's scheduler puts it ahead of its waiting queue and
preempts less urgent running work for it, so urgent work reaches the model within about one
step of arriving. The engine's queue stays bounded: at most `max_batch_tokens` of queued
prompt tokens per urgency class.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from schemas.headers import Urgency
from worker.service.settings import BatcherSettings

log = structlog.get_logger(__name__)

LEAST_URGENT = max(u.priority for u in Urgency)


@dataclass
class PendingItem:
    item: Any
    urgency: Urgency
    deadline_ms: int | None  # absolute Unix epoch ms, None = no deadline
    arrival_seq: int
    num_tokens: int
    due_s: float = field(default=0.0)  # monotonic time at which its window closes

    @property
    def order_key(self) -> tuple[int, float, int]:
        # Compared as a float, and bounded: any int compares with inf, but a producer's integer
        # must never be able to make ordering raise (the contract bounds it too).
        deadline = math.inf if self.deadline_ms is None else _bounded(self.deadline_ms)
        return (self.urgency.priority, deadline, self.arrival_seq)


def _bounded(deadline_ms: int) -> float:
    try:
        return float(deadline_ms)
    except (OverflowError, TypeError, ValueError):
        return math.inf


def select_batch(
    pending: list[PendingItem],
    max_tokens: int,
    queued_tokens: Callable[[int], int] = lambda priority: 0,
) -> tuple[list[PendingItem], list[PendingItem]]:
    """Split `pending` into (released, kept), both in release order.

    `queued_tokens(priority)`: prompt tokens the engine holds, not yet started, of requests at
    least as urgent as `priority`. An item fits when those, plus what this batch released before
    it (all at least as urgent: the order is by urgency first), plus its own tokens stay within
    `max_tokens`. Strictly in order: the first item that does not fit stops the batch (skipping
    it for smaller ones behind would starve long prompts, and anything behind it is no more
    urgent, so it has no more room). The first item goes even alone over the budget when nothing
    at least as urgent is queued (a long prompt is never starved).
    """
    ordered = sorted(pending, key=lambda p: p.order_key)
    num_tokens = 0
    num_released = 0
    for p in ordered:
        queued = queued_tokens(p.urgency.priority)
        is_head_forced = num_released == 0 and queued == 0
        if not is_head_forced and queued + num_tokens + p.num_tokens > max_tokens:
            break
        num_tokens += p.num_tokens
        num_released += 1
    return ordered[:num_released], ordered[num_released:]


class Batcher:
    """Async front of `select_batch`. `release` receives each batch (in order) on the event loop;
    `queued_tokens(priority)` tells how many released prompt tokens of requests at least as
    urgent as `priority` the engine has not started yet. Built without `release` (the worker
    builds it before the pipeline that takes its batches), it is given one by `connect`."""

    def __init__(
        self,
        settings: BatcherSettings,
        release: Callable[[list[Any]], None] | None = None,
        queued_tokens: Callable[[int], int] = lambda priority: 0,
        clock: Callable[[], float] = time.monotonic,
        on_error: Callable[[Any, BaseException], None] | None = None,
    ) -> None:
        self._settings = settings
        self._release = release or _unconnected
        # Told about an item whose release raised; that item is out of the batcher, its batch
        # neighbours are released all the same, and the batcher task lives on.
        self._on_error = on_error
        self._queued_tokens = queued_tokens
        self._clock = clock
        self._pending: list[PendingItem] = []
        self._num_arrivals = 0
        self._wakeup = asyncio.Event()

    def connect(
        self,
        release: Callable[[list[Any]], None],
        on_error: Callable[[Any, BaseException], None] | None = None,
    ) -> None:
        """Where released batches go, and who is told about an item whose release raised."""
        self._release, self._on_error = release, on_error

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def submit(self, item: Any, urgency: Urgency, deadline_ms: int | None, num_tokens: int) -> None:
        window_s = self._settings.window_ms(urgency) / 1000
        self._pending.append(
            PendingItem(
                item, urgency, deadline_ms, self._num_arrivals, num_tokens, self._clock() + window_s
            )
        )
        self._num_arrivals += 1
        self._wakeup.set()

    def tokens_at_least_as_urgent_as(self, priority: int) -> int:
        """Prompt tokens held here of requests with priority value <= `priority`."""
        return sum(p.num_tokens for p in self._pending if p.urgency.priority <= priority)

    def wake(self) -> None:
        """The engine started work (its queue shrank): maybe there is budget again. With nothing
        pending there is nothing to look at (`add` wakes the batcher): no wake-up, which the
        pipeline would otherwise pay after every engine step."""
        if self._pending:
            self._wakeup.set()

    def remove(self, predicate: Callable[[Any], bool]) -> list[Any]:
        """Take out pending items (cancelled, expired, revoked) before they reach the engine."""
        removed = [p.item for p in self._pending if predicate(p.item)]
        if removed:
            self._pending = [p for p in self._pending if not predicate(p.item)]
        return removed

    def drain(self) -> list[Any]:
        items = [p.item for p in sorted(self._pending, key=lambda p: p.order_key)]
        self._pending = []
        return items

    def _release_isolated(self, items: list[Any]) -> None:
        """Release `items` as one batch; if that raises, release them one by one so that only
        the item that raises is lost to the batch (and reported to `on_error`)."""
        try:
            self._release(items)
            return
        except Exception:
            log.exception("batcher.release_failed", num_items=len(items))
        for item in items:
            try:
                self._release([item])
            except Exception as error:
                self._report(item, error)

    def _report(self, item: Any, error: BaseException) -> None:
        if self._on_error is None:
            log.error("batcher.item_failed", error=repr(error))
            return
        try:
            self._on_error(item, error)
        except Exception:
            log.exception("batcher.on_error_failed")

    async def run(self) -> None:
        while True:
            try:
                timeout_s = self.flush_due()
            except Exception as error:  # a bug in ordering: fail what is pending, keep serving
                log.exception("batcher.flush_failed")
                for item in self.drain():
                    self._report(item, error)
                timeout_s = None
            self._wakeup.clear()
            if timeout_s is None:
                await self._wakeup.wait()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout_s)

    def flush_due(self) -> float | None:
        """Release a batch if a window closed and the engine has room. Returns how long to wait
        before looking again (None: until woken)."""
        if not self._pending:
            return None
        wait_s = min(p.due_s for p in self._pending) - self._clock()
        if wait_s > 0:
            return wait_s
        released, self._pending = select_batch(
            self._pending, self._settings.max_batch_tokens, self._queued_tokens
        )
        if released:
            self._release_isolated([p.item for p in released])
        # Whatever is left waits for the engine to start something (the bridge wakes us), unless
        # nothing reached the engine (all released items expired): then look again at once.
        return 0.0 if self._pending and self._queued_tokens(LEAST_URGENT) == 0 else None


def _unconnected(items: list[Any]) -> None:
    raise RuntimeError("the batcher released a batch before it was connected")
