"""The engine on its own thread, talking to the event loop through queues.

A forward pass takes milliseconds to seconds; on the event loop it would stall polling,
heartbeats (a stalled member is thrown out of the group) and publishing. So the engine lives on
one dedicated thread (it is single-threaded by contract: it is built, stepped and aborted there
and nowhere else). Commands go in through a `queue.Queue`; results come back as typed events
(`Deltas`, `Rejected`, `Aborted`, `Failed`) on an `asyncio.Queue`, in the order the engine
produced them, for one reader on the event loop (the pipeline). If the thread dies, `crashed`
(a future) says why.

The bridge also counts prompt tokens handed over but not yet started (no first delta): the
batcher's budget is measured against it.

A step that raises cannot say which request broke it, and failing every live request for it
(as this once did) turned one bad request, or one transient fault, into error finals for
everyone, committed for good. Instead the bridge bisects:
- every live request is aborted and becomes a suspect; a lone suspect is the culprit and gets
  `Failed` (an error final);
- otherwise the suspects are split in two groups, and groups run one at a time: a group that
  completes is innocent; a group that fails again is split again, down to the one request it
  can be pinned on. New requests are held back meanwhile, except urgent ones (critical, high):
  a suspect group runs for as long as its requests generate, and urgent work must not wait for
  that, so it joins the running group at once. A joiner that is in a step that fails is a
  suspect like the others (it was there). A lone suspect runs alone (urgent work waits for it):
  that run is what pins it, and joiners arriving at every run could keep it from ever being
  alone, failing step after step until the limit below exits the worker. A suspect that already
  streamed tokens starts over (`Restarted`: the pipeline opens a new attempt for it, as on a
  redelivery, so the client's seq/attempt rule applies). Pinning one culprit among k takes about
  log2(k) + 1 failed steps.
- after `max_consecutive_step_failures` failed steps in a row, plus the log2(k) a bisection of k
  suspects needs (k grows if joiners make a failing group larger; a culprit that is the oldest
  of 128 fails 8 steps in a row while it is pinned: a limit without that room exited the
  worker for one bad request), the fault is not one request's: the thread gives up, live
  requests are `Dropped` (no final: their offsets stay uncommitted and are redelivered), and
  `crashed` fails the worker, which exits non-zero. A pinned culprit's `Failed` waits until the
  fault is seen not to recur (a step succeeds, or the engine falls idle), so a persistent fault
  drops the pinned request with the rest.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import math
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from engine.errors import PromptTooLongError
from engine.outputs import EngineStats, RequestDelta
from engine.sampling_params import SamplingParams
from schemas.headers import Urgency

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EngineRequest:
    request_id: str  # the engine's id: the attempt, unique even when a request id repeats
    prompt: str | list[int]
    params: SamplingParams
    priority: int  # lower runs first: the urgency's priority
    num_prompt_tokens: int  # for the batcher's budget (with n > 1: pipeline.prefill_tokens)
    # Monotonic, stamped by `submit`: the engine queue time starts here, not when the engine
    # thread takes the request from its inbox (between steps, so possibly a long step later).
    submitted_s: float | None = None


@dataclass(frozen=True)
class EngineInfo:
    model_path: str
    max_model_len: int
    stats: EngineStats | None = None  # at start (KV blocks known): gauges of an idle worker


@dataclass(frozen=True)
class StepInfo:
    """One engine step, for metrics: when it ran and the engine's state after it."""

    started_s: float  # monotonic
    duration_s: float
    stats: EngineStats | None
    # Requests whose first token came from this step: (engine queue s, prefill s). The queue is
    # from `submit` to the start of this step: the wait in the engine thread's inbox for the step
    # it was running (the engine takes new requests between steps), the engine's waiting queue,
    # and for a prompt prefilled in several chunks the earlier chunks' steps.
    first_token_times: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Deltas:
    deltas: list[RequestDelta]
    step: StepInfo | None = None


@dataclass(frozen=True)
class Rejected:
    """`add_request` refused the request (the engine's ValueError): an invalid request."""

    request_id: str
    message: str
    is_prompt_too_long: bool = False


@dataclass(frozen=True)
class Aborted:
    request_id: str  # the abort is done (or the request had already left)


