"""The runner's logic without Kafka: a fake client in place of the SDK. Concurrency cap, the
arrival schedule, cancels, error finals and timeouts."""

from __future__ import annotations

import asyncio

import pytest

from loadtest.loadgen import RequestSpec, RunOptions, run_load, run_one
from loadtest.loadgen_stats import arrival_gaps_s, arrival_offsets_s
from schemas.messages import ErrorInfo, FinalReply, Timing, Usage
from worker.client import RequestFailedError, RequestTimeoutError
from worker.client.assembler import Delta


def final(finish_reason: str = "length", tokens: int = 3, **fields) -> FinalReply:
    return FinalReply(
        id="r", attempt="w:0", seq=tokens, finish_reason=finish_reason,
        usage=Usage(prompt_tokens=7, completion_tokens=tokens),
        timing=Timing(queued_ms=1.0, ttft_ms=2.0, total_ms=3.0), **fields,
    )  # fmt: skip


class FakeClient:
    """Streams `tokens` one-token deltas, `step_s` apart, then the final (or raises `error`)."""

    def __init__(self, tokens: int = 3, step_s: float = 0.01, error: Exception | None = None):
        self.tokens = tokens
        self.step_s = step_s
        self.error = error
        self.in_flight = 0
        self.max_in_flight = 0
        self.sent: list[tuple[float, str]] = []  # (loop time, urgency)
        self.num_closed_early = 0

    async def stream(self, prompt=None, *, urgency, timeout_s, **fields):
        self.sent.append((asyncio.get_running_loop().time(), urgency))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        is_done = False
        try:
            for i in range(self.tokens):
                await asyncio.sleep(self.step_s)
                yield Delta(text=f"t{i}", token_ids=[i])
            if self.error is not None:
                raise self.error
            is_done = True
            yield Delta(text="", final=final(tokens=self.tokens))
        finally:
            self.in_flight -= 1
            if not is_done and self.error is None:
                self.num_closed_early += 1


def spec(urgency: str = "normal", cancel_after: int | None = None) -> RequestSpec:
    return RequestSpec("a prompt", None, 2, 3, urgency, cancel_after)


async def test_served_request_takes_the_finals_counts_and_timing() -> None:
    result = await run_one(FakeClient(tokens=3), spec("critical"), RunOptions())
    assert result.finish_reason == "length" and result.is_served
    assert (result.prompt_len, result.output_len) == (7, 3)  # the worker's usage wins
    assert len(result.chunk_times_s) == 3 and result.chunk_times_s == sorted(result.chunk_times_s)
    assert result.e2el_s >= result.chunk_times_s[-1] >= result.ttft_s > 0
    assert result.worker_timing == {"queued_ms": 1.0, "ttft_ms": 2.0, "total_ms": 3.0}


async def test_cancel_closes_the_stream_after_half_the_tokens() -> None:
    client = FakeClient(tokens=4)
    result = await run_one(client, spec(cancel_after=2), RunOptions())
    assert result.finish_reason == "cancelled" and not result.is_served
    assert result.output_len == 2 and client.num_closed_early == 1 and client.in_flight == 0


async def test_error_final_and_timeout_are_recorded_not_raised() -> None:
    error_final = final("error", tokens=0, error=ErrorInfo(code="limit_exceeded", message="x"))
    failed = await run_one(
        FakeClient(tokens=0, error=RequestFailedError("limit_exceeded", "x", error_final)),
        spec(),
        RunOptions(),
    )
    assert failed.finish_reason == "error" and "limit_exceeded" in failed.error
    timed_out = await run_one(
        FakeClient(tokens=1, error=RequestTimeoutError("late")), spec(), RunOptions()
    )
    assert timed_out.finish_reason is None and "late" in timed_out.error
    assert not failed.is_served and not timed_out.is_served


async def test_max_concurrency_caps_requests_in_flight() -> None:
    client = FakeClient(tokens=3, step_s=0.01)
    options = RunOptions(max_concurrency=2, show_progress=False)
    results, duration_s = await run_load(client, [spec() for _ in range(6)], options)
    assert client.max_in_flight == 2
    assert all(r.is_served for r in results) and duration_s > 0


async def test_open_loop_sends_on_the_arrival_schedule() -> None:
    """At a finite rate the sends follow the gamma schedule, whatever the answers take."""
    client = FakeClient(tokens=1, step_s=0.2)  # answers slower than the arrivals
    options = RunOptions(request_rate=50.0, burstiness=1.0, seed=3, show_progress=False)
    specs = [spec(u) for u in ("critical", "low", "normal", "low")]
    before_s = asyncio.get_running_loop().time()  # the schedule starts after this
    results, _ = await run_load(client, specs, options)
    offsets = arrival_offsets_s(arrival_gaps_s(4, 50.0, 1.0, seed=3))
    for (sent_s, _), offset_s in zip(client.sent, offsets, strict=True):
        # Never early; the sleep may only be late. Measured from before the run, not from the
        # first send: a first send that a busy machine made late would make an on-time second
        # one look early.
        assert sent_s - before_s >= offset_s - 1e-3
    assert client.max_in_flight > 1  # open loop: it did not wait for answers
    assert [r.urgency for r in results] == ["critical", "low", "normal", "low"]
    assert sum(r.output_len for r in results) == 4


@pytest.mark.parametrize("max_concurrency", [None, 1])
async def test_every_request_gets_a_result_in_spec_order(max_concurrency) -> None:
    client = FakeClient(tokens=2, step_s=0.05)
    specs = [spec(u) for u in ("low", "critical", "normal")]
    options = RunOptions(max_concurrency=max_concurrency, show_progress=False)
    results, _ = await run_load(client, specs, options)
    assert [r.urgency for r in results] == ["low", "critical", "normal"]
    assert client.max_in_flight == (1 if max_concurrency == 1 else 3)
