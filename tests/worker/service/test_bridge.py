"""The engine thread: requests in, deltas out in engine order, aborts, rejections, failures."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.outputs import RequestDelta
from engine.sampling_params import SamplingParams
from worker.service.bridge import (
    Aborted,
    Deltas,
    Dropped,
    EngineBridge,
    EngineRequest,
    Failed,
    Rejected,
    Restarted,
)


class CountingEngine:
    """Stands in for LLMEngine's API: one token per step per request, text "<n>"."""

    model_path = "/models/counting"
    max_model_len = 64

    def __init__(self, fail_at_step: int | None = None) -> None:
        self.thread_ids: set[int] = set()  # threads that called into the engine
        self.requests: dict[str, list] = {}
        self.num_steps = 0
        self.fail_at_step = fail_at_step

    def add_request(self, request_id, prompt, params, priority=0) -> None:
        self.thread_ids.add(threading.get_ident())
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self.requests[request_id] = [params.max_tokens, 0]

    def abort_request(self, request_id) -> bool:
        self.thread_ids.add(threading.get_ident())
        return self.requests.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestDelta]:
        self.thread_ids.add(threading.get_ident())
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise RuntimeError("boom")
        deltas = []
        for request_id, state in list(self.requests.items()):
            state[1] += 1
            is_done = state[1] >= state[0]
            deltas.append(
                RequestDelta(
                    request_id,
                    f"<{state[1]}>",
                    [state[1]],
                    is_done,
                    "length" if is_done else None,
                    1,
                    state[1],
                )
            )
            if is_done:
                del self.requests[request_id]
        return deltas


class Recorder:
    """Reads the bridge's events as the pipeline does, keeping them as tuples."""

    def __init__(self, bridge: EngineBridge) -> None:
        self.bridge = bridge
        self.events: list[tuple] = []

    def _drain(self) -> None:
        while not self.bridge.events.empty():
            match self.bridge.events.get_nowait():
                case Deltas(deltas):
                    self.events += [("delta", d.request_id, d.text, d.finished) for d in deltas]
                case Rejected(request_id, message):
                    self.events.append(("rejected", request_id, message))
                case Aborted(request_id):
                    self.events.append(("aborted", request_id))
                case Failed(request_ids, message):
                    self.events.append(("failed", tuple(request_ids), message))
                case Restarted(request_ids):
                    self.events.append(("restarted", tuple(request_ids)))
                case Dropped(request_ids, message):
                    self.events.append(("dropped", tuple(sorted(request_ids)), message))

    async def wait_for(self, predicate, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while True:
                self._drain()
                if predicate(self.events):
                    return
                await asyncio.sleep(0.005)


def request(request_id: str, max_tokens: int = 3, num_tokens: int = 5) -> EngineRequest:
    return EngineRequest(
        request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens), 2, num_tokens
    )


async def start(engine, **options) -> tuple[EngineBridge, Recorder]:
    bridge = EngineBridge(lambda: engine, **options)
    info = await bridge.start()
    assert info.model_path == "/models/counting" and info.max_model_len == 64
    return bridge, Recorder(bridge)


async def test_deltas_come_back_in_order_and_queued_tokens_drain() -> None:
    engine = CountingEngine()
    bridge, recorder = await start(engine)
    bridge.submit([request("a", 3, 10), request("b", 2, 7)])
    assert bridge.queued_tokens == 17
    await recorder.wait_for(lambda ev: sum(1 for e in ev if e[0] == "delta" and e[3]) == 2)
    texts = {rid: "".join(e[2] for e in recorder.events if e[1] == rid) for rid in "ab"}
    assert texts == {"a": "<1><2><3>", "b": "<1><2>"}
    assert bridge.queued_tokens == 0
    await bridge.stop()
    assert len(engine.thread_ids) == 1 and threading.get_ident() not in engine.thread_ids


async def test_rejection_abort_and_step_failure_are_reported() -> None:
    engine = CountingEngine(fail_at_step=3)
    bridge, recorder = await start(engine)
    bridge.submit([request("long", max_tokens=1000)])
    bridge.submit([request("long", max_tokens=5)])  # duplicate id: the engine's ValueError
    await recorder.wait_for(lambda ev: any(e[0] == "rejected" for e in ev))
    await recorder.wait_for(lambda ev: any(e[0] == "failed" for e in ev))
    failed = next(e for e in recorder.events if e[0] == "failed")
    assert failed[1] == ("long",) and "boom" in failed[2]
    bridge.submit([request("next", max_tokens=1000)])  # the engine keeps serving after a failure
    await recorder.wait_for(lambda ev: any(e[0] == "delta" and e[1] == "next" for e in ev))
    bridge.abort("next")
    await recorder.wait_for(lambda ev: ("aborted", "next") in ev)
    await bridge.stop()
    assert engine.requests == {}


async def test_a_failing_factory_fails_start() -> None:
    def factory():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        await EngineBridge(factory).start()


