"""What the engine hands back: whole results (`RequestOutput`) and stream deltas (`RequestDelta`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.logprobs import Logprob

    PositionLogprobs = dict[int, Logprob]

# Engine finish reasons. The worker maps "abort" to its own "cancelled"/"expired".
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # With SamplingParams.logprobs: one entry per generated token.
    logprobs: list[PositionLogprobs] | None = None
    # All n samples (SamplingParams.n), by index; the fields above repeat choice 0's, so an
    # n=1 caller reads the output as before.
    choices: list[CompletionOutput] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One sample of a request (OpenAI's "choice")."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[PositionLogprobs] | None = None


@dataclass
class RequestDelta:
    """New output of one request after one engine step.

    Deltas of a request concatenate to its final text; `text` never ends inside a character and
    never contains (part of) a stop string. The last delta has `finished=True` and a finish reason.
    With SamplingParams.n > 1 each sample (`index`) streams its own deltas under the request's
    id, with its own last delta; the request is done at the delta with `is_request_finished`.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far, including this delta
    num_cached_tokens: int = 0
    logprobs: list[PositionLogprobs] | None = None  # one per token of this delta, if asked
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # on the first delta only
    index: int = 0  # the sample (choice) this delta belongs to
    num_samples_running: int = 0  # other samples of the request still generating after this

    @property
    def is_request_finished(self) -> bool:
        """This delta ends the request: its sample finished and no other sample is running."""
        return self.finished and self.num_samples_running == 0


@dataclass
class EngineStats:
    num_blocks_total: int
    num_blocks_free: int
    num_blocks_cached: int  # free blocks that still hold a reusable prefix
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_prefix_queries: int  # prompt tokens looked up in the prefix cache
    num_prefix_hits: int  # of which found
    num_tokens_computed: int
    num_tokens_reused: int
    extra: dict = field(default_factory=dict)
    # Fused CPU decode steps (engine/fused_decode.py), and of those the ones run on
    # one thread because that measured faster (the cores busy with other work); 0 without it.
    num_fused_steps: int = 0
    num_fused_steps_one_thread: int = 0
    # Seconds the engine's thread waited for the GIL after its fused steps (another Python
    # thread held it: a worker's event loop); cumulative, like the counters above.
    fused_step_gil_wait_s: float = 0.0
    # Speculative decoding (engine/fused_decode.py `speculate`): tokens drafted or looked up
    # (engine/ngram_lookup.py), and of those the ones the verifying step kept (acceptance =
    # accepted / drafted); cumulative.
    num_draft_tokens: int = 0
    num_draft_accepted: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0
