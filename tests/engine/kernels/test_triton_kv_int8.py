"""The int8 KV cache through the Triton kernels (interpreter): quantize-on-store writes exactly
the codes and scales of the torch path's `quantize_kv`, the attention kernels read int8 codes
as the reference dequantizes them, and the backend and the whole engine agree with the torch
int8 backend. Guards against a GPU path that silently ignores `kv_cache_dtype="int8"` or
quantizes differently from the CPU path (a prefix block shared between them would then decode
to other values)."""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.kernels.attention_types import Int8KVCache
from engine.kernels.triton.attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from engine.kernels.triton.backend import TritonPagedAttention
from engine.kernels.triton.kv_store import store_kv_int8
from engine.quant.kv_int8 import Int8PagedAttention, quantize_kv
from tests.engine.kernels.triton_cases import (
    DEVICE,
    TOLERANCES,
    context_len,
    mixed_step,
    paged_cache,
)

KINDS = ["one", "below", "at", "above", "many"]
DTYPES = [torch.float32, torch.bfloat16]


def int8_cache(lens, block_size, num_kv_heads, head_dim, generator):
    """A poisoned paged cache (NaN outside the used slots) turned into int8 codes + scales: the
    NaN slots get scale NaN, so a kernel reading one turns its output NaN."""
    cache, tables = paged_cache(lens, block_size, num_kv_heads, head_dim, torch.float32, generator)
    flat = cache.view(-1, 2, num_kv_heads, head_dim)
    codes, scales = quantize_kv(torch.nan_to_num(flat))
    scales[flat.isnan().any(-1)] = float("nan")
    return codes.view(cache.shape), scales.view(cache.shape[:-1]).contiguous(), tables


@settings(max_examples=8, deadline=None)
@given(
    num_tokens=st.integers(1, 6),
    num_kv_heads=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
@example(2, 3, 64, torch.float32, 0.0, 0)  # an all-zero row: the 1e-12 floor of the scale
def test_store_int8_matches_quantize_kv(num_tokens, num_kv_heads, head_dim, dtype, magnitude, seed):
    generator = torch.Generator().manual_seed(seed)
    num_blocks, block_size = 4, 16
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[0] = -1  # a padding row writes nothing
    qkv = torch.randn(num_tokens, 7, num_kv_heads, head_dim, generator=generator) * magnitude
    kv = qkv.to(dtype).to(DEVICE)[:, 3:5]  # a strided view, like the fused projection's
    codes = torch.full((num_blocks, block_size, 2, num_kv_heads, head_dim), 99, dtype=torch.int8)
    scales = torch.full((num_blocks, block_size, 2, num_kv_heads), float("nan"))
    codes, scales = codes.to(DEVICE), scales.to(DEVICE)
    store_kv_int8(kv, codes, scales, slots.to(DEVICE))

    expected_codes, expected_scales = quantize_kv(kv[1:])
    written = slots[1:].to(DEVICE)
    assert torch.equal(codes.view(-1, 2, num_kv_heads, head_dim)[written], expected_codes)
    assert torch.equal(scales.view(-1, 2, num_kv_heads)[written], expected_scales)
    # and that is amax / 127 correctly rounded, on every device (tests/engine/quant/test_kv_int8.py)
    amax = kv[1:].float().abs().amax(-1).clamp_min(1e-12)  # the float32 amax, floored
    exact = (amax.double() / 127.0).float()  # its quotient by 127, correctly rounded
    assert torch.equal(expected_scales, exact)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[1:]] = False
    assert (codes.view(-1, 2, num_kv_heads, head_dim)[untouched.to(DEVICE)] == 99).all()
    assert scales.view(-1, 2, num_kv_heads)[untouched.to(DEVICE)].isnan().all()