@dataclass(frozen=True)
class Failed:
    request_ids: list[str]  # a step or an add raised: these requests are gone from the engine
    message: str


@dataclass(frozen=True)
class Dropped:
    """Given up without a final (the engine can no longer serve): redelivered elsewhere."""

    request_ids: list[str]
    message: str


@dataclass(frozen=True)
class Restarted:
    """Re-run from the start after a failed step (bisection): earlier deltas are void."""

    request_ids: list[str]


EngineEvent = Deltas | Rejected | Aborted | Failed | Dropped | Restarted


class StepFailuresExceeded(RuntimeError):
    """The engine failed step after step: not one request's fault."""


class _Stop:
    pass


@dataclass(frozen=True)
class _Abort:
    request_id: str


class EngineBridge:
    def __init__(
        self,
        engine_factory: Callable[[], Any],
        max_consecutive_step_failures: int = 8,
        max_urgent_priority: int = Urgency.HIGH.priority,
    ) -> None:
        self._engine_factory = engine_factory
        self._max_consecutive_step_failures = max_consecutive_step_failures
        # Requests with priority value <= this join a running suspect group (see the docstring).
        self._max_urgent_priority = max_urgent_priority
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Not started yet: request id -> (priority, prompt tokens).
        self._queued_tokens: dict[str, tuple[int, int]] = {}
        self.events: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self.crashed: asyncio.Future[BaseException] | None = None  # set if the thread dies
        # Written by the engine thread, read by liveness probes (float/bool writes are atomic).
        self._has_work = False
        self._progress_s = time.monotonic()  # the last finished step, or when work arrived
        self._added_s: dict[str, float] = {}  # engine thread only: added, no token yet
        # The engine's step cost model (engine/step_cost.py) when it sizes steps by urgency:
        # admission reads it to tell a deadline that cannot be met. Its floats are written by
        # the engine thread; a read sees a recent enough value.
        self.step_cost = None

    @property
    def queued_tokens(self) -> int:
        return sum(n for _, n in self._queued_tokens.values())

    def queued_tokens_at_least_as_urgent_as(self, priority: int) -> int:
        """Prompt tokens not started yet of requests with priority value <= `priority`."""
        return sum(n for p, n in self._queued_tokens.values() if p <= priority)

    async def start(self) -> EngineInfo:
        """Build the engine on its thread (loading the model takes seconds) and wait for it."""
        self._loop = asyncio.get_running_loop()
        self.crashed = self._loop.create_future()
        ready: asyncio.Future[EngineInfo] = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="engine", daemon=True)
        self._thread.start()
        return await ready

    def submit(self, requests: list[EngineRequest]) -> None:
        now_s = time.monotonic()
        for request in requests:
            self._queued_tokens[request.request_id] = (
                request.priority,
                request.num_prompt_tokens,
            )
            self._inbox.put(dataclasses.replace(request, submitted_s=now_s))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def is_alive(self, stall_s: float) -> bool:
        """The engine thread runs and, if it has work, finished a step in the last `stall_s`."""
        if self._thread is None or not self._thread.is_alive():
            return False
        return not self._has_work or time.monotonic() - self._progress_s < stall_s

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._inbox.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    # --- event loop side -------------------------------------------------------------------

    def _post(self, event: EngineEvent) -> None:
        self._loop.call_soon_threadsafe(self._deliver, event)

    def _deliver(self, event: EngineEvent) -> None:
        match event:
            case Deltas(deltas):
                ids = [d.request_id for d in deltas]
            case Failed(request_ids) | Dropped(request_ids):
                ids = request_ids
            case Rejected(request_id) | Aborted(request_id):
                ids = [request_id]
            case Restarted():
                ids = []
        for request_id in ids:
            self._queued_tokens.pop(request_id, None)
        self.events.put_nowait(event)

    # --- engine thread ---------------------------------------------------------------------

    def _run(self, ready: asyncio.Future) -> None:
        # The OS name shows in `top -H` and /proc (the e2e benchmark splits CPU time by it);
        # the OpenMP threads the engine starts from here inherit it.
        set_os_thread_name("engine")
        try:
            engine = self._engine_factory()
            info = EngineInfo(
                model_path=str(engine.model_path),
                max_model_len=int(engine.max_model_len),
                stats=engine.get_stats() if hasattr(engine, "get_stats") else None,
            )
            self.step_cost = getattr(getattr(engine, "scheduler", None), "cost_model", None)
        except BaseException as error:  # handed to the awaiting coroutine
            self._loop.call_soon_threadsafe(_set_exception, ready, error)
            return
        self._loop.call_soon_threadsafe(_set_result, ready, info)
        state = _ThreadState()
        try:
            self._serve(engine, state)
        except BaseException as error:  # a bug or a persistent fault: say so loudly
            log.exception("engine.thread_crashed")
            # No finals: what was live is redelivered to a worker whose engine works.
            self._post(Dropped(sorted(state.all_ids()), f"the engine failed: {error!r}"))
            self._loop.call_soon_threadsafe(_set_result, self.crashed, error)

    def _serve(self, engine, state: _ThreadState) -> None:
        while True:
            # Block only when idle; while generating, take what arrived and step again.
            is_idle = not engine.has_unfinished_requests() and not state.is_isolating
            command = _get_queue_item(self._inbox, block=is_idle)
            if command is not None and not self._handle_commands(engine, command, state):
                return
            has_work = engine.has_unfinished_requests()
            if has_work and not self._has_work:
                self._progress_s = time.monotonic()  # a stall is counted from here
            self._has_work = has_work
            if has_work:
                self._step(engine, state)
                self._progress_s = time.monotonic()
            self._admit_next(engine, state)
            if state.pinned and not engine.has_unfinished_requests() and not state.is_isolating:
                self._confirm_pinned(state)  # nothing else ran into the fault

    def _handle_commands(self, engine, first, state: _ThreadState) -> bool:
        command = first
        while True:
            if isinstance(command, _Stop):
                for request_id in list(state.live):
                    engine.abort_request(request_id)
                return False
            if isinstance(command, _Abort):
                engine.abort_request(command.request_id)
                state.forget(command.request_id)
                self._added_s.pop(command.request_id, None)
                self._post(Aborted(command.request_id))
            elif isinstance(command, EngineRequest):
                if state.is_isolating and not self._may_join(command, state):
                    state.held.append(command)  # runs once the suspects are cleared
                else:
                    self._add(engine, command, state)
            command = _get_queue_item(self._inbox, block=False)
            if command is None:
                return True

    def _add(self, engine, request: EngineRequest, state: _ThreadState) -> None:
        try:
            engine.add_request(
                request.request_id, request.prompt, request.params, priority=request.priority
            )
        except ValueError as error:  # the engine's word for "this request is invalid"
            is_too_long = isinstance(error, PromptTooLongError)
            self._post(Rejected(request.request_id, str(error), is_too_long))
            return
        except Exception as error:
            log.exception("engine.add_failed", request_id=request.request_id)
            self._post(Failed([request.request_id], f"{type(error).__name__}: {error}"))
            return
        state.live[request.request_id] = request
        submitted_s = request.submitted_s
        self._added_s[request.request_id] = time.monotonic() if submitted_s is None else submitted_s

    def _step(self, engine, state: _ThreadState) -> None:
        started_s = time.monotonic()
        try:
            deltas = engine.step()
        except Exception as error:
            self._added_s.clear()  # the suspects restart: their queue time starts again
            self._on_step_failed(engine, state, error)
            return
        state.num_consecutive_failures = 0
        self._confirm_pinned(state)
        duration_s = time.monotonic() - started_s
        first_token_times = {}
        for delta in deltas:
            if delta.token_ids and delta.request_id in self._added_s:
                added_s = self._added_s.pop(delta.request_id)
                first_token_times[delta.request_id] = (max(0.0, started_s - added_s), duration_s)
            if delta.is_request_finished:  # with n > 1: its last choice finished
                self._added_s.pop(delta.request_id, None)
                state.forget(delta.request_id)
        stats = engine.get_stats() if hasattr(engine, "get_stats") else None
        if deltas:
            self._post(Deltas(deltas, StepInfo(started_s, duration_s, stats, first_token_times)))

    def _on_step_failed(self, engine, state: _ThreadState, error: Exception) -> None:
        state.num_consecutive_failures += 1
        message = f"{type(error).__name__}: {error}"
        log.error(
            "engine.step_failed", num_requests=len(state.live), error=message,
            num_consecutive=state.num_consecutive_failures,
        )  # fmt: skip
        depth = math.ceil(math.log2(max(1, len(state.live))))
        limit = self._max_consecutive_step_failures + depth  # room to finish a bisection
        if not state.is_isolating and not state.pinned:  # a bisection starts
            state.failure_limit = limit
        else:  # joiners may have made this group larger than the first one
            state.failure_limit = max(state.failure_limit, limit)
        if state.num_consecutive_failures >= state.failure_limit:
            raise StepFailuresExceeded(
                f"{state.num_consecutive_failures} engine steps failed in a row; last: {message}"
            ) from error
        # Their queue time starts again when they are added back.
        suspects = [dataclasses.replace(r, submitted_s=None) for r in state.live.values()]
        for request in suspects:
            engine.abort_request(request.request_id)
        state.live.clear()
        state.probe_ids.clear()
        if len(suspects) == 1:  # pinned: this request alone broke the step (once confirmed)
            state.pinned.append((suspects[0].request_id, message))
            return
        half = len(suspects) // 2
        state.suspect_groups.extendleft([suspects[half:], suspects[:half]])
        self._post(Restarted([r.request_id for r in suspects]))

    def _confirm_pinned(self, state: _ThreadState) -> None:
        """The fault did not recur: each pinned request was the culprit."""
        for request_id, message in state.pinned:
            self._post(Failed([request_id], message))
        state.pinned.clear()

    def _may_join(self, request: EngineRequest, state: _ThreadState) -> bool:
        """An urgent request joins the running suspect group, unless that is a lone suspect."""
        return request.priority <= self._max_urgent_priority and len(state.probe_ids) > 1

    def _admit_next(self, engine, state: _ThreadState) -> None:
        """Between steps: start the next suspect group once the current one is done, or, when
        no suspects are left, the requests held back meanwhile."""
        while state.suspect_groups and not state.probe_ids:
            for request in state.suspect_groups.popleft():
                self._add(engine, request, state)
                if request.request_id in state.live:
                    state.probe_ids.add(request.request_id)
        if state.probe_ids:  # urgent requests held while no group (or a lone one) ran join now
            urgent = [r for r in state.held if self._may_join(r, state)]
            if urgent:
                state.held = deque(r for r in state.held if not self._may_join(r, state))
                for request in urgent:
                    self._add(engine, request, state)
            return
        while state.held:
            self._add(engine, state.held.popleft(), state)


