"""Paged attention (torch backend) against dense per-request attention on random caches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention_backends import attention_backend
from engine.layers import attention as attention_module
from engine.layers.attention import TorchPagedAttention
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest
from engine.step_batch import prepare_step


def dense_attention(q, keys, values, start_position):
    """q [n, heads, d] at positions start.., keys/values [ctx, kv_heads, d] -> [n, heads, d]."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1).double()
    values = values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("nhd,chd->hnc", q.double(), keys) / q.shape[-1] ** 0.5
    query_positions = torch.arange(start_position, start_position + q.shape[0])
    allowed = torch.arange(keys.shape[0])[None, :] <= query_positions[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), values)


def run_case(specs, num_heads, num_kv_heads, block_size, seed=0, max_gather_bytes=16 << 20):
    """specs: (start_position, num_new_tokens) per request. Block ids are drawn at random from
    the pool (shuffled), prefix slots hold random "cached" K/V.
    Returns (out, expected, written K, new K)."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = 8
    blocks_needed = [-(-(s + n) // block_size) for s, n in specs]
    num_blocks = sum(blocks_needed) + 3
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    kv_cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=gen)
    requests = []
    for i, (start, num_new) in enumerate(specs):
        ids = [free_blocks.pop() for _ in range(blocks_needed[i])]
        requests.append(
            ScheduledRequest(f"r{i}", [1] * num_new, start, ids, True, SamplingParams(), seed=0)
        )
    batch = prepare_step(requests, block_size)
    order = [r.request_id for r in batch.sample_requests]  # rows follow the runner's order
    num_tokens = sum(n for _, n in specs)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    # Expected: each request's full K/V = cached prefix + its new rows.
    flat_k, flat_v = kv_cache.view(-1, 2, num_kv_heads, head_dim).unbind(1)
    expected = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float64)
    row = 0
    by_id = {r.request_id: r for r in requests}
    for request_id in order:
        request = by_id[request_id]
        start, n = request.start_position, len(request.token_ids)
        prefix_slots = [
            request.block_ids[p // block_size] * block_size + p % block_size for p in range(start)
        ]
        keys = torch.cat([flat_k[prefix_slots], k[row : row + n]])
        values = torch.cat([flat_v[prefix_slots], v[row : row + n]])
        expected[row : row + n] = dense_attention(q[row : row + n], keys, values, start)
        row += n
    backend = TorchPagedAttention(max_gather_bytes=max_gather_bytes)
    out = backend.forward(q, torch.stack((k, v), dim=1), kv_cache, batch.meta)
    torch.testing.assert_close(flat_v[batch.meta.slot_mapping], v)
    return out, expected, flat_k[batch.meta.slot_mapping], k


@pytest.mark.parametrize("max_gather_bytes", [16 << 20, 1], ids=["one-chunk", "row-by-row"])
def test_decodes_and_prefills_match_dense_attention(max_gather_bytes):
    specs = [(5, 1), (0, 1), (17, 1), (0, 7), (9, 6), (3, 1)]
    out, expected, written, k = run_case(
        specs, 4, 2, block_size=4, max_gather_bytes=max_gather_bytes
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(written, k)  # every new token's K landed in its slot


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=6),
    kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 3]),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_property(specs, kv_heads, group, block_size, seed):
    out, expected, written, k = run_case(specs, kv_heads * group, kv_heads, block_size, seed)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(written, k)


def test_backend_selection(monkeypatch):
    from engine.kernels.cpu import paged_attention

    kernel = "cpu" if paged_attention.load() is not None else "torch"
    assert attention_backend("cpu", "auto", "auto", False).name == kernel
    if kernel == "cpu":
        assert attention_backend("cpu", "auto", "cpu", False).name == "cpu"
    assert attention_backend("cpu", "auto", "torch", False).name == "torch"
    if not torch.cuda.is_available():  # Triton on CPU only in its interpreter
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            attention_backend("cpu", "auto", "triton", False)
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention_backend("cpu", "auto", "flash", False)


@settings(max_examples=40, deadline=None)
@given(
    num_tokens=st.integers(1, 70), cached=st.integers(1, 300), group=st.sampled_from([1, 3]),
    num_kv_heads=st.integers(1, 3), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_a_chunk_after_cached_tokens_split_in_two_attentions_is_the_masked_one(
    num_tokens, cached, group, num_kv_heads, dtype, seed
):
    """`prefill_sdpa(..., cached=c)`: the cached part without a mask and the chunk's own part
    causally, merged by their log-sum-exps, gives the one masked call's result within a
    rounding of the dtype (GQA included)."""
    from engine.layers.attention import prefill_sdpa

    g = torch.Generator().manual_seed(seed)
    num_ctx = cached + num_tokens
    q = (torch.randn(num_tokens, group * num_kv_heads, 32, generator=g) * 2).to(dtype)
    kv = (torch.randn(num_ctx, 2, num_kv_heads, 32, generator=g) * 2).to(dtype)
    allowed = torch.arange(num_ctx)[None, :] <= torch.arange(cached, num_ctx)[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    want = prefill_sdpa(q, kv, mask).float()
    with pytest.MonkeyPatch.context() as patch:  # every length split, not only long chunks
        patch.setattr(attention_module, "SPLIT_MIN_TOKENS", 1)
        got = prefill_sdpa(q, kv, mask, cached=cached).float()
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7 * want.abs().max().item() + 1e-3
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= tolerance


def test_only_the_plain_causal_mask_is_split():
    """step_batch marks a chunk after cached tokens as plain causal; a windowed copy of it is
    not (its mask holds out cached positions too), nor is a fresh prompt's chunk."""
    from engine.layers.sliding_window import sliding_window_metadata

    block = 4
    requests = [
        ScheduledRequest("a", list(range(6)), 8, [0, 1, 2, 3], False, SamplingParams(), 0),
        ScheduledRequest("b", list(range(5)), 0, [4, 5], True, SamplingParams(), 0),
    ]
    meta = prepare_step(requests, block, torch.float32).meta
    after, fresh = meta.prefills
    assert after.causal and after.start_position == 8 and not fresh.causal
    windowed = sliding_window_metadata(meta, 3, block, torch.float32)
    assert not any(chunk.causal for chunk in windowed.prefills)


def test_short_chunks_stay_one_masked_call(monkeypatch):
    """Below SPLIT_MIN_TOKENS new tokens the masked call runs as before (the split's two calls
    cost more there); from it on, the split."""
    from engine.layers.attention import SPLIT_MIN_TOKENS, prefill_sdpa

    calls = []
    monkeypatch.setattr(attention_module, "_prefill_split", lambda *args: calls.append(args))
    for num_tokens in (SPLIT_MIN_TOKENS - 1, SPLIT_MIN_TOKENS):
        q, kv = torch.randn(num_tokens, 2, 8), torch.randn(num_tokens + 5, 2, 1, 8)
        allowed = torch.arange(num_tokens + 5)[None, :] <= torch.arange(5, num_tokens + 5)[:, None]
        mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        prefill_sdpa(q, kv, mask, cached=5)
    assert len(calls) == 1 and calls[0][0].shape[0] == SPLIT_MIN_TOKENS
