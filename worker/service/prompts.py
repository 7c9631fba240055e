"""A request's prompt as token ids: the chat template applied to `messages`, then tokenized.

Done on one thread of its own (`submit`), off the event loop: a poll can bring a hundred prompts
of 32,000 characters, seconds of tokenizing during which no token of any stream would be
published. One thread, so the work is bounded (one prompt at a time; the consumer's in-flight
bound caps the queue) and the worker's own tokenizer instance (never the engine's: a Hugging
Face fast tokenizer must not be used from two threads at once) is used by one thread only.
Before the engine, not in it, for three reasons: the batcher
needs true token counts for its budget, a chat template that fails gets its error final at once,
and the engine's hot thread skips tokenization. The ids are what the engine itself would make:
`tokenizer.encode(text)`, as `LLMEngine.encode_prompt` does. Whether the prompt fits the context
is checked once, by the engine (`PromptTooLongError`, answered with `prompt_too_long`).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from schemas.messages import ErrorCode, ErrorInfo, Request


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    error: ErrorInfo | None = None


class PromptRenderer:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    def submit(self, request: Request) -> asyncio.Future[RenderedPrompt]:
        """`render` on the tokenizer thread; the future raises what `render` raised."""
        return asyncio.wrap_future(self._executor.submit(self.render, request))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def render(self, request: Request) -> RenderedPrompt:
        if self._tokenizer is None:
            return _error(
                ErrorCode.INVALID_REQUEST, "the served model has no tokenizer, so it takes no text"
            )
        if request.messages is not None:
            try:
                text = self._tokenizer.apply_chat_template(
                    [m.model_dump() for m in request.messages],
                    add_generation_prompt=True,
                    tokenize=False,
                )
            except Exception as error:  # jinja errors, a model without a template, ...
                return _error(
                    ErrorCode.INVALID_REQUEST,
                    f"cannot apply the model's chat template ({error}); send `prompt` instead "
                    "of `messages` (mini-infer generate --raw)",
                )
        else:
            text = request.prompt
        token_ids = self._tokenizer.encode(text)
        if not token_ids:
            return _error(ErrorCode.INVALID_REQUEST, "the prompt is empty after tokenization")
        return RenderedPrompt(token_ids)


def _error(code: str, message: str) -> RenderedPrompt:
    return RenderedPrompt([], ErrorInfo(code=code, message=message))
