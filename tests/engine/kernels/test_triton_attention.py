"""Triton paged attention (interpreter) against its torch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.kernels.triton.attention import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from tests.engine.kernels.triton_cases import DEVICE, TOLERANCES, context_len, paged_cache

KINDS = ["one", "below", "at", "above", "many"]
DTYPES = [torch.float32, torch.bfloat16]


def run_decode(lens, group, num_kv_heads, head_dim, block_size, dtype, num_splits, seed):
    generator = torch.Generator().manual_seed(seed)
    cache, tables = paged_cache(lens, block_size, num_kv_heads, head_dim, dtype, generator)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=generator)
    q = q.to(dtype).to(DEVICE)
    context_lens = torch.tensor(lens, device=DEVICE)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    scale = head_dim**-0.5
    paged_decode_attention(q, cache, tables, context_lens, scale, out=out, num_splits=num_splits)
    expected = paged_decode_attention_ref(q, cache, tables, context_lens, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


@settings(max_examples=6, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3),
    group=st.sampled_from([1, 3, 4, 8]),
    num_kv_heads=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    num_splits=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 2**16),
)
@example(KINDS, 3, 2, 64, torch.float32, 4, 0)  # every boundary, split-K
@example(KINDS, 8, 1, 128, torch.bfloat16, 1, 1)  # every boundary, one split, bf16
def test_decode_matches_reference(kinds, group, num_kv_heads, head_dim, dtype, num_splits, seed):
    block_size = 16
    lens = [context_len(k, block_size) for k in kinds]
    run_decode(lens, group, num_kv_heads, head_dim, block_size, dtype, num_splits, seed)


def test_decode_odd_block_size_and_zero_length_row():
    """A non-power-of-two block size; a zero-length row (CUDA-graph padding) gives zeros."""
    generator = torch.Generator().manual_seed(3)
    lens, block_size = [7, 0, 12], 5
    cache, tables = paged_cache([7, 1, 12], block_size, 2, 64, torch.float32, generator)
    q = torch.randn(3, 8, 64, generator=generator).to(DEVICE)
    context_lens = torch.tensor(lens, device=DEVICE)
    for num_splits in (1, 2):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, cache, tables, context_lens, 0.125, out, num_splits)
        expected = paged_decode_attention_ref(q, cache, tables, context_lens, 0.125)
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
        assert (out[1] == 0).all()


def test_num_splits_fill_the_machine_and_never_exceed_the_tiles():
    assert choose_num_splits(64, 8, 32768, 132) == 1  # 512 programs already fill 132 SMs
    assert choose_num_splits(1, 3, 32768, 132) == 64  # capped
    assert choose_num_splits(1, 3, 64, 132) == 1  # one key tile: nothing to split
    assert choose_num_splits(2, 3, 4096, 132) == 44  # about two waves: 2 * 3 * 44 >= 264


def prefill_case(chunks, group, num_kv_heads, head_dim, block_size, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    lens = [prefix + n for prefix, n in chunks]
    cache, tables = paged_cache(lens, block_size, num_kv_heads, head_dim, dtype, generator)
    offsets = [0]
    for _, n in chunks:
        offsets.append(offsets[-1] + n)
    q = torch.randn(offsets[-1], num_kv_heads * group, head_dim, generator=generator)
    q = q.to(dtype).to(DEVICE)
    cu_seqlens = torch.tensor(offsets, device=DEVICE)
    prefix_lens = torch.tensor([prefix for prefix, _ in chunks], device=DEVICE)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    max_len = max(n for _, n in chunks)
    paged_prefill_attention(q, cache, tables, cu_seqlens, prefix_lens, max_len, scale, out)
    expected = paged_prefill_attention_ref(q, cache, tables, cu_seqlens, prefix_lens, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


@settings(max_examples=5, deadline=None)
@given(
    chunks=st.lists(
        st.tuples(st.sampled_from([0, 1, 15, 16, 17]), st.sampled_from([1, 2, 15, 17, 40])),
        min_size=1,
        max_size=3,
    ),
    group=st.sampled_from([1, 3, 4, 8]),
    head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
@example([(0, 40), (17, 15), (16, 1)], 3, 64, torch.float32, 0)  # fresh, extend, 1 token
@example([(1, 17), (15, 2)], 4, 128, torch.bfloat16, 1)
def test_prefill_matches_reference(chunks, group, head_dim, dtype, seed):
    prefill_case(chunks, group, 1, head_dim, 16, dtype, seed)


def test_prefill_two_kv_heads_odd_block_size():
    prefill_case([(0, 9), (7, 6)], 2, 2, 64, 3, torch.float32, 5)


def test_mismatched_heads_rejected():
    q = torch.zeros(1, 5, 64)
    cache = torch.zeros(2, 16, 2, 2, 64)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q, cache, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1), 1.0)
