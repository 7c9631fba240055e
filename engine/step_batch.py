"""One step's flat batch: every scheduled token of every request as one row.

Single-token requests (decodes) come first so attention can batch them; multi-token chunks
follow, each a contiguous run of rows. `StepBatch.requests` is that order, the one definition
of which rows belong to which request (the sampler's rows and the prompt logprobs read it).
Cache slots come from the block ids the scheduler handed out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from engine.kernels.attention_types import (
    AttentionMetadata,
    PrefillChunk,
    causal_chunk_mask,
    decode_mask,
)
from engine.kv_cache_manager import cdiv
from engine.scheduler_output import ScheduledRequest


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_samples]: row of each sampling request's last token
    sample_requests: list[ScheduledRequest]
    # In row order: requests[i] owns rows [row_starts[i], row_starts[i] + len(token_ids)).
    requests: list[ScheduledRequest]
    row_starts: list[int]

    def request_rows(self) -> Iterator[tuple[ScheduledRequest, slice]]:
        """(request, its rows of the flat batch), in row order."""
        for request, start in zip(self.requests, self.row_starts, strict=True):
            yield request, slice(start, start + len(request.token_ids))


def prepare_step(
    scheduled: list[ScheduledRequest],
    block_size: int,
    dtype: torch.dtype = torch.float32,
    build_decode_mask: bool = True,
) -> StepBatch:
    """Flatten one step's requests into model inputs and attention metadata.

    Sampling rows are the last token of each `needs_sample` request. Positions, slots and the
    decode block table are computed with array operations over all tokens at once (no Python
    loop per token), and the decode mask, which only the torch reference reads, is built only
    when asked (measured: loadtest/JOURNAL.md, "Step preparation").
    """
    if scheduled and all(len(r.token_ids) == 1 for r in scheduled):
        return _prepare_decodes(scheduled, block_size, dtype if build_decode_mask else None)
    return _prepare_mixed(scheduled, block_size, dtype, build_decode_mask)


def _prepare_mixed(
    scheduled: list[ScheduledRequest], block_size: int, dtype: torch.dtype, build_decode_mask: bool
) -> StepBatch:
    """`prepare_step` for any step: decodes first, then each prefill chunk."""
    decodes = [r for r in scheduled if len(r.token_ids) == 1]
    prefills = [r for r in scheduled if len(r.token_ids) > 1]
    ordered = decodes + prefills
    num_requests = len(ordered)
    token_counts = np.fromiter(map(len, (r.token_ids for r in ordered)), np.int64, num_requests)
    starts = np.fromiter((r.start_position for r in ordered), np.int64, num_requests)
    block_counts = np.fromiter(map(len, (r.block_ids for r in ordered)), np.int64, num_requests)
    num_tokens = int(token_counts.sum())
    input_ids = np.fromiter(chain.from_iterable(r.token_ids for r in ordered), np.int64, num_tokens)
    flat_blocks = np.fromiter(
        chain.from_iterable(r.block_ids for r in ordered), np.int64, int(block_counts.sum())
    )
    token_ends = np.cumsum(token_counts)  # one past each request's last row
    request_of_token = np.repeat(np.arange(num_requests), token_counts)
    positions = starts[request_of_token] + (
        np.arange(num_tokens) - (token_ends - token_counts)[request_of_token]
    )
    first_block = (np.cumsum(block_counts) - block_counts)[request_of_token]
    slots = flat_blocks[first_block + positions // block_size] * block_size + positions % block_size
    needs_sample = np.fromiter((r.needs_sample for r in ordered), bool, num_requests)
    meta = AttentionMetadata(slot_mapping=torch.from_numpy(slots))
    num_decodes = len(decodes)
    if num_decodes:
        _add_decodes(
            starts[:num_decodes] + 1, block_counts[:num_decodes],
            flat_blocks[: int(block_counts[:num_decodes].sum())], block_size,
            dtype if build_decode_mask else None, meta,
        )  # fmt: skip
    _add_prefills(prefills, block_size, dtype, num_decodes, meta)
    return StepBatch(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        meta=meta,
        sample_rows=torch.from_numpy(token_ends[needs_sample] - 1),
        sample_requests=[r for r in ordered if r.needs_sample],
        requests=ordered,
        row_starts=(token_ends - token_counts).tolist(),
    )


def _prepare_decodes(
    scheduled: list[ScheduledRequest], block_size: int, mask_dtype: torch.dtype | None
) -> StepBatch:
    """`prepare_step` for a step of single-token requests only (every decode step), with a
    third of its array operations: row i is request i, its position its start."""
    num_rows = len(scheduled)
    input_ids = np.fromiter((r.token_ids[0] for r in scheduled), np.int64, num_rows)
    positions = np.fromiter((r.start_position for r in scheduled), np.int64, num_rows)
    needed = positions // block_size + 1  # blocks up to and including the new token's
    table = np.zeros((num_rows, int(needed.max())), np.int64)  # padding 0: never read
    for row, (request, count) in enumerate(zip(scheduled, needed.tolist(), strict=True)):
        table[row, :count] = request.block_ids[:count]
    slots = table[np.arange(num_rows), needed - 1] * block_size + positions % block_size
    meta = AttentionMetadata(slot_mapping=torch.from_numpy(slots))
    meta.num_decodes = num_rows
    meta.decode_block_table = torch.from_numpy(table)
    meta.decode_context_lens = torch.from_numpy(positions + 1)
    if mask_dtype is not None:
        width = table.shape[1] * block_size
        meta.decode_mask = decode_mask(meta.decode_context_lens, width, mask_dtype)
    needs_sample = np.fromiter((r.needs_sample for r in scheduled), bool, num_rows)
    return StepBatch(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        meta=meta,
        sample_rows=torch.from_numpy(np.flatnonzero(needs_sample)),
        sample_requests=[r for r in scheduled if r.needs_sample],
        requests=list(scheduled),
        row_starts=list(range(num_rows)),
    )


def _add_decodes(
    context_lens: np.ndarray,  # [num_decodes]
    block_counts: np.ndarray,  # [num_decodes] blocks each request holds
    flat_blocks: np.ndarray,  # their block ids, request after request
    block_size: int,
    mask_dtype: torch.dtype | None,
    meta: AttentionMetadata,
) -> None:
    """The padded block table [num_decodes, max blocks needed] (padding 0: masked out or, for
    the kernel, never read past the context length) and, if `mask_dtype`, the additive mask."""
    num_decodes, max_count = context_lens.shape[0], int(block_counts.max())
    held = np.zeros((num_decodes, max_count), np.int64)  # each row: the request's block ids
    held[np.arange(max_count)[None, :] < block_counts[:, None]] = flat_blocks  # row-major order
    needed = -(-context_lens // block_size)  # <= block_counts (checked by the runner)
    width = int(needed.max())
    table = np.where(np.arange(width)[None, :] < needed[:, None], held[:, :width], 0)
    meta.num_decodes = num_decodes
    meta.decode_block_table = torch.from_numpy(table)
    meta.decode_context_lens = torch.from_numpy(context_lens)
    if mask_dtype is not None:
        meta.decode_mask = decode_mask(meta.decode_context_lens, width * block_size, mask_dtype)


def _add_prefills(
    prefills: list[ScheduledRequest],
    block_size: int,
    dtype: torch.dtype,
    token_start: int,
    meta: AttentionMetadata,
) -> None:
    for request in prefills:
        start, num_tokens = request.start_position, len(request.token_ids)
        chunk = PrefillChunk(token_start, num_tokens, start)
        if start > 0:
            num_ctx = start + num_tokens
            chunk.block_ids = torch.tensor(
                request.block_ids[: cdiv(num_ctx, block_size)], dtype=torch.int64
            )
            chunk.mask = causal_chunk_mask(start, num_tokens, dtype)
            chunk.causal = True
        meta.prefills.append(chunk)
        token_start += num_tokens
