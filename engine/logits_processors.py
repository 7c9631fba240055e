"""What changes the logits before temperature / top-k / top-p: penalties, logit bias and the
structured-output token mask. Each is one batched tensor op over the rows that use it (flat
index lists built from the requests, never a Python loop over the vocabulary), and a batch where
no request uses any of them never gets here.

Order, as vLLM: repetition penalty (HF's `RepetitionPenaltyLogitsProcessor`: over prompt and
output tokens), then frequency / presence penalties (OpenAI's definition: over output tokens),
then logit bias, then the grammar mask (last, so nothing can re-allow a banned token).
"""

from __future__ import annotations

import torch

from engine.sampling_params import MIN_TEMPERATURE
from engine.scheduler_output import ScheduledRequest
from engine.structured.bitmask import apply_bitmask


def process_logits(logits: torch.Tensor, requests: list[ScheduledRequest]) -> torch.Tensor:
    """logits [num_requests, vocab] (row i is requests[i]'s) -> logits with every request's
    penalties, bias and grammar mask applied: float32 when penalties or a bias are used, else
    the input's dtype if float32 or bfloat16 (the mask alone needs no conversion: at W2 that is
    a [32, 49k] copy saved per step). Changed in place where possible, unless a request of the
    batch asks for logprobs (the runner scores those on the raw logits after sampling)."""
    is_arithmetic = any(r.params.has_penalties or r.params.logit_bias for r in requests)
    if is_arithmetic or logits.dtype not in (torch.float32, torch.bfloat16):
        out = logits.float()  # a copy unless already float32
    else:
        out = logits
    if out.data_ptr() == logits.data_ptr() and any(r.params.logprobs is not None for r in requests):
        out = out.clone()
    penalized = [i for i, r in enumerate(requests) if r.params.has_penalties]
    if penalized:
        _apply_penalties(out, [requests[i] for i in penalized], penalized)
    biased = [i for i, r in enumerate(requests) if r.params.logit_bias]
    if biased:
        _apply_logit_bias(out, [requests[i] for i in biased], biased)
    constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
    if constrained:
        _apply_grammar_masks(out, [requests[i] for i in constrained], constrained)
    return out


def token_counts(
    requests: list[ScheduledRequest], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (output counts [rows, vocab] float32, prompt presence [rows, vocab] bool), built by
    one scatter each over the concatenated token lists."""
    prompt_rows, prompt_ids, output_rows, output_ids = [], [], [], []
    for row, request in enumerate(requests):
        tokens = request.all_token_ids
        num_prompt = len(tokens) - request.num_output_tokens
        prompt_ids.extend(tokens[:num_prompt])
        prompt_rows.extend([row] * num_prompt)
        output_ids.extend(tokens[num_prompt:])
        output_rows.extend([row] * (len(tokens) - num_prompt))
    counts = torch.zeros(len(requests), vocab_size)
    counts.index_put_(
        (torch.tensor(output_rows, dtype=torch.long), torch.tensor(output_ids, dtype=torch.long)),
        torch.ones(len(output_ids)),
        accumulate=True,
    )
    in_prompt = torch.zeros(len(requests), vocab_size, dtype=torch.bool)
    in_prompt[
        torch.tensor(prompt_rows, dtype=torch.long), torch.tensor(prompt_ids, dtype=torch.long)
    ] = True
    return counts, in_prompt


def _apply_penalties(out: torch.Tensor, requests: list[ScheduledRequest], rows: list[int]) -> None:
    logits = out[rows]  # [P, vocab]
    counts, in_prompt = token_counts(requests, logits.shape[1])
    repetition = torch.tensor([r.params.repetition_penalty for r in requests])[:, None]
    seen = in_prompt | (counts > 0)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    frequency = torch.tensor([r.params.frequency_penalty for r in requests])[:, None]
    presence = torch.tensor([r.params.presence_penalty for r in requests])[:, None]
    logits -= frequency * counts + presence * (counts > 0)
    out[rows] = logits


def _apply_logit_bias(out: torch.Tensor, requests: list[ScheduledRequest], rows: list[int]) -> None:
    flat_rows, token_ids, biases = [], [], []
    for row, request in zip(rows, requests, strict=True):
        for token, bias in request.params.logit_bias:
            flat_rows.append(row)
            token_ids.append(token)
            biases.append(bias)
    # The engine checked every id against the vocabulary when the request was added.
    out.index_put_(
        (torch.tensor(flat_rows, dtype=torch.long), torch.tensor(token_ids, dtype=torch.long)),
        torch.tensor(biases),
        accumulate=True,
    )


def _apply_grammar_masks(
    out: torch.Tensor, requests: list[ScheduledRequest], rows: list[int]
) -> None:
    # bitmask [num_requests, ceil(vocab / 32)] int32, bit i of word w = token 32 * w + i. Each
    # matcher fills its own row (the library's per-request work, ~3 us).
    bitmask = torch.empty(out.shape[0], (out.shape[1] + 31) // 32, dtype=torch.int32)
    for row, request in zip(rows, requests, strict=True):
        request.grammar.fill_bitmask(bitmask, row)
    rows = _rows_needing_the_mask(out, bitmask, rows, requests)
    if rows:
        apply_bitmask(out, bitmask, rows)


def _rows_needing_the_mask(
    out: torch.Tensor, bitmask: torch.Tensor, rows: list[int], requests: list[ScheduledRequest]
) -> list[int]:
    """Drop the greedy rows whose argmax the grammar allows: masking cannot change their pick
    (the first maximum stays the first maximum among fewer candidates), and the [vocab] pass
    over the row is the mask's main cost (~0.4 ms a row here). A greedy decode that agrees with
    its grammar, as a model asked for JSON mostly does, then pays one argmax per step."""
    greedy = [
        row for row, r in zip(rows, requests, strict=True) if r.params.temperature < MIN_TEMPERATURE
    ]
    if not greedy:
        return rows
    top = out[greedy].max(dim=-1).indices  # [G] the raw picks
    words = bitmask[greedy].gather(1, (top // 32)[:, None])[:, 0]  # [G] int32
    is_allowed = ((words.long() >> (top % 32)) & 1).bool().tolist()
    allowed_rows = {row for row, ok in zip(greedy, is_allowed, strict=True) if ok}
    return [row for row in rows if row not in allowed_rows]