class PoisonedEngine(CountingEngine):
    """Every step fails while a request called "poison*" is in it (or always, if `always`)."""

    def __init__(self, always: bool = False) -> None:
        super().__init__()
        self.always = always

    def step(self):
        if self.always or any(rid.startswith("poison") for rid in self.requests):
            self.num_steps += 1
            raise RuntimeError("boom")
        return super().step()


def finished_ids(events) -> set[str]:
    return {e[1] for e in events if e[0] == "delta" and e[3]}


async def test_a_failing_step_fails_only_the_request_it_is_pinned_on() -> None:
    """Guards against one bad request (or one transient fault) failing every live request for
    good: the culprit is isolated by bisection; the others finish normally."""
    engine = PoisonedEngine()
    bridge, recorder = await start(engine)
    innocents = [f"r{i}" for i in range(6)]
    bridge.submit([request(i, max_tokens=4) for i in innocents[:3]])
    bridge.submit([request("poison", max_tokens=4)])
    bridge.submit([request(i, max_tokens=4) for i in innocents[3:]])
    await recorder.wait_for(
        lambda ev: finished_ids(ev) == set(innocents) and any(e[0] == "failed" for e in ev)
    )
    failed = [e for e in recorder.events if e[0] == "failed"]
    assert [e[1] for e in failed] == [("poison",)] and "boom" in failed[0][2]
    assert any(e[0] == "restarted" for e in recorder.events)
    # Each innocent's last run is whole: after its last restart it streams <1>..<4> again.
    for rid in innocents:
        last = max(
            (n for n, e in enumerate(recorder.events) if e[0] == "restarted" and rid in e[1]),
            default=-1,
        )
        texts = [e[2] for e in recorder.events[last + 1 :] if e[0] == "delta" and e[1] == rid]
        assert "".join(texts) == "<1><2><3><4>", rid
    bridge.submit([request("after", max_tokens=2)])  # and the engine serves on
    await recorder.wait_for(lambda ev: "after" in finished_ids(ev))
    await bridge.stop()
    assert not bridge.crashed.done()


async def test_a_culprit_that_is_the_oldest_of_many_is_pinned_without_exiting() -> None:
    """Guards against bisection exiting the worker for one bad request: with 128 or more live
    and the culprit the oldest, its half fails every time, log2(k) + 1 steps in a row, which
    exceeded `max_consecutive_step_failures` (8)."""
    engine = PoisonedEngine()
    bridge, recorder = await start(engine)
    innocents = [f"r{i}" for i in range(160)]
    bridge.submit([request("poison", max_tokens=2), *(request(i, max_tokens=2) for i in innocents)])
    await recorder.wait_for(
        lambda ev: finished_ids(ev) == set(innocents) and any(e[0] == "failed" for e in ev), 60
    )
    assert [e[1] for e in recorder.events if e[0] == "failed"] == [("poison",)]
    assert not bridge.crashed.done()
    await bridge.stop()


async def test_steps_failing_in_a_row_crash_the_bridge_and_answer_nothing() -> None:
    """Guards against a persistent engine fault turning the whole topic into committed error
    finals: after N failed steps in a row the bridge gives up, drops what it holds (no final,
    so it is redelivered) and reports the crash so that the worker exits non-zero."""
    engine = PoisonedEngine(always=True)
    bridge, recorder = await start(engine, max_consecutive_step_failures=3)
    ids = [f"r{i}" for i in range(8)]
    bridge.submit([request(i, max_tokens=4) for i in ids])
    error = await asyncio.wait_for(bridge.crashed, 10)
    # 3 in a row, plus the 3 a bisection of 8 suspects may need (so no request is failed for
    # a fault that is not its own: the two it pinned meanwhile are dropped with the rest).
    assert "6 engine steps failed in a row" in str(error)
    await recorder.wait_for(lambda ev: any(e[0] == "dropped" for e in ev))
    (dropped,) = [e for e in recorder.events if e[0] == "dropped"]
    assert dropped[1] == tuple(sorted(ids))
    assert not [e for e in recorder.events if e[0] in ("failed", "delta")]
    await bridge.stop()


class GatedEngine(CountingEngine):
    """Each step waits for the test to open its gate: "the engine is inside a long step" is a
    fact the test holds, not a timing."""

    def __init__(self) -> None:
        super().__init__()
        self.in_step = threading.Event()
        self.gate = threading.Event()

    def step(self) -> list[RequestDelta]:
        self.in_step.set()
        assert self.gate.wait(10.0), "the test never opened the gate"
        self.gate.clear()
        self.in_step.clear()
        return super().step()


