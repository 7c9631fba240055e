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
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from engine.errors import PromptTooLongError
from engine.outputs import EngineStats, RequestDelta
from engine.sampling_params import SamplingParams

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EngineRequest:
    request_id: str  # the engine's id: the attempt, unique even when a request id repeats
    prompt: str | list[int]
    params: SamplingParams
    priority: int  # lower runs first: the urgency's priority
    num_prompt_tokens: int  # for the batcher's budget


@dataclass(frozen=True)
class EngineInfo:
    model_path: str
    max_model_len: int


@dataclass(frozen=True)
class StepInfo:
    """One engine step, for metrics: when it ran and the engine's state after it."""

    started_s: float  # monotonic
    duration_s: float
    stats: EngineStats | None
    # Requests whose first token came from this step: (engine queue s, prefill s). The queue is
    # from add_request to the start of this step, so for a prompt prefilled in several chunks it
    # includes the earlier chunks' steps.
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


EngineEvent = Deltas | Rejected | Aborted | Failed


class _Stop:
    pass


@dataclass(frozen=True)
class _Abort:
    request_id: str


class EngineBridge:
    def __init__(self, engine_factory: Callable[[], Any]) -> None:
        self._engine_factory = engine_factory
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queued_tokens: dict[str, int] = {}  # not started yet -> prompt tokens
        self.events: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self.crashed: asyncio.Future[BaseException] | None = None  # set if the thread dies
        # Written by the engine thread, read by liveness probes (float/bool writes are atomic).
        self._has_work = False
        self._progress_s = time.monotonic()  # the last finished step, or when work arrived
        self._added_s: dict[str, float] = {}  # engine thread only: added, no token yet

    @property
    def queued_tokens(self) -> int:
        return sum(self._queued_tokens.values())

    async def start(self) -> EngineInfo:
        """Build the engine on its thread (loading the model takes seconds) and wait for it."""
        self._loop = asyncio.get_running_loop()
        self.crashed = self._loop.create_future()
        ready: asyncio.Future[EngineInfo] = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="engine", daemon=True)
        self._thread.start()
        return await ready

    def submit(self, requests: list[EngineRequest]) -> None:
        for request in requests:
            self._queued_tokens[request.request_id] = request.num_prompt_tokens
            self._inbox.put(request)

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
            case Failed(request_ids):
                ids = request_ids
            case Rejected(request_id) | Aborted(request_id):
                ids = [request_id]
        for request_id in ids:
            self._queued_tokens.pop(request_id, None)
        self.events.put_nowait(event)

    # --- engine thread ---------------------------------------------------------------------

    def _run(self, ready: asyncio.Future) -> None:
        try:
            engine = self._engine_factory()
            info = EngineInfo(
                model_path=str(engine.model_path), max_model_len=int(engine.max_model_len)
            )
        except BaseException as error:  # handed to the awaiting coroutine
            self._loop.call_soon_threadsafe(_set_exception, ready, error)
            return
        self._loop.call_soon_threadsafe(_set_result, ready, info)
        live_ids: set[str] = set()
        try:
            self._serve(engine, live_ids)
        except BaseException as error:  # a bug: say so loudly rather than hang every request
            log.exception("engine.thread_crashed")
            self._post(Failed(sorted(live_ids), f"the engine thread crashed: {error!r}"))
            self._loop.call_soon_threadsafe(_set_result, self.crashed, error)

    def _serve(self, engine, live_ids: set[str]) -> None:
        while True:
            # Block only when idle; while generating, take what arrived and step again.
            command = _get_queue_item(self._inbox, block=not engine.has_unfinished_requests())
            if command is not None and not self._handle_commands(engine, command, live_ids):
                return
            has_work = engine.has_unfinished_requests()
            if has_work and not self._has_work:
                self._progress_s = time.monotonic()  # a stall is counted from here
            self._has_work = has_work
            if has_work:
                self._step(engine, live_ids)
                self._progress_s = time.monotonic()

    def _handle_commands(self, engine, first, live_ids: set[str]) -> bool:
        command = first
        while True:
            if isinstance(command, _Stop):
                for request_id in list(live_ids):
                    engine.abort_request(request_id)
                return False
            if isinstance(command, _Abort):
                engine.abort_request(command.request_id)
                live_ids.discard(command.request_id)
                self._added_s.pop(command.request_id, None)
                self._post(Aborted(command.request_id))
            elif isinstance(command, EngineRequest):
                self._add(engine, command, live_ids)
            command = _get_queue_item(self._inbox, block=False)
            if command is None:
                return True

    def _add(self, engine, request: EngineRequest, live_ids: set[str]) -> None:
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
        live_ids.add(request.request_id)
        self._added_s[request.request_id] = time.monotonic()

    def _step(self, engine, live_ids: set[str]) -> None:
        started_s = time.monotonic()
        try:
            deltas = engine.step()
        except Exception as error:
            # Which request broke it is unknown: fail them all, keep the engine serving new work.
            log.exception("engine.step_failed", num_requests=len(live_ids))
            failed_ids = sorted(live_ids)
            for request_id in failed_ids:
                engine.abort_request(request_id)
            live_ids.clear()
            self._added_s.clear()
            self._post(Failed(failed_ids, f"{type(error).__name__}: {error}"))
            return
        duration_s = time.monotonic() - started_s
        first_token_times = {}
        for delta in deltas:
            if delta.token_ids and delta.request_id in self._added_s:
                added_s = self._added_s.pop(delta.request_id)
                first_token_times[delta.request_id] = (max(0.0, started_s - added_s), duration_s)
            if delta.finished:
                self._added_s.pop(delta.request_id, None)
                live_ids.discard(delta.request_id)
        stats = engine.get_stats() if hasattr(engine, "get_stats") else None
        if deltas:
            self._post(Deltas(deltas, StepInfo(started_s, duration_s, stats, first_token_times)))


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
