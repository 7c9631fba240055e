"""A request's prompt as token ids: the chat template applied to `messages`, then tokenized.

Done on one thread of its own (`submit`), off the event loop: a poll can bring a hundred prompts
of 32,000 characters, seconds of tokenizing during which no token of any stream would be
published. One thread, so the work is bounded (one prompt at a time; the consumer's in-flight
bound caps the queue) and the worker's own tokenizer instance (never the engine's: a Hugging
Face fast tokenizer must not be used from two threads at once) is used by one thread only.
Its queue is ordered by urgency, then arrival: a worker that has just read a thousand low
requests ahead (its read-ahead) tokenizes a critical one that comes after them next, not last.
Before the engine, not in it, for three reasons: the batcher
needs true token counts for its budget, a chat template that fails gets its error final at once,
and the engine's hot thread skips tokenization. The ids are what the engine itself would make:
`tokenizer.encode(text)`, as `LLMEngine.encode_prompt` does. Whether the prompt fits the context
is checked once, by the engine (`PromptTooLongError`, answered with `prompt_too_long`).

A message's `content` is text, never control: special-token text in it (`<|im_end|>`, ...)
would otherwise be encoded as the control token and let a user close their turn and write the
system's. So when any content holds text the tokenizer would parse as a special (added) token,
the template is rendered with a placeholder per content, the template's own text is encoded
with its special tokens, and each content is encoded with special-token parsing off
(`split_special_tokens`). Otherwise the whole rendered text is encoded at once, as before (the
same ids as HF's own `apply_chat_template(tokenize=True)`). Roles must be ones chat templates
know (`ROLES`). The template's own BOS text is not doubled by the tokenizer's: the text is
encoded without the tokenizer's added tokens, and BOS is put in front only when missing.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from schemas.messages import ChatMessage, ErrorCode, ErrorInfo, Request

ROLES = frozenset({"system", "user", "assistant", "tool"})
# Stands in for a message's content while the template is rendered: private-use characters
# (no template trims or escapes them), numbered per message.
_PLACEHOLDER = "\ue000{}\ue001"
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)\ue001")


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    error: ErrorInfo | None = None


class PromptRenderer:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._executor = PriorityExecutor("tokenize")
        # Strings the tokenizer turns into added (control) tokens wherever they appear.
        added = getattr(tokenizer, "added_tokens_encoder", None) or {}
        self._special_texts = [t for t in added if t]
        bos_id = getattr(tokenizer, "bos_token_id", None)
        is_bos_added = bos_id is not None and tokenizer.encode("a")[:1] == [bos_id]  # added
        self._bos_ids = [bos_id] if is_bos_added else []

    def submit(self, request: Request, priority: int = 0) -> asyncio.Future[RenderedPrompt]:
        """`render` on the tokenizer thread, lower `priority` (the urgency's) first; the future
        raises what `render` raised."""
        return asyncio.wrap_future(self._executor.submit(priority, self.render, request))

    def close(self) -> None:
        self._executor.shutdown()

    def render(self, request: Request) -> RenderedPrompt:
        if self._tokenizer is None:
            return _error(
                ErrorCode.INVALID_REQUEST, "the served model has no tokenizer, so it takes no text"
            )
        if request.messages is not None:
            return self._render_chat(request.messages)
        return _checked(self._tokenizer.encode(request.prompt))

    def _render_chat(self, messages: list[ChatMessage]) -> RenderedPrompt:
        unknown = sorted({m.role for m in messages} - ROLES)
        if unknown:
            return _error(
                ErrorCode.INVALID_REQUEST,
                f"unknown message role(s) {unknown}; roles are {sorted(ROLES)}",
            )
        is_literal_needed = any(t in m.content for m in messages for t in self._special_texts)
        contents = [
            _PLACEHOLDER.format(i) if is_literal_needed else m.content
            for i, m in enumerate(messages)
        ]
        try:
            text = self._tokenizer.apply_chat_template(
                [{"role": m.role, "content": c} for m, c in zip(messages, contents, strict=True)],
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as error:  # jinja errors, a model without a template, ...
            return _error(
                ErrorCode.INVALID_REQUEST,
                f"cannot apply the model's chat template ({error}); send `prompt` instead "
                "of `messages` (mini-infer generate --raw)",
            )
        if not is_literal_needed:
            return _checked(self._with_bos(self._encode(text)))
        token_ids = []
        for i, part in enumerate(_PLACEHOLDER_RE.split(text)):
            if i % 2 == 0:  # the template's own text: its special tokens are control
                token_ids += self._encode(part)
            else:  # a message's content: text only
                token_ids += self._encode(messages[int(part)].content, split_special_tokens=True)
        return _checked(self._with_bos(token_ids))

    def _encode(self, text: str, **kwargs) -> list[int]:
        if not text:
            return []
        return self._tokenizer.encode(text, add_special_tokens=False, **kwargs)

    def _with_bos(self, token_ids: list[int]) -> list[int]:
        """The tokenizer's BOS in front, unless the template already put it there."""
        if self._bos_ids and token_ids[:1] != self._bos_ids:
            return self._bos_ids + token_ids
        return token_ids


class PriorityExecutor:
    """One daemon thread running submitted calls lowest priority first, then in order of
    submission (`concurrent.futures` has no priority queue; its single-thread pool is FIFO)."""

    _STOP = (-1, -1, None, (), None)  # sorts first: shutdown does not wait for the queue

    def __init__(self, name: str) -> None:
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._serial = itertools.count()
        self._is_shut = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, priority: int, fn: Callable, *args: Any) -> Future:
        if self._is_shut:
            raise RuntimeError("cannot submit after shutdown")
        future: Future = Future()
        self._queue.put((priority, next(self._serial), fn, args, future))
        return future

    def shutdown(self) -> None:
        """Stop after the call in progress; the calls still queued are cancelled."""
        self._is_shut = True
        self._queue.put(self._STOP)

    def _run(self) -> None:
        while True:
            _, _, fn, args, future = self._queue.get()
            if fn is None:
                break
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as error:  # handed to the awaiting coroutine
                    future.set_exception(error)
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item[4] is not None:
                item[4].cancel()


def _checked(token_ids: list[int]) -> RenderedPrompt:
    if not token_ids:
        return _error(ErrorCode.INVALID_REQUEST, "the prompt is empty after tokenization")
    return RenderedPrompt(token_ids)


def _error(code: str, message: str) -> RenderedPrompt:
    return RenderedPrompt([], ErrorInfo(code=code, message=message))
