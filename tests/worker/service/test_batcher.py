"""Batch order (urgency, then deadline, then arrival), the token budget, and the windows."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.headers import Urgency
from worker.service.batcher import Batcher, PendingItem, select_batch
from worker.service.settings import BatcherSettings

items = st.builds(
    PendingItem,
    item=st.none(),
    urgency=st.sampled_from(list(Urgency)),
    deadline_ms=st.none() | st.integers(0, 10),
    arrival_seq=st.integers(0, 10_000),
    num_tokens=st.integers(1, 500),
)


@given(
    st.lists(items, max_size=30, unique_by=lambda p: p.arrival_seq),
    st.integers(1, 3000),
    st.dictionaries(st.sampled_from(list(Urgency)), st.integers(0, 2000)),
)
def test_select_batch_orders_and_respects_the_budget(pending, max_tokens, queued_by_urgency) -> None:
    def queued_tokens(priority: int) -> int:
        return sum(n for u, n in queued_by_urgency.items() if u.priority <= priority)

    released, kept = select_batch(pending, max_tokens, queued_tokens)
    assert sorted(map(id, released + kept)) == sorted(map(id, pending))
    order = released + kept
    keys = [
        (
            p.urgency.priority,
            p.deadline_ms if p.deadline_ms is not None else float("inf"),
            p.arrival_seq,
        )
        for p in order
    ]
    assert keys == sorted(keys)  # urgency first, then deadline (none = last), then arrival
    if pending and queued_tokens(order[0].urgency.priority) == 0:
        assert released  # an idle engine always gets the head: a long prompt is never starved
    for n, p in enumerate(released):  # within its urgency's budget, unless it went alone
        used = queued_tokens(p.urgency.priority) + sum(r.num_tokens for r in released[: n + 1])
        assert used <= max_tokens or (n == 0 and queued_tokens(p.urgency.priority) == 0)
    if kept:  # strictly in order: the first kept one did not fit
        head = kept[0]
        used = sum(p.num_tokens for p in released) + head.num_tokens
        assert queued_tokens(head.urgency.priority) + used > max_tokens


def test_a_long_head_goes_alone() -> None:
    big = PendingItem("big", Urgency.CRITICAL, None, 0, 5000)
    small = PendingItem("small", Urgency.LOW, None, 1, 10)
    released, kept = select_batch([small, big], 100)
    assert [p.item for p in released] == ["big"] and [p.item for p in kept] == ["small"]


def test_urgent_work_is_not_held_back_by_less_urgent_queued_work() -> None:
    """Guards against a saturated worker holding a critical request until low work finishes:
    only queued work at least as urgent counts against an item's budget."""
    queued = {Urgency.LOW.priority: 2000}  # the engine's queue is full of low prompts

    def queued_tokens(priority: int) -> int:
        return sum(n for p, n in queued.items() if p <= priority)

    pending = [
        PendingItem("low", Urgency.LOW, None, 0, 10),
        PendingItem("crit", Urgency.CRITICAL, None, 1, 10),
        PendingItem("high", Urgency.HIGH, None, 2, 10),
    ]
    released, kept = select_batch(pending, 100, queued_tokens)
    assert [p.item for p in released] == ["crit", "high"] and [p.item for p in kept] == ["low"]


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make_batcher(queued_tokens=lambda priority: 0, **settings):
    clock = FakeClock()
    batches: list[list[str]] = []
    batcher = Batcher(BatcherSettings(**settings), batches.append, queued_tokens, clock)
    return batcher, batches, clock


async def test_windows_by_urgency_and_release_order() -> None:
    batcher, batches, clock = make_batcher(low_window_ms=50, normal_window_ms=10)
    batcher.submit("low-1", Urgency.LOW, None, 10)
    assert batcher.flush_due() == pytest.approx(0.05)  # nothing due: wait for the low window
    assert batches == []
    batcher.submit("normal-1", Urgency.NORMAL, None, 10)
    assert batcher.flush_due() == pytest.approx(0.01)
    clock.now_s += 0.01  # the normal window closed: everything pending goes, most urgent first
    batcher.flush_due()
    assert batches == [["normal-1", "low-1"]]


