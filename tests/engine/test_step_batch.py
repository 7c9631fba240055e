"""engine/step_batch.py: the flat batch's row order is the one `StepBatch.request_rows` gives."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest
from engine.step_batch import _prepare_mixed, prepare_step

BLOCK_SIZE = 4


@st.composite
def steps(draw):
    scheduled = []
    for i in range(draw(st.integers(1, 6))):
        num_tokens = draw(st.sampled_from([1, 1, 2, 5]))
        start = draw(st.integers(0, 9))
        token_ids = [100 * i + t for t in range(num_tokens)]
        num_blocks = -(-(start + num_tokens) // BLOCK_SIZE)
        block_ids = [10 * i + b for b in range(num_blocks)]
        needs_sample = draw(st.booleans())
        scheduled.append(
            ScheduledRequest(f"r{i}", token_ids, start, block_ids, needs_sample,
                             SamplingParams(), seed=0)
        )  # fmt: skip
    return scheduled


@settings(max_examples=40, deadline=None)
@given(scheduled=steps())
def test_request_rows_partition_the_batch_decodes_first(scheduled):
    batch = prepare_step(scheduled, BLOCK_SIZE)
    rows = list(batch.request_rows())
    assert sorted(r.request_id for r, _ in rows) == sorted(r.request_id for r in scheduled)
    sizes = [len(r.token_ids) for r, _ in rows]
    assert sizes == sorted(sizes, key=lambda n: n > 1)  # decodes, then chunks (stable)
    next_row = 0
    for request, span in rows:
        assert span.start == next_row
        next_row = span.stop
        assert batch.input_ids[span].tolist() == request.token_ids
        start = request.start_position
        assert batch.positions[span].tolist() == list(range(start, start + len(request.token_ids)))
    assert next_row == batch.input_ids.shape[0]
    # The sampling rows are the last row of each sampling request, in the same order.
    last_rows = [span.stop - 1 for request, span in rows if request.needs_sample]
    assert batch.sample_rows.tolist() == last_rows
    assert batch.sample_requests == [r for r, _ in rows if r.needs_sample]
    assert batch.meta.num_decodes == sum(1 for n in sizes if n == 1)
    assert isinstance(batch.sample_rows, torch.Tensor)


@st.composite
def decode_steps(draw):
    """Decode-only steps: one token each, block ids in any order, some held past the need."""
    scheduled = []
    for i in range(draw(st.integers(1, 8))):
        start = draw(st.integers(0, 40))
        needed = start // BLOCK_SIZE + 1
        extra = draw(st.integers(0, 2))
        block_ids = draw(
            st.lists(st.integers(0, 500), min_size=needed + extra, max_size=needed + extra)
        )
        scheduled.append(
            ScheduledRequest(f"r{i}", [draw(st.integers(0, 49151))], start, block_ids,
                             draw(st.booleans()), SamplingParams(), seed=0)
        )  # fmt: skip
    return scheduled


@settings(max_examples=60, deadline=None)
@given(scheduled=decode_steps(), with_mask=st.booleans())
def test_decode_only_fast_path_equals_the_general_one(scheduled, with_mask):
    """A decode-only step takes `_prepare_decodes`; its batch is what the general path builds."""
    fast = prepare_step(scheduled, BLOCK_SIZE, torch.bfloat16, with_mask)
    general = _prepare_mixed(scheduled, BLOCK_SIZE, torch.bfloat16, with_mask)
    for name in ("input_ids", "positions", "sample_rows"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.requests == general.requests and fast.row_starts == general.row_starts
    assert fast.sample_requests == general.sample_requests
    for name in ("slot_mapping", "decode_block_table", "decode_context_lens"):
        a, b = getattr(fast.meta, name), getattr(general.meta, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.meta.num_decodes == general.meta.num_decodes == len(scheduled)
    assert not fast.meta.prefills and not general.meta.prefills
    if with_mask:
        assert torch.equal(fast.meta.decode_mask, general.meta.decode_mask)
    else:
        assert getattr(fast.meta, "decode_mask", None) is None
