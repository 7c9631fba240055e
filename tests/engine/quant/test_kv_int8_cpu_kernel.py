"""The C++ decode kernel over the int8 KV cache against the torch reference: it must read
codes and their per-token, per-head scales in place (a K/V row multiplied by another token's or
head's scale, or a slot past the context, changes the output; unused slots carry NaN scales so
a stray read turns it NaN), and the engine on the C++ backend must give the torch int8 path's
greedy tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.kernels.attention_types import Int8KVCache
from engine.kernels.cpu import paged_attention
from engine.quant.kv_int8 import dequantize_kv, quantize_kv
from tests.engine.test_cpu_attention import decode_case, reference_decode


@pytest.fixture(scope="module")
def extension():
    module = paged_attention.load()
    if module is None:
        pytest.skip("the C++ kernel could not be built here (no compiler)")
    return module


def int8_pool(kv_cache: torch.Tensor, table: torch.Tensor, context_lens: torch.Tensor):
    """Quantize a float pool; every slot no sequence uses gets NaN scales (poison)."""
    flat = kv_cache.float().reshape(-1, *kv_cache.shape[2:])
    codes, scales = quantize_kv(flat)
    used = torch.zeros(kv_cache.shape[0], kv_cache.shape[1], dtype=torch.bool)
    for row, n in enumerate(context_lens.tolist()):
        positions = torch.arange(n)
        used[table[row, positions // kv_cache.shape[1]], positions % kv_cache.shape[1]] = True
    scales = scales.view(*kv_cache.shape[:2], *scales.shape[1:]).clone()
    scales[~used] = float("nan")
    return Int8KVCache(codes.view(kv_cache.shape), scales.contiguous())


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_int8_kernel_matches_reference(extension, data):
    block_size = data.draw(st.sampled_from([4, 16]), "block_size")
    partition = paged_attention.PARTITION_TOKENS
    lens = data.draw(
        st.lists(st.sampled_from([1, block_size - 1, block_size, block_size + 1,
                                  5 * block_size + 3, partition + 7]).filter(lambda n: n >= 1),
                 min_size=1, max_size=4),
        "lens",
    )  # fmt: skip
    num_kv_heads = data.draw(st.sampled_from([1, 2, 3]), "num_kv_heads")
    group = data.draw(st.sampled_from([1, 3, 4, 8]), "group")
    head_dim = data.draw(st.sampled_from([64, 128, 80]), "head_dim")
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]), "dtype")
    seed = data.draw(st.integers(0, 2**16), "seed")
    q, kv_cache, table, context_lens = decode_case(
        lens, num_kv_heads, group, head_dim, block_size, torch.float32, seed
    )
    pool = int8_pool(kv_cache, table, context_lens)
    q = q.to(dtype)
    out = paged_attention.decode_int8(extension, q, pool, table, context_lens)
    # The kernel dequantizes in fp32: the reference on the fp32-dequantized pool.
    dequantized = dequantize_kv(pool.codes, torch.nan_to_num(pool.scales), torch.float32)
    expected = reference_decode(q.float(), dequantized, table, context_lens)
    assert torch.isfinite(out).all()
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_engine_on_the_cpu_kernel_matches_the_torch_int8_path(tiny_model_dir):
    prompts = ["The quick brown fox jumps over the lazy dog.", "Kafka streams prompts to workers"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def generate(backend):
        llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="int8",
                  attention_backend=backend, block_size=4, num_kv_blocks=64)  # fmt: skip
        name = llm.engine.runner.attention.name
        return name, [o.token_ids for o in llm.generate(prompts, params)]

    reference_name, expected = generate("torch")
    kernel_name, got = generate("cpu")
    assert (reference_name, kernel_name) == ("torch-int8kv", "cpu-int8kv")
    assert got == expected


def empty_int8_pool(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
    """A pool whose every code is 99 and every scale NaN: a slot the store must not touch
    keeps them."""
    codes = torch.full((num_blocks, block_size, 2, num_kv_heads, head_dim), 99, dtype=torch.int8)
    scales = torch.full((num_blocks, block_size, 2, num_kv_heads), float("nan"))
    return Int8KVCache(codes, scales)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_kernels_store_writes_the_references_codes_and_scales(extension, data):
    """`store_int8` quantizes new K/V rows into their slots with `quantize_kv`'s bits, codes and
    scales, in float32 and bfloat16: rows of every magnitude, all-zero rows (the 1e-12 floor),
    values half a step from a code (round half to even); every other slot untouched."""
    num_blocks, block_size = 3, data.draw(st.sampled_from([1, 4, 16]), "block_size")
    num_kv_heads = data.draw(st.integers(1, 3), "num_kv_heads")
    head_dim = data.draw(st.sampled_from([1, 8, 64, 80]), "head_dim")
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]), "dtype")
    num_slots = num_blocks * block_size
    slots = data.draw(
        st.lists(st.integers(0, num_slots - 1), min_size=0, max_size=num_slots, unique=True),
        "slots",
    )
    shape = (len(slots), 2, num_kv_heads, head_dim)
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), "seed"))
    kv = torch.randn(shape, generator=generator) * data.draw(
        st.sampled_from([1e-30, 1e-3, 1.0, 1e4]), "magnitude"
    )
    if slots and data.draw(st.booleans(), "with ties"):  # x / scale = k + 0.5 exactly
        kv[0, 0, 0, :] = 0.0
        kv[0, 0, 0, 0] = 127.0
        if head_dim > 1:
            kv[0, 0, 0, 1] = 2.5
    if slots and data.draw(st.booleans(), "with a zero row"):
        kv[-1, 1, -1, :] = 0.0
    kv = kv.to(dtype)
    slots_t = torch.tensor(slots, dtype=torch.int64)
    ours = empty_int8_pool(num_blocks, block_size, num_kv_heads, head_dim)
    paged_attention.store_int8(extension, kv, ours, slots_t)
    reference = empty_int8_pool(num_blocks, block_size, num_kv_heads, head_dim)
    codes, scales = quantize_kv(kv)
    reference.codes.view(num_slots, 2, num_kv_heads, head_dim)[slots_t] = codes
    reference.scales.view(num_slots, 2, num_kv_heads)[slots_t] = scales
    assert torch.equal(ours.codes, reference.codes)
    assert torch.equal(ours.scales.isnan(), reference.scales.isnan())
    written = ~reference.scales.isnan()
    assert torch.equal(
        ours.scales[written].view(torch.int32), reference.scales[written].view(torch.int32)
    )


def test_a_slot_outside_the_pool_is_refused_before_anything_is_written(extension):
    pool = empty_int8_pool(2, 4, 1, 8)
    kv = torch.ones(2, 2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the pool"):
        paged_attention.store_int8(extension, kv, pool, torch.tensor([3, 8]))
    assert (pool.codes == 99).all() and pool.scales.isnan().all()
