"""A blocking client for scripts and threads without an event loop: `MiniInferClient` run on a
private event loop in a daemon thread, each call handed over and waited for.

    from worker.client import SyncMiniInferClient

    with SyncMiniInferClient("localhost:9092") as client:
        print(client.generate("Hello", max_tokens=32).text)
        for delta in client.stream("Tell me a story"):
            print(delta.text, end="")

Safe to call from several threads at once (the calls run concurrently on the one loop).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from schemas.messages import Request
from worker.client.assembler import Delta
from worker.client.client import ClientError, ClientOptions, GenerateResult, MiniInferClient

T = TypeVar("T")


class SyncMiniInferClient:
    def __init__(self, bootstrap_servers: str, options: ClientOptions | None = None) -> None:
        self._client = MiniInferClient(bootstrap_servers, options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="mini-infer-client-loop", daemon=True
        )
        self._thread.start()

    @property
    def reply_topic(self) -> str:
        return self._client.reply_topic

    def __enter__(self) -> SyncMiniInferClient:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        self._run(self._client.start())

    def close(self) -> None:
        """Close the client, then stop and join the loop thread. Idempotent."""
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def build_request(self, prompt: str | None = None, **kwargs: Any) -> Request:
        return self._client.build_request(prompt, **kwargs)

    def generate(self, prompt: str | None = None, **kwargs: Any) -> GenerateResult:
        """As `MiniInferClient.generate` (same keyword arguments), blocking."""
        return self._run(self._client.generate(prompt, **kwargs))

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[Delta]:
        """As `MiniInferClient.stream`, as a plain iterator. Leaving the loop early (break, an
        exception) closes the stream, which cancels the request."""
        stream = self._client.stream(prompt, **kwargs)
        try:
            while True:
                try:
                    yield self._run(anext(stream))
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():
                self._run(stream.aclose())

    def cancel(self, request_id: str) -> None:
        self._run(self._client.cancel(request_id))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed() or threading.current_thread() is self._thread:
            coro.close()
            if self._loop.is_closed():
                raise ClientError("the client is closed")
            raise ClientError("SyncMiniInferClient called from its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
