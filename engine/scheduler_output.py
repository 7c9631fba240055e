"""The only contract between the scheduler (policy, pure Python) and the model runner (tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    The runner computes `token_ids` at positions `start_position ...` and writes their K/V into
    the slots given by `block_ids` (slot = block_ids[pos // block_size] * block_size + pos % block_size).
    Attention for these tokens reads positions [0, start_position + len(token_ids)) through
    `block_ids`. When `needs_sample` is true the chunk reaches the end of the request's tokens and
    the runner samples one token from the logits of its last position.
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    needs_sample: bool
    params: SamplingParams
    seed: int  # the request's seed (params.seed or one derived by the engine)
    # Tokens so far (prompt + output) for penalties or debugging; the runner must not need them.
    num_output_tokens: int = 0
    # Only for a sampling chunk (else None): the request's prompt + output tokens, for
    # penalties and for speculative decoding's proposals (engine/ngram_lookup.py; the list
    # itself, not a copy: read it this step only), and its grammar matcher (engine/structured),
    # which the sampler asks for this step's token mask and the engine advances with the
    # sampled token.
    all_token_ids: list[int] | None = None
    grammar: object | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests that left the engine since the last step (finished, aborted): the runner drops
    # their per-request state (random generators). Preempted requests keep theirs.
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
