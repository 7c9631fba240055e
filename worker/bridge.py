"""The engine on its own thread, talking to the event loop through queues.

A forward pass takes milliseconds to seconds; on the event loop it would stall polling,
heartbeats (a stalled member is thrown out of the group) and publishing. So the engine lives on
one dedicated thread (it is single-threaded by contract: it is built, stepped and aborted there
and nowhere else). Commands go in through a `queue.Queue`; results come back with
`loop.call_soon_threadsafe`, in the order the engine produced them, to a `BridgeListener`
running on the event loop.

The bridge also counts prompt tokens handed over but not yet started (no first delta): the
batcher's budget is measured against it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from engine.outputs import RequestDelta
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


class BridgeListener(Protocol):
    """Called on the event loop, in engine order."""

    def on_deltas(self, deltas: list[RequestDelta]) -> None: ...
    def on_rejected(self, request_id: str, message: str) -> None: ...  # add_request's ValueError
    def on_aborted(self, request_id: str) -> None: ...  # abort done (or it had already left)
    def on_failed(self, request_ids: list[str], message: str) -> None: ...  # a step raised


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
        self._listener: BridgeListener | None = None
        self._queued_tokens: dict[str, int] = {}  # not started yet -> prompt tokens
        self.on_started: Callable[[], None] = lambda: None  # e.g. wakes the batcher
        self.on_crashed: Callable[[BaseException], None] = lambda error: None  # the thread died

    @property
    def queued_tokens(self) -> int:
        return sum(self._queued_tokens.values())

    async def start(self) -> EngineInfo:
        """Build the engine on its thread (loading the model takes seconds) and wait for it."""
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future[EngineInfo] = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="engine", daemon=True)
        self._thread.start()
        return await ready

    def set_listener(self, listener: BridgeListener) -> None:
        """Before the first `submit`: nothing comes back from the engine before that."""
        self._listener = listener

    def submit(self, requests: list[EngineRequest]) -> None:
        for request in requests:
            self._queued_tokens[request.request_id] = request.num_prompt_tokens
            self._inbox.put(request)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._inbox.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    # --- event loop side -------------------------------------------------------------------

    def _post(self, method: str, *args) -> None:
        self._loop.call_soon_threadsafe(self._dispatch, method, args)

    def _dispatch(self, method: str, args: tuple) -> None:
        if method == "on_deltas":
            ids = {d.request_id for d in args[0]}
        elif method == "on_failed":
            ids = set(args[0])
        else:
            ids = {args[0]}
        has_started = any(self._queued_tokens.pop(i, None) is not None for i in ids)
        getattr(self._listener, method)(*args)
        if has_started:
            self.on_started()

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
            self._post("on_failed", sorted(live_ids), f"the engine thread crashed: {error!r}")
            self._loop.call_soon_threadsafe(self.on_crashed, error)

    def _serve(self, engine, live_ids: set[str]) -> None:
        while True:
            # Block only when idle; while generating, take what arrived and step again.
            command = _get_queue_item(self._inbox, block=not engine.has_unfinished_requests())
            if command is not None and not self._handle_commands(engine, command, live_ids):
                return
            if engine.has_unfinished_requests():
                self._step(engine, live_ids)

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
                self._post("on_aborted", command.request_id)
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
            self._post("on_rejected", request.request_id, str(error))
            return
        except Exception as error:
            log.exception("engine.add_failed", request_id=request.request_id)
            self._post("on_failed", [request.request_id], f"{type(error).__name__}: {error}")
            return
        live_ids.add(request.request_id)

    def _step(self, engine, live_ids: set[str]) -> None:
        try:
            deltas = engine.step()
        except Exception as error:
            # Which request broke it is unknown: fail them all, keep the engine serving new work.
            log.exception("engine.step_failed", num_requests=len(live_ids))
            failed_ids = sorted(live_ids)
            for request_id in failed_ids:
                engine.abort_request(request_id)
            live_ids.clear()
            self._post("on_failed", failed_ids, f"{type(error).__name__}: {error}")
            return
        for delta in deltas:
            if delta.finished:
                live_ids.discard(delta.request_id)
        if deltas:
            self._post("on_deltas", deltas)


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