async def test_engine_queue_time_counts_the_wait_for_the_step_that_was_running() -> None:
    """The engine thread takes new requests only between steps. A request submitted while a
    long step runs waits for it, and its engine queue time (the final's `engine_queue_ms`)
    must show that wait: it once started at the engine's add_request, after the step, and a
    critical request's 10 s wait behind a bulk prefill showed up nowhere in the split."""
    engine = GatedEngine()
    bridge = EngineBridge(lambda: engine)
    await bridge.start()
    bridge.submit([request("bulk", max_tokens=2)])
    assert await asyncio.to_thread(engine.in_step.wait, 10.0)  # the bulk step is running
    submitted_s = time.monotonic()
    bridge.submit([request("urgent", max_tokens=1)])
    await asyncio.sleep(0.05)  # the step goes on: "urgent" waits in the inbox
    released_s = time.monotonic()
    engine.gate.set()  # step 1 (bulk) ends; "urgent" is added before step 2
    queue_s = None
    async with asyncio.timeout(10.0):
        while queue_s is None:
            if engine.in_step.is_set():
                engine.gate.set()
            try:
                event = await asyncio.wait_for(bridge.events.get(), 0.01)
            except TimeoutError:
                continue
            if isinstance(event, Deltas) and "urgent" in event.step.first_token_times:
                queue_s = event.step.first_token_times["urgent"][0]
    engine.gate.set()
    await bridge.stop()
    assert queue_s >= released_s - submitted_s


class GatedPoisonedEngine(PoisonedEngine):
    """PoisonedEngine whose "slow*" requests generate until `release` is set: while the gate
    is shut, a suspect group holding them is still running, as a fact."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def step(self):
        if self.release.is_set():
            for request_id, state in self.requests.items():
                if request_id.startswith("slow"):
                    state[0] = min(state[0], state[1] + 1)  # finishes at this step
        return super().step()


def urgent_request(request_id: str, priority: int, max_tokens: int = 3) -> EngineRequest:
    return EngineRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens), priority, 5)


def deltas_after_last_restart(events, request_id: str) -> list[tuple]:
    last = max(
        (n for n, e in enumerate(events) if e[0] == "restarted" and request_id in e[1]), default=-1
    )
    return [e for e in events[last + 1 :] if e[0] == "delta" and e[1] == request_id]


async def test_urgent_requests_do_not_wait_for_the_suspects_runs() -> None:
    """Guards against critical work held while a bisection runs its suspect groups one at a
    time (each for as long as its requests generate): critical and high requests join the
    running group at once; normal ones still wait for the suspects to be cleared."""
    engine = GatedPoisonedEngine()
    bridge, recorder = await start(engine)
    never = 10**9  # the slow ones finish when the gate opens, not before
    bridge.submit([request("slow1", never), request("slow2", never), request("r3", 2)])
    bridge.submit([request("poison", 2)])
    # The failed step splits the four: [slow1, slow2] run first, [r3, poison] wait.
    await recorder.wait_for(
        lambda ev: any(e[0] == "restarted" for e in ev) and deltas_after_last_restart(ev, "slow1")
    )
    bridge.submit([urgent_request("crit", 0), urgent_request("high", 1)])
    bridge.submit([urgent_request("norm", 2)])
    await recorder.wait_for(lambda ev: {"crit", "high"} <= finished_ids(ev))
    events = list(recorder.events)
    assert not [e for e in events if e[0] == "delta" and e[1] == "norm"]  # held back
    assert not deltas_after_last_restart(events, "r3")  # the next suspect group waits
    assert not [e for e in events if e[0] == "failed"]
    engine.release.set()
    everyone = {"slow1", "slow2", "r3", "crit", "high", "norm"}
    await recorder.wait_for(
        lambda ev: finished_ids(ev) >= everyone and any(e[0] == "failed" for e in ev)
    )
    assert [e[1] for e in recorder.events if e[0] == "failed"] == [("poison",)]
    await bridge.stop()
    assert not bridge.crashed.done()


class UrgentAtEveryRunEngine(PoisonedEngine):
    """PoisonedEngine in which each time "poison" is added (it starts a run), an urgent
    request arrives at once: as if critical traffic never let up during a bisection."""

    def __init__(self) -> None:
        super().__init__()
        self.bridge: EngineBridge | None = None
        self.urgent_ids: list[str] = []

    def add_request(self, request_id, prompt, params, priority=0) -> None:
        super().add_request(request_id, prompt, params, priority)
        if request_id == "poison" and len(self.urgent_ids) < 30:
            self.urgent_ids.append(f"u{len(self.urgent_ids)}")
            # Straight into the inbox (this is the engine thread): read before the next step.
            self.bridge._inbox.put(urgent_request(self.urgent_ids[-1], 0, max_tokens=2))


async def test_urgent_joiners_still_let_the_culprit_be_pinned() -> None:
    """Guards against urgent requests joining every suspect run, so that the culprit is never
    alone and its group fails step after step until the worker exits: a lone suspect runs
    alone, the culprit is pinned, every other request finishes."""
    engine = UrgentAtEveryRunEngine()
    bridge, recorder = await start(engine, max_consecutive_step_failures=3)
    engine.bridge = bridge
    innocents = [f"r{i}" for i in range(7)]
    bridge.submit([request(i, max_tokens=4) for i in innocents] + [request("poison", 4)])
    await recorder.wait_for(
        lambda ev: (
            any(e[0] == "failed" for e in ev)
            and finished_ids(ev) >= set(innocents) | set(engine.urgent_ids)
        )
    )
    assert [e[1] for e in recorder.events if e[0] == "failed"] == [("poison",)]
    assert len(engine.urgent_ids) >= 3  # one arrived at each of the culprit's runs
    await bridge.stop()
    assert not bridge.crashed.done()