async def test_critical_flushes_at_once_ahead_of_a_waiting_backlog() -> None:
    batcher, batches, _ = make_batcher()
    for i in range(3):
        batcher.submit(f"low-{i}", Urgency.LOW, None, 10)
    batcher.submit("crit", Urgency.CRITICAL, None, 10)
    batcher.flush_due()
    assert batches == [["crit", "low-0", "low-1", "low-2"]]


async def test_deadline_orders_within_an_urgency() -> None:
    batcher, batches, clock = make_batcher()
    batcher.submit("late", Urgency.HIGH, 9_000, 1)
    batcher.submit("none", Urgency.HIGH, None, 1)
    batcher.submit("soon", Urgency.HIGH, 1_000, 1)
    clock.now_s += 1
    batcher.flush_due()
    assert batches == [["soon", "late", "none"]]


async def test_budget_counts_tokens_the_engine_has_not_started() -> None:
    queued = {"tokens": 0}
    batcher, batches, clock = make_batcher(lambda priority: queued["tokens"], max_batch_tokens=100)
    for i in range(4):
        batcher.submit(f"r{i}", Urgency.CRITICAL, None, 40)
    batcher.flush_due()
    assert batches == [["r0", "r1"]]  # 80 tokens; a third would make 120
    queued["tokens"] = 80  # the engine has not started them yet: 20 tokens of room, r2 needs 40
    assert batcher.flush_due() is None  # wait to be woken
    assert len(batches) == 1
    queued["tokens"] = 0
    batcher.flush_due()
    assert batches[-1] == ["r2", "r3"]


async def test_run_releases_and_remove_takes_pending_items_out() -> None:
    batcher, batches, _ = make_batcher()
    task = asyncio.create_task(batcher.run())
    try:
        batcher.submit("keep", Urgency.LOW, None, 1)
        batcher.submit("gone", Urgency.LOW, None, 1)
        assert batcher.remove(lambda item: item == "gone") == ["gone"]
        batcher.submit("now", Urgency.CRITICAL, None, 1)
        for _ in range(100):
            if batches:
                break
            await asyncio.sleep(0.01)
        assert batches == [["now", "keep"]]
        assert batcher.drain() == []
    finally:
        task.cancel()


async def test_a_release_that_raises_for_one_item_loses_only_that_item() -> None:
    """Guards against one bad request in a release batch killing the batcher task (and the
    worker) or taking its batch neighbours down with it."""
    clock, released, failed = FakeClock(), [], []

    def release(batch: list[str]) -> None:
        if "bad" in batch:
            raise OverflowError("int too large")
        released.extend(batch)

    batcher = Batcher(
        BatcherSettings(), release, clock=clock, on_error=lambda item, e: failed.append(item)
    )
    task = asyncio.create_task(batcher.run())
    try:
        for name in ("a", "bad", "b"):
            batcher.submit(name, Urgency.CRITICAL, None, 1)
        for _ in range(100):
            if len(released) == 2:
                break
            await asyncio.sleep(0.01)
        assert released == ["a", "b"] and failed == ["bad"]
        batcher.submit("later", Urgency.CRITICAL, None, 1)
        for _ in range(100):
            if "later" in released:
                break
            await asyncio.sleep(0.01)
        assert released == ["a", "b", "later"] and not task.done()
    finally:
        task.cancel()


def test_a_huge_deadline_cannot_break_ordering() -> None:
    """Guards against a deadline too large for a float raising while batches are ordered."""
    pending = [
        PendingItem("huge", Urgency.NORMAL, 10**400, 0, 1),
        PendingItem("soon", Urgency.NORMAL, 5, 1, 1),
    ]
    released, _ = select_batch(pending, 100)
    assert [p.item for p in released] == ["soon", "huge"]
