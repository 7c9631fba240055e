"""Request state inside the engine. Pure Python: no torch, no tensors."""

from __future__ import annotations

import enum

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # new, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One generation request.

    The single rule the scheduler follows: `num_computed_tokens` (tokens whose K/V are in the
    cache) catches up with `num_tokens` (prompt + generated). A new request, a long prompt in
    chunks, a decode step, a prefix-cache hit and a preempted request being recomputed are all
    that one rule with different numbers.
    """

    __slots__ = (
        "request_id",
        "params",
        "priority",
        "arrival_index",
        "seed",
        "all_token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "status",
        "finish_reason",
        "grammar",
        "group_id",
        "sample_index",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_index: int = 0,
        seed: int = 0,
        group_id: str | None = None,
        sample_index: int = 0,
    ) -> None:
        self.request_id = request_id
        # With SamplingParams.n > 1 each sample is a Request of its own: `group_id` is the
        # caller's request id (shared by the samples), `sample_index` the choice it answers.
        self.group_id = request_id if group_id is None else group_id
        self.sample_index = sample_index
        self.params = params
        self.priority = priority  # lower = more urgent
        self.arrival_index = arrival_index  # tie-breaker: earlier first
        self.seed = seed
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        # engine/structured's matcher for a request with structured output, else None. It has
        # accepted exactly the output tokens, so a preempted request resumes with it as is.
        self.grammar: object | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: most urgent first, then first come first served."""
        return (self.priority, self.arrival_index)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, prio={self.priority}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