@settings(max_examples=5, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3),
    group=st.sampled_from([1, 3, 4, 8]),
    head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    num_splits=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 2**16),
)
@example(KINDS, 3, 64, torch.float32, 4, 0)  # every block boundary, split-K
def test_decode_reads_int8(kinds, group, head_dim, dtype, num_splits, seed):
    generator = torch.Generator().manual_seed(seed)
    block_size, num_kv_heads = 16, 2
    lens = [context_len(k, block_size) for k in kinds]
    codes, scales, tables = int8_cache(lens, block_size, num_kv_heads, head_dim, generator)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=generator)
    q = q.to(dtype).to(DEVICE)
    context_lens = torch.tensor(lens, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    paged_decode_attention(
        q, codes, tables, context_lens, scale, out=out, num_splits=num_splits, kv_scales=scales
    )
    expected = paged_decode_attention_ref(q, codes, tables, context_lens, scale, scales)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


@settings(max_examples=4, deadline=None)
@given(
    chunks=st.lists(
        st.tuples(st.sampled_from([0, 1, 15, 16, 17]), st.sampled_from([1, 2, 17, 40])),
        min_size=1,
        max_size=3,
    ),
    group=st.sampled_from([1, 3, 4]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
@example([(0, 40), (17, 15), (16, 1)], 3, torch.float32, 0)
def test_prefill_reads_int8(chunks, group, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    block_size, num_kv_heads, head_dim = 16, 1, 64
    lens = [prefix + n for prefix, n in chunks]
    codes, scales, tables = int8_cache(lens, block_size, num_kv_heads, head_dim, generator)
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
    paged_prefill_attention(
        q, codes, tables, cu_seqlens, prefix_lens, max_len, scale, out, kv_scales=scales
    )
    expected = paged_prefill_attention_ref(
        q, codes, tables, cu_seqlens, prefix_lens, scale, scales
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


def test_backend_matches_torch_int8_backend_on_a_mixed_step():
    """Decodes at block boundaries, a fresh prefill and extends after cached prefixes, with the
    runner's own metadata: the same output and the same codes and scales in the pool."""
    gen = torch.Generator().manual_seed(0)
    block_size, num_kv_heads, head_dim = 16, 2, 64
    batch, q, kv, num_blocks = mixed_step(gen, block_size, 6, num_kv_heads, head_dim)
    prefix = torch.randn(num_blocks * block_size, 2, num_kv_heads, head_dim, generator=gen)
    codes, scales = quantize_kv(prefix)
    shape = (num_blocks, block_size, 2, num_kv_heads)
    torch_pool = Int8KVCache(codes.view(*shape, head_dim).clone(), scales.view(shape).clone())
    triton_pool = Int8KVCache(codes.view(*shape, head_dim).clone(), scales.view(shape).clone())

    expected = Int8PagedAttention().forward(q, kv, torch_pool, batch.meta)
    out = TritonPagedAttention().forward(q, kv, triton_pool, batch.meta)

    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    assert torch.equal(triton_pool.codes, torch_pool.codes)
    assert torch.equal(triton_pool.scales, torch_pool.scales)


def test_engine_with_triton_and_int8_kv_matches_torch_int8(tiny_model_dir):
    """The whole engine, fp32, int8 KV cache: Triton kernels give the torch path's greedy
    tokens across chunked prefill after a cached prefix and a prefix-cache hit."""
    prompts = ["The quick brown fox jumps over the lazy dog.", "Kafka streams prompts to workers"]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    def generate(backend):
        llm = LLM(
            str(tiny_model_dir), attention_backend=backend, kv_cache_dtype="int8", block_size=4,
            num_kv_blocks=48, max_num_batched_tokens=8, dtype="float32",
        )  # fmt: skip
        assert llm.engine.runner.attention.name == {"torch": "torch-int8kv"}.get(backend, backend)
        first = [o.token_ids for o in llm.generate(prompts, params)]
        return first + [o.token_ids for o in llm.generate(prompts[:1], params)]

    expected = generate("torch")
    assert all(len(tokens) == 5 for tokens in expected)
    assert generate("triton") == expected
