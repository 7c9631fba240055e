"""Sliding-window and soft-capped attention on the torch backend against HF's own pieces: its
sliding-window mask rule and Gemma 2's eager attention, per request on dense K/V, for mixed
steps of decodes and prefill chunks after cached prefixes (hypothesis-drawn)."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from engine.layers.attention import TorchPagedAttention
from engine.layers.sliding_window import full_attention_metadata, sliding_window_metadata
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest
from engine.step_batch import prepare_step

HEAD_DIM = 8


def hf_dense(q, keys, values, start, window, scale, softcap):
    """HF's Gemma 2 eager attention for one request: q [n, heads, d] at positions start..,
    keys/values [ctx, kv_heads, d]; window None: causal only."""
    positions = torch.arange(start, start + q.shape[0])
    if window is None:
        allowed = torch.arange(keys.shape[0])[None, :] <= positions[:, None]
    else:
        rule = sliding_window_causal_mask_function(window)
        zero = torch.tensor(0)
        allowed = rule(zero, zero, positions[:, None], torch.arange(keys.shape[0])[None, :])
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    module = types.SimpleNamespace(
        num_key_value_groups=q.shape[1] // keys.shape[1], head_dim=HEAD_DIM, training=False
    )
    out, _ = eager_attention_forward(
        module, q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        mask[None, None], scaling=scale, softcap=softcap,
    )  # fmt: skip
    return out[0]  # [n, heads, d]


@settings(max_examples=25, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.integers(0, 30), st.integers(1, 12)), min_size=1, max_size=4
    ),  # (start position, new tokens) per request
    window=st.integers(1, 20) | st.none(),
    softcap=st.sampled_from([None, 0.5, 50.0]),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_windowed_softcapped_paged_attention_equals_hf(specs, window, softcap, block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, scale = 4, 2, 0.3
    needed = [-(-(s + n) // block_size) for s, n in specs]
    free = torch.randperm(sum(needed) + 2, generator=gen).tolist()
    kv_cache = torch.randn(sum(needed) + 2, block_size, 2, num_kv_heads, HEAD_DIM, generator=gen)
    requests = [
        ScheduledRequest(
            f"r{i}",
            [1] * n,
            s,
            [free.pop() for _ in range(needed[i])],
            True,
            SamplingParams(),
            seed=0,
        )  # fmt: skip
        for i, (s, n) in enumerate(specs)
    ]
    batch = prepare_step(requests, block_size, build_decode_mask=False)
    meta = full_attention_metadata(batch.meta, block_size, torch.float32)
    if window is not None:
        meta = sliding_window_metadata(meta, window, block_size, torch.float32)
    num_tokens = sum(n for _, n in specs)
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen)
    kv = torch.randn(num_tokens, 2, num_kv_heads, HEAD_DIM, generator=gen)
    out = TorchPagedAttention(scale=scale, softcap=softcap).forward(q, kv, kv_cache, meta)
    flat = kv_cache.view(-1, 2, num_kv_heads, HEAD_DIM)
    row = 0
    for request in batch.sample_requests:  # the runner's row order
        start, n = request.start_position, len(request.token_ids)
        slots = [request.block_ids[p // block_size] * block_size + p % block_size
                 for p in range(start + n)]  # fmt: skip
        context = flat[slots]  # the prefix and, written by forward, the new rows
        expected = hf_dense(q[row : row + n], context[:, 0], context[:, 1], start, window,
                            scale, softcap)  # fmt: skip
        torch.testing.assert_close(out[row : row + n], expected, atol=1e-5, rtol=1e-5)
        row += n


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    from tests.tiny_archs import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("gemma2"), "gemma2", max_position_embeddings=64)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(kv_cache_dtype="int8"), "int8 KV cache"),
        (dict(attention_backend="triton"), "Triton kernels"),
    ],
)
def test_gemma_refuses_kernels_without_window_or_softcap(gemma2_dir, options, message):
    from engine import LLM

    with pytest.raises(ValueError, match=message):
        LLM(gemma2_dir, dtype="float32", num_kv_blocks=8, **options)


def test_gemma_falls_back_to_the_reference_backend_and_eager_mode(gemma2_dir):
    from engine import LLM

    llm = LLM(gemma2_dir, dtype="float32", num_kv_blocks=8, attention_backend="cpu", compile="on")
    assert not llm.engine.runner.is_compiled
    backends = {type(m.backend) for m in llm.engine.runner.model.modules() if hasattr(m, "backend")}
    assert backends == {TorchPagedAttention}
