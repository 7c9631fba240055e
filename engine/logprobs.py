"""Log-probabilities of sampled and prompt tokens, as in vLLM's `logprobs`/`prompt_logprobs`.

Values are the log-softmax of the model's raw logits (before temperature and top-k/top-p, as
vLLM returns by default), computed in float32. Each position gives a dict token id ->
`Logprob`: the top k tokens plus the actual token (so it has k or k + 1 entries), with its
1-based rank in the whole vocabulary.

The runner produces these per step (`SampleLogprobs` for a sampled token, `PromptLogprobsChunk`
for a prompt chunk); the engine joins the chunks into one entry per prompt token, which needs
the next token of the chunk's last row (that token is in the next chunk): so the chunk keeps
the last row's log-softmax until the engine scores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from engine.step_batch import StepBatch

__all__ = ["MAX_LOGPROBS", "Logprob", "PromptLogprobsChunk", "StepLogprobs"]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class PromptLogprobsChunk:
    """Rows of one prompt chunk at positions [start_position, start_position + n): row i
    predicts the token at position start_position + i + 1."""

    start_position: int
    topk_ids: torch.Tensor  # [n, k] int64
    topk_logprobs: torch.Tensor  # [n, k] float32
    inner_logprobs: torch.Tensor  # [n - 1]: logprob of the chunk's own next token, rows 0..n-2
    inner_ranks: torch.Tensor  # [n - 1] int64
    last_row: torch.Tensor  # [vocab] float32 log-softmax of row n - 1


def _ranks(log_probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """1-based rank of each row's chosen value: 1 + how many entries beat it."""
    return (log_probs > chosen[:, None]).sum(dim=-1) + 1


def _entry(ids, values, token: int, logprob: float, rank: int) -> dict[int, Logprob]:
    out = {
        int(t): Logprob(float(v), r + 1) for r, (t, v) in enumerate(zip(ids, values, strict=True))
    }
    if token not in out:
        out[token] = Logprob(logprob, rank)
    else:
        out[token].rank = rank
    return out


def sample_logprobs(logits: torch.Tensor, token_id: int, k: int) -> dict[int, Logprob]:
    """logits [vocab] -> the sampled token's entry (top k plus the token)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    chosen = log_probs[token_id : token_id + 1]
    rank = int(_ranks(log_probs[None], chosen)[0])
    values, ids = log_probs.topk(k) if k else (log_probs[:0], torch.zeros(0, dtype=torch.long))
    return _entry(ids.tolist(), values.tolist(), token_id, float(chosen[0]), rank)


def prompt_chunk_logprobs(
    logits: torch.Tensor, chunk_token_ids: list[int], start_position: int, k: int
) -> PromptLogprobsChunk:
    """logits [n, vocab] of a chunk's rows -> what the engine needs to score them."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    n = log_probs.shape[0]
    targets = torch.tensor(chunk_token_ids[1:], dtype=torch.long)
    inner = log_probs[: n - 1].gather(1, targets[:, None])[:, 0]
    if k:
        values, ids = log_probs.topk(k, dim=-1)
    else:
        values, ids = log_probs[:, :0], torch.zeros(n, 0, dtype=torch.long)
    return PromptLogprobsChunk(
        start_position=start_position,
        topk_ids=ids,
        topk_logprobs=values,
        inner_logprobs=inner,
        inner_ranks=_ranks(log_probs[: n - 1], inner),
        last_row=log_probs[n - 1].clone(),
    )


class PromptLogprobsAccumulator:
    """One request's prompt logprobs, filled chunk by chunk: entry i for prompt token i
    (None for token 0). A recomputed chunk (after preemption) overwrites nothing new."""

    def __init__(self, prompt_token_ids: list[int], k: int):
        self.prompt_token_ids = prompt_token_ids
        self.k = k
        self.entries: list[dict[int, Logprob] | None] = [None] * len(prompt_token_ids)
        self.num_filled = 1  # token 0 has no logprob

    def add(self, chunk: PromptLogprobsChunk) -> None:
        num_prompt = len(self.prompt_token_ids)
        ids, values = chunk.topk_ids.tolist(), chunk.topk_logprobs.tolist()
        inner, ranks = chunk.inner_logprobs.tolist(), chunk.inner_ranks.tolist()
        for row in range(len(ids)):
            target = chunk.start_position + row + 1  # the prompt token this row predicts
            if target >= num_prompt or self.entries[target] is not None:
                continue
            token = self.prompt_token_ids[target]
            if row < len(inner):
                logprob, rank = inner[row], ranks[row]
            else:
                last = chunk.last_row
                logprob = float(last[token])
                rank = int((last > last[token]).sum()) + 1
            self.entries[target] = _entry(ids[row], values[row], token, logprob, rank)
            self.num_filled += 1


@dataclass
class StepLogprobs:
    """What one step produced for one request that asked for logprobs."""

    prompt_chunk: PromptLogprobsChunk | None = None
    sample: dict[int, Logprob] | None = None


def prompt_logprobs_for_step(
    model, hidden: torch.Tensor, batch: StepBatch
) -> dict[str, StepLogprobs]:
    """Prompt logprob chunks of the batch's requests that ask for them and are still in their
    prompt (no output yet: a request preempted later has its prompt logprobs already).
    hidden [num_tokens, hidden] is the step's flat batch; which rows are whose, the batch says."""
    out: dict[str, StepLogprobs] = {}
    if not any(r.params.prompt_logprobs is not None for r in batch.requests):
        return out
    for request, rows in batch.request_rows():
        if request.params.prompt_logprobs is not None and request.num_output_tokens == 0:
            # On the CPU: the scoring below builds CPU index tensors (a GPU runner's hidden too).
            logits = model.compute_logits(hidden[rows]).cpu()
            out[request.request_id] = StepLogprobs(
                prompt_chunk=prompt_chunk_logprobs(
                    logits,
                    request.token_ids,
                    request.start_position,
                    request.params.prompt_logprobs,
                )
            )
    return out


def add_sample_logprobs(
    step: dict[str, StepLogprobs], logits: torch.Tensor, requests: list, token_ids: list[int]
) -> None:
    """Entries for the sampled tokens of requests with `logprobs` set (logits row i is
    requests[i]'s)."""
    for i, (request, token) in enumerate(zip(requests, token_ids, strict=True)):
        if request.params.logprobs is not None:
            entry = sample_logprobs(logits[i], token, request.params.logprobs)
            step.setdefault(request.request_id, StepLogprobs()).sample = entry