class _ThreadState:
    """What the engine thread knows about its requests (touched on that thread only)."""

    def __init__(self) -> None:
        self.live: dict[str, EngineRequest] = {}  # in the engine
        self.probe_ids: set[str] = set()  # the suspect group running alone now
        self.suspect_groups: deque[list[EngineRequest]] = deque()  # to run alone, in turn
        self.held: deque[EngineRequest] = deque()  # arrived while suspects were being cleared
        self.num_consecutive_failures = 0
        self.failure_limit = 0  # set when a bisection starts
        self.pinned: list[tuple[str, str]] = []  # (request id, error): culprits to confirm

    @property
    def is_isolating(self) -> bool:
        return bool(self.probe_ids or self.suspect_groups)

    def forget(self, request_id: str) -> None:
        self.live.pop(request_id, None)
        self.probe_ids.discard(request_id)
        for group in self.suspect_groups:
            group[:] = [r for r in group if r.request_id != request_id]
        while self.suspect_groups and not self.suspect_groups[0]:
            self.suspect_groups.popleft()
        self.held = deque(r for r in self.held if r.request_id != request_id)

    def all_ids(self) -> set[str]:
        ids = set(self.live) | {r.request_id for r in self.held} | {i for i, _ in self.pinned}
        return ids | {r.request_id for g in self.suspect_groups for r in g}


def set_os_thread_name(name: str) -> None:
    """The calling thread's name as the OS sees it (Linux: prctl PR_SET_NAME, 15 bytes);
    nothing elsewhere."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None)
    libc.prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME


def _get_queue_item(q: queue.Queue, block: bool):
    try:
        return q.get(block=block)
    except queue.Empty:
        return None


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
