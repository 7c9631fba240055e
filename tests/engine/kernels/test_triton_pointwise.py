"""Triton KV store, fused add+RMSNorm, RoPE and SiLU*mul (interpreter) against torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels.triton.kv_store import store_kv, store_kv_ref
from engine.kernels.triton.pointwise import (
    rms_norm,
    rms_norm_ref,
    rotary_,
    rotary_ref_,
    silu_and_mul,
    silu_and_mul_ref,
)
from tests.engine.kernels.triton_cases import DEVICE, POINTWISE_TOLERANCES

DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, generator, dtype):
    return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)


@settings(max_examples=6, deadline=None)
@given(
    num_tokens=st.integers(1, 6),
    num_kv_heads=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_store_writes_exactly_its_slots(num_tokens, num_kv_heads, head_dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    num_blocks, block_size = 4, 16
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[0] = -1  # a padding row writes nothing
    qkv = randn(num_tokens, 7, num_kv_heads, head_dim, generator=generator, dtype=dtype)
    kv = qkv[:, 3:5]  # a strided view, like the fused projection's
    cache = torch.full(
        (num_blocks, block_size, 2, num_kv_heads, head_dim), float("nan"), dtype=dtype
    ).to(DEVICE)
    expected = cache.clone()
    store_kv(kv, cache, slots.to(DEVICE))
    store_kv_ref(kv, expected, slots.to(DEVICE))
    torch.testing.assert_close(cache, expected, atol=0, rtol=0, equal_nan=True)


@settings(max_examples=6, deadline=None)
@given(
    num_tokens=st.integers(1, 5),
    hidden=st.sampled_from([64, 576, 1000]),
    has_residual=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rms_norm(num_tokens, hidden, has_residual, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    x = randn(num_tokens, hidden, generator=generator, dtype=dtype)
    weight = randn(hidden, generator=generator, dtype=dtype)
    residual = randn(num_tokens, hidden, generator=generator, dtype=dtype) if has_residual else None
    got = rms_norm(x, weight, 1e-5, residual)
    expected = rms_norm_ref(x, weight, 1e-5, residual)
    if not has_residual:
        got, expected = (got,), (expected,)
    for g, e in zip(got, expected, strict=True):
        assert torch.isfinite(g).all()  # fresh outputs: every element written
        torch.testing.assert_close(g, e, **POINTWISE_TOLERANCES[dtype])


@settings(max_examples=6, deadline=None)
@given(
    num_tokens=st.integers(1, 5),
    num_heads=st.sampled_from([(4, 2), (9, 3), (24, 8)]),
    head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rotary_in_place_on_q_and_k_only(num_tokens, num_heads, head_dim, dtype, seed):
    """q and k are rotated through a view of the fused q/k/v output; v is left alone."""
    generator = torch.Generator().manual_seed(seed)
    q_heads, kv_heads = num_heads
    qkv = randn(num_tokens, q_heads + 2 * kv_heads, head_dim, generator=generator, dtype=dtype)
    angles = torch.rand(num_tokens, 1, head_dim // 2, generator=generator) * 6.3
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype).to(DEVICE)
    sin = angles.sin()
    signed_sin = torch.cat([-sin, sin], -1).to(dtype).to(DEVICE)
    expected = qkv.clone()
    rotary_ref_(expected[:, : q_heads + kv_heads], cos, signed_sin)
    got = qkv.clone()
    assert rotary_(got[:, : q_heads + kv_heads], cos, signed_sin).data_ptr() == got.data_ptr()
    torch.testing.assert_close(got, expected, **POINTWISE_TOLERANCES[dtype])
    assert torch.equal(got[:, q_heads + kv_heads :], qkv[:, q_heads + kv_heads :])


@settings(max_examples=6, deadline=None)
@given(
    num_tokens=st.integers(1, 5),
    size=st.sampled_from([128, 1536, 1000]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_silu_and_mul(num_tokens, size, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    gate_up = randn(num_tokens, 2 * size, generator=generator, dtype=dtype) * 3
    gate, up = gate_up[:, :size], gate_up[:, size:]
    got = silu_and_mul(gate, up)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, silu_and_mul_ref(gate, up), **POINTWISE_TOLERANCES[dtype])


def test_bad_shapes_rejected():
    with pytest.raises(ValueError, match="same-shape"):
        silu_and_mul(torch.zeros(2, 4, device=DEVICE), torch.zeros(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="even head_dim"):
        x = torch.zeros(1, 1, 5, device=DEVICE)
        rotary_(x, torch.zeros(1, 1, 5, device=DEVICE), torch.zeros(1, 1, 5, device=DEVICE))
