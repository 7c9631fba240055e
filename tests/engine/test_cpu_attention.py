"""The C++ paged decode attention against the torch reference, and its fallbacks.

Shapes come from hypothesis: context lengths at block boundaries (1, block_size - 1,
block_size, block_size + 1, many blocks, past one partition so the split-and-merge path runs),
GQA ratios 1/3/4/8, head dims 64/128, fp32 and bf16. Outputs are poisoned with NaN before each
run, so a row the kernel forgets to write fails the comparison."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention_backends import attention_backend
from engine.kernels.attention_types import AttentionMetadata, PrefillChunk, decode_mask
from engine.kernels.cpu import extend_choice, paged_attention
from engine.layers.attention import TorchPagedAttention
from engine.layers.cpu_attention import CpuPagedAttention
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest
from engine.step_batch import prepare_step


@pytest.fixture(scope="module")
def extension():
    module = paged_attention.load()
    if module is None:
        pytest.skip("the C++ kernel could not be built here (no compiler); fallback tested below")
    return module


def context_lengths(block_size: int):
    partition = paged_attention.PARTITION_TOKENS
    return st.sampled_from(
        [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3, partition + 7]
    ).filter(lambda n: n >= 1)


def decode_case(lens, num_kv_heads, group, head_dim, block_size, dtype, seed):
    """A random pool, block ids drawn at random, q a strided view (like the runner's)."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 2
    kv_cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=gen)
    qkv = torch.randn(len(lens), num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq)
    table = torch.zeros(len(lens), width, dtype=torch.int64)
    for row, count in enumerate(blocks_per_seq):
        table[row, :count] = torch.tensor([free.pop() for _ in range(count)])
    context_lens = torch.tensor(lens, dtype=torch.int64)
    return qkv.to(dtype)[:, :num_heads], kv_cache.to(dtype), table, context_lens


def reference_decode(q, kv_cache, table, context_lens):
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64), num_decodes=q.shape[0],
        decode_block_table=table, decode_context_lens=context_lens,
        decode_mask=decode_mask(context_lens, table.shape[1] * kv_cache.shape[1], q.dtype),
    )  # fmt: skip
    return TorchPagedAttention()._decode(q, kv_cache, meta)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_kernel_matches_reference(extension, data):
    block_size = data.draw(st.sampled_from([4, 16]), "block_size")
    lens = data.draw(st.lists(context_lengths(block_size), min_size=1, max_size=4), "lens")
    num_kv_heads = data.draw(st.sampled_from([1, 2]), "num_kv_heads")
    group = data.draw(st.sampled_from([1, 3, 4, 8]), "group")
    # 64 and 128 run the compile-time specialisations, 80 the generic loop.
    head_dim = data.draw(st.sampled_from([64, 128, 80]), "head_dim")
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]), "dtype")
    seed = data.draw(st.integers(0, 2**16), "seed")
    q, kv_cache, table, context_lens = decode_case(
        lens, num_kv_heads, group, head_dim, block_size, dtype, seed
    )
    out = torch.full(q.shape, float("nan"), dtype=dtype)  # poisoned
    paged_attention.decode(extension, q, kv_cache, table, context_lens, out=out)
    # The kernel computes in fp32 whatever the dtype: compare with the reference in fp32 on the
    # same (rounded) inputs; bf16 output differs by its final rounding only.
    expected = reference_decode(q.float(), kv_cache.float(), table, context_lens)
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_padding_blocks_past_the_context_are_never_read(extension):
    """Table entries past a request's context may name any block (0 pads them): poison them."""
    q, kv_cache, table, context_lens = decode_case([5, 40], 2, 3, 64, 16, torch.float32, 1)
    expected = reference_decode(q, kv_cache, table, context_lens)
    kv_cache[table[0, 1:]] = float("nan")  # request 0 needs only its first block
    kv_cache.view(-1, *kv_cache.shape[2:])[table[0, 0] * 16 + 5 :][:11] = float("nan")
    out = paged_attention.decode(extension, q, kv_cache, table, context_lens)
    assert torch.isfinite(out[0]).all()
    torch.testing.assert_close(out[0], expected[0], rtol=2e-5, atol=2e-5)


def test_kernel_rejects_what_it_cannot_compute(extension):
    q, kv_cache, table, context_lens = decode_case([3], 1, 2, 64, 4, torch.float16, 0)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        paged_attention.decode(extension, q, kv_cache, table, context_lens)
    q, kv_cache, table, context_lens = decode_case([3], 2, 2, 64, 4, torch.float32, 0)
    with pytest.raises(RuntimeError, match="int64"):
        paged_attention.decode(extension, q, kv_cache, table.int(), context_lens)


def mixed_step(block_size, dtype, build_decode_mask, seed=0):
    """Decodes and prefills (fresh and after a cached prefix) in one step."""
    specs = [(5, 1), (0, 1), (block_size, 1), (0, 7), (block_size + 1, 6), (3 * block_size, 1)]
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, num_heads, head_dim = 2, 8, 64
    needed = [-(-(s + n) // block_size) for s, n in specs]
    num_blocks = sum(needed) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    requests = [
        ScheduledRequest(f"r{i}", [1] * n, s, [free.pop() for _ in range(needed[i])], True,
                         SamplingParams(), seed=0)
        for i, (s, n) in enumerate(specs)
    ]  # fmt: skip
    batch = prepare_step(requests, block_size, dtype, build_decode_mask)
    num_tokens = sum(n for _, n in specs)
    kv_cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen)
    return q.to(dtype), kv.to(dtype), kv_cache.to(dtype), batch.meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backend_step_matches_reference(extension, dtype):
    """The whole backend (KV write, kernel decode rows, reference prefill chunks) against the
    reference backend; fp16, which the kernel lacks, goes through the reference."""
    q, kv, cache, meta = mixed_step(4, dtype, build_decode_mask=False)
    assert meta.decode_mask is None
    ours_cache = cache.clone()
    out = CpuPagedAttention(extension).forward(q, kv, ours_cache, meta)
    q, kv, cache, meta = mixed_step(4, dtype, build_decode_mask=True)
    expected = TorchPagedAttention().forward(q, kv, cache, meta)
    assert torch.equal(ours_cache, cache)  # same writes
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_no_compiler_falls_back_to_the_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert paged_attention.compiler() is None
    assert paged_attention.build(tmp_path) is None
    monkeypatch.setattr(paged_attention, "load", lambda: None)
    assert attention_backend("cpu", "auto", "auto", False).name == "torch"  # says why, in the log
    with pytest.raises(RuntimeError, match="did not build"):  # asked for: no silent substitute
        attention_backend("cpu", "auto", "cpu", False)


def test_failed_build_falls_back_to_the_reference(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError("Error building extension")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.delenv("MINI_INFER_KERNEL_BUILD_STRICT", raising=False)
    assert paged_attention.build(tmp_path) is None
    monkeypatch.setenv("MINI_INFER_KERNEL_BUILD_STRICT", "1")  # the suite's setting: it raises
    with pytest.raises(RuntimeError, match="Error building extension"):
        paged_attention.build(tmp_path)


def test_build_flags_follow_the_instruction_set():
    assert "-mavx512f" in paged_attention._ISA_FLAGS["avx512"]
    assert "-mavx2" in paged_attention._ISA_FLAGS["avx2"]
    assert paged_attention._ISA_FLAGS["portable"] == []
    names = {paged_attention.extension_name(isa) for isa in paged_attention._ISA_FLAGS}
    assert len(names) == 3  # one build directory per instruction set


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    paged_attention._remove_stale_lock(tmp_path)
    assert lock.exists()  # another process may be building right now
    old = time.time() - 3600
    os.utime(lock, (old, old))
    paged_attention._remove_stale_lock(tmp_path)
    assert not lock.exists()


def test_a_build_waits_for_a_fresh_lock_until_it_goes_or_turns_stale(tmp_path):
    """A lock left by a build killed moments ago is not stale yet; the builder waits (torch's
    own wait never ends) until it goes (another process finished) or turns stale (removed).
    The clock is the test's: each wait moves it on, nothing sleeps."""
    import os

    from engine.kernels.cpu.extension import wait_for_build_lock

    now = [10_000.0]
    waits = []

    def sleep(seconds):
        waits.append(seconds)
        now[0] += seconds

    lock = tmp_path / "lock"
    lock.touch()
    os.utime(lock, (now[0] - 60, now[0] - 60))  # a build killed a minute ago
    wait_for_build_lock(tmp_path, max_age_s=90, poll_s=5, clock=lambda: now[0], sleep=sleep)
    assert not lock.exists() and sum(waits) == 35  # removed once older than 90 s

    lock.touch()
    os.utime(lock, (now[0], now[0]))  # a build running now, which finishes after 10 waits

    def finishing_sleep(seconds):
        sleep(seconds)
        if len(waits) == 10:
            lock.unlink()

    waits.clear()
    wait_for_build_lock(
        tmp_path, max_age_s=90, poll_s=5, clock=lambda: now[0], sleep=finishing_sleep
    )
    assert len(waits) == 10 and not lock.exists()
    wait_for_build_lock(tmp_path, clock=lambda: now[0], sleep=sleep)  # no lock: no wait
    assert len(waits) == 10


# --- extend: prefill chunks after cached tokens, read in place --------------------------------


def prefix_lengths(block_size: int):
    return st.sampled_from([0, 1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3])


def extend_case(specs, num_kv_heads, group, head_dim, block_size, dtype, seed):
    """Chunks (prefix, new tokens) over a pool whose every slot outside the chunks' contexts
    is NaN, so a read past a context (or into another request's blocks) shows in the output."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    needed = [-(-(p + n) // block_size) for p, n in specs]
    num_blocks = sum(needed) + 2
    kv_cache = torch.full((num_blocks, block_size, 2, num_kv_heads, head_dim), float("nan"))
    flat = kv_cache.view(-1, 2, num_kv_heads, head_dim)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, token_start = [], 1  # row 0 belongs to no chunk
    for (prefix, n), count in zip(specs, needed, strict=True):
        block_ids = torch.tensor([free.pop() for _ in range(count)], dtype=torch.int64)
        positions = torch.arange(prefix + n)
        slots = block_ids[positions // block_size] * block_size + positions % block_size
        flat[slots] = torch.randn(prefix + n, 2, num_kv_heads, head_dim, generator=gen)
        chunks.append(PrefillChunk(token_start, n, prefix, block_ids))
        token_start += n
    qkv = torch.randn(token_start, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    return qkv.to(dtype)[:, :num_heads], kv_cache.to(dtype), chunks


def reference_extend(q, kv_cache, chunk):
    """The chunk through the torch reference: gather its context, causal mask shifted by its
    start position, SDPA."""
    span = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
    num_ctx = chunk.start_position + chunk.num_tokens
    allowed = torch.arange(num_ctx)[None, :] <= torch.arange(chunk.start_position, num_ctx)[:, None]
    chunk = PrefillChunk(
        0, chunk.num_tokens, chunk.start_position, chunk.block_ids,
        torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf")),
    )  # fmt: skip
    return TorchPagedAttention()._prefill(q[span], None, kv_cache, chunk)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_extend_kernel_matches_reference(extension, data):
    block_size = data.draw(st.sampled_from([4, 16]), "block_size")
    specs = data.draw(
        st.lists(st.tuples(prefix_lengths(block_size), st.integers(1, 40)), min_size=1, max_size=4),
        "chunks (prefix, new tokens)",
    )
    num_kv_heads = data.draw(st.sampled_from([1, 2, 3]), "num_kv_heads")
    group = data.draw(st.sampled_from([1, 3, 4, 8]), "group")
    head_dim = data.draw(st.sampled_from([64, 128, 80]), "head_dim")
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]), "dtype")
    query_tile = data.draw(st.sampled_from([None, 1, 5, 16]), "query_tile")
    seed = data.draw(st.integers(0, 2**16), "seed")
    q, kv_cache, chunks = extend_case(specs, num_kv_heads, group, head_dim, block_size, dtype, seed)
    out = torch.full(q.shape, float("nan"), dtype=dtype)  # poisoned
    paged_attention.extend(extension, q, kv_cache, chunks, out, query_tile)
    assert torch.isnan(out[0]).all()  # row 0 (a decode's, say) is no chunk's: left alone
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    for chunk in chunks:
        expected = reference_extend(q.float(), kv_cache.float(), chunk)
        got = out[chunk.token_start : chunk.token_start + chunk.num_tokens].float()
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_mixed_decode_and_extend_step_matches_reference(extension, data):
    """A whole step through the backend (KV write, decode kernel, extend kernel, fresh prefills
    through SDPA) against the reference backend, on the same rounded inputs in fp32."""
    block_size = data.draw(st.sampled_from([4, 16]), "block_size")
    specs = data.draw(
        st.lists(
            st.tuples(prefix_lengths(block_size), st.integers(1, 40)), min_size=1, max_size=5
        ).filter(lambda specs: all(p + n > 1 for p, n in specs)),  # a decode follows a token
        "requests (cached, new tokens)",
    )
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]), "dtype")
    group = data.draw(st.sampled_from([1, 3, 4, 8]), "group")
    seed = data.draw(st.integers(0, 2**16), "seed")
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = 2, 64
    needed = [-(-(p + n) // block_size) for p, n in specs]
    num_blocks = sum(needed) + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    requests = [
        ScheduledRequest(f"r{i}", [1] * n, p, [free.pop() for _ in range(needed[i])], True,
                         SamplingParams(), seed=0)
        for i, (p, n) in enumerate(specs)
    ]  # fmt: skip
    num_tokens = sum(n for _, n in specs)
    cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    ours_cache = cache.clone()
    meta = prepare_step(requests, block_size, dtype, build_decode_mask=False).meta
    out = CpuPagedAttention(extension).forward(q, kv, ours_cache, meta)
    meta = prepare_step(requests, block_size, torch.float32, build_decode_mask=True).meta
    reference_cache = cache.float()
    expected = TorchPagedAttention().forward(q.float(), kv.float(), reference_cache, meta)
    assert torch.equal(ours_cache.float(), reference_cache)  # same writes
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_engine_greedy_tokens_with_prefix_caching_and_chunked_prefill(
    extension, tmp_path, monkeypatch
):
    """End to end on a tiny fp32 model (head_dim 64, 4 query heads per KV head, block 16):
    prompts sharing a prefix, prefilled in chunks of 12 tokens, the second round hitting the
    prefix cache; the C++ backend (its extend kernel seen running) gives the reference
    backend's greedy tokens."""
    from engine import LLM
    from tests.tiny_model import make_tiny_llama

    model_dir = make_tiny_llama(
        tmp_path / "tiny", seed=3, hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=256,
    )  # fmt: skip
    shared = [(7 * i) % 300 + 5 for i in range(37)]  # two full blocks and a bit
    rounds = [
        [shared + [11, 12, 13], shared[:20] + [14] * 9],
        [shared + [21, 22], shared + [23] * 30, shared[:16] + [24]],  # prefix-cache hits
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # Every chunk after cached tokens to the kernel, whatever this machine's calibration says.
    every = extend_choice.ExtendLimits(extend_choice.NO_LIMIT, extend_choice.NO_LIMIT)
    monkeypatch.setattr(extend_choice, "extend_limit", lambda *args: every)
    extend_calls = []
    real_extend = paged_attention.extend
    monkeypatch.setattr(
        paged_attention, "extend",
        lambda *args, **kwargs: extend_calls.append(1) or real_extend(*args, **kwargs),
    )  # fmt: skip

    def tokens(backend: str) -> list[list[int]]:
        llm = LLM(
            model_dir, dtype="float32", attention_backend=backend, block_size=16,
            num_kv_blocks=64, max_num_batched_tokens=12, enable_prefix_caching=True,
        )  # fmt: skip
        return [out.token_ids for prompts in rounds for out in llm.generate(prompts, params)]

    expected = tokens("torch")
    assert not extend_calls
    assert all(len(t) == 12 for t in expected)
    assert tokens("cpu") == expected
    assert extend_calls  # the chunks after the first read the cache through the kernel


def test_extend_dispatch_rule():
    """Fresh prompts never take the extend kernel; bf16 chunks after a prefix always; fp32
    ones up to EXTEND_MAX_TOKENS_FP32 new tokens; fp16 never (the kernel lacks it)."""
    ids = torch.zeros(3, dtype=torch.int64)
    limit = paged_attention.EXTEND_MAX_TOKENS_FP32
    rule = paged_attention.use_extend_kernel
    assert not rule(PrefillChunk(0, 5, 0), torch.bfloat16)
    assert rule(PrefillChunk(0, 500, 20, ids), torch.bfloat16)
    assert rule(PrefillChunk(0, limit, 20, ids), torch.float32)
    assert not rule(PrefillChunk(0, limit + 1, 20, ids), torch.float32)
    assert not rule(PrefillChunk(0, 2, 20, ids), torch.float16)
    # With this machine's calibrated limits: up to them, in either dtype; fresh prompts still
    # not (one limit for both contexts here: extend_choice's tests take them apart).
    def limits(n):
        return extend_choice.ExtendLimits(n, n)

    assert rule(PrefillChunk(0, 4, 20, ids), torch.bfloat16, limits(4))
    assert not rule(PrefillChunk(0, 5, 20, ids), torch.bfloat16, limits(4))
    assert rule(PrefillChunk(0, 64, 20, ids), torch.float32, limits(64))
    assert not rule(PrefillChunk(0, 1, 20, ids), torch.bfloat16, limits(0))
    assert not rule(PrefillChunk(0, 1, 0), torch.bfloat16, limits(4))
    assert not rule(PrefillChunk(0, 1, 20, ids), torch.float16, limits(4))


@pytest.fixture(scope="module", params=["portable", "avx2"])
def narrower_extension(extension, request):
    """The kernels built with no vector flags (what a CPU without AVX2 gets) and with AVX2's
    (its own 8-lane paths): the AVX-512 code paths compiled out, so an AVX-512 CPU tests them
    too. Built once per machine into the cache dir like the native build."""
    from engine.platform import cpu_info

    if request.param == "avx2" and not cpu_info().has("avx2", "fma", "f16c"):
        pytest.skip("this CPU cannot run the AVX2 build")
    module = paged_attention.build(isa=request.param)
    if module is None:
        pytest.skip(f"the {request.param} build failed here")
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_narrower_builds_match_reference(narrower_extension, dtype, head_dim):
    specs = [(0, 7), (1, 1), (15, 3), (16, 16), (17, 40), (83, 5)]
    q, kv_cache, chunks = extend_case(specs, 2, 4, head_dim, 16, dtype, seed=5)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    paged_attention.extend(narrower_extension, q, kv_cache, chunks, out)
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    for chunk in chunks:
        expected = reference_extend(q.float(), kv_cache.float(), chunk)
        got = out[chunk.token_start : chunk.token_start + chunk.num_tokens].float()
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    q, kv_cache, table, context_lens = decode_case([1, 16, 17, 600], 2, 4, head_dim, 16, dtype, 5)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    paged_attention.decode(narrower_extension, q, kv_cache, table, context_lens, out=out)
    expected = reference_decode(q.float(), kv_cache.float(), table, context_lens)
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_extend_kernel_rejects_what_it_cannot_compute(extension):
    q, kv_cache, chunks = extend_case([(16, 4)], 2, 2, 64, 16, torch.float32, seed=0)
    out = torch.empty(q.shape)
    narrow = PrefillChunk(chunks[0].token_start, 4, 16, chunks[0].block_ids[:1])
    with pytest.raises(RuntimeError, match="block_table too narrow"):
        paged_attention.extend(extension, q, kv_cache, [narrow], out)
    outside = PrefillChunk(q.shape[0] - 2, 4, 16, chunks[0].block_ids)
    with pytest.raises(RuntimeError, match="outside q"):
        paged_attention.extend(extension, q, kv_cache, [outside], out)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        paged_attention.extend(extension, q.half(), kv_cache.half(), chunks, out.half())


def _copied_build(cache: Path) -> str:
    """This machine's paged-attention build (its directory, as the cache holds it) copied
    under `cache`; its name. Skips where it cannot be built."""
    import shutil

    built = paged_attention.load()
    if built is None:
        pytest.skip("the C++ kernel could not be built here (no compiler)")
    name = paged_attention.extension_name(paged_attention.cpu_info().vector_isa)
    shutil.copytree(Path(built.__file__).parent, cache / name)
    return name


def test_no_compiler_imports_a_library_prebuilt_from_the_same_source(tmp_path, monkeypatch):
    """A container image builds its kernels at image build time and ships no compiler: the
    library built into the cache is imported; one built from another source is not."""
    from engine.kernels.cpu import extension

    image_cache = tmp_path / "torch_extensions"
    name = _copied_build(image_cache)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert extension.compiler() is None
    prebuilt = paged_attention.build(image_cache)
    assert prebuilt is not None and prebuilt.__spec__.origin.startswith(str(image_cache / name))
    assert hasattr(prebuilt, "paged_attention_decode")
    (image_cache / name / paged_attention.SOURCE.name).write_text("// another source\n")
    assert paged_attention.build(image_cache) is None  # stale: fall back, never load it


def test_a_build_with_other_flags_or_another_torch_is_not_imported(tmp_path):
    """A library is imported without torch's builder only when its stamp matches what this
    start would build: the same flags, torch and Python. Anything else goes to the builder
    (which rebuilds it), never to a library built for something else."""
    import json

    from engine.kernels.cpu import extension

    cache = tmp_path / "torch_extensions"
    name = _copied_build(cache)
    stamp = json.loads((cache / name / extension.STAMP).read_text())

    def imported():
        return extension._import_prebuilt(
            name, paged_attention.SOURCE, cache / name, stamp["flags"]
        )

    assert hasattr(imported(), "paged_attention_decode")
    for changed in ({"flags": [*stamp["flags"], "-DOTHER"]}, {"torch": "0.0"}, {"python": "x"}):
        (cache / name / extension.STAMP).write_text(json.dumps({**stamp, **changed}))
        assert imported() is None, changed
    (cache / name / extension.STAMP).write_text("[not a stamp")
    assert imported() is None
    # A damaged library (its own file: the one imported above stays mapped): built again.
    (cache / name / "damaged.so").write_bytes(b"not a library")
    (cache / name / extension.STAMP).write_text(json.dumps({**stamp, "library": "damaged.so"}))
    assert imported() is None


def test_a_start_with_built_kernels_does_not_import_the_builder():
    """torch's extension builder brings setuptools and distutils in (4.3 MiB of RSS): a start
    whose kernels are built imports them directly."""
    import json
    import subprocess
    import sys

    from engine.kernels.cpu import prebuild

    if not all(prebuild.load_all().values()):  # built (and stamped) here first, if need be
        pytest.skip("the C++ kernels could not be built here (no compiler)")
    code = (
        "import json, sys; from engine.kernels.cpu import prebuild; loaded = prebuild.load_all(); "
        "print(json.dumps([loaded, [m for m in ('torch.utils.cpp_extension', 'setuptools') "
        "if m in sys.modules]]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()
    loaded, builder = json.loads(out.splitlines()[-1])
    assert all(loaded.values()), loaded  # every kernel loaded
    assert builder == []  # and neither the builder nor setuptools came with them


def test_prebuild_compiles_every_instruction_set(monkeypatch):
    """The image's build stage compiles for every CPU the image may meet, not its own; a
    failed build fails it. On a machine (`make install`), a kernel that cannot build is not an
    error: it has a fallback."""
    from engine.kernels.cpu import bf16_gemm, decode_step, fused_ops, prebuild, quant_gemm

    asked = {"paged_attention": [], "fused_ops": []}
    for kernel in (paged_attention, fused_ops):
        name = kernel.__name__.rsplit(".", 1)[1]
        monkeypatch.setattr(
            kernel, "build", lambda isa, name=name: asked[name].append(isa) or object()
        )
    monkeypatch.setattr(bf16_gemm, "build", lambda: object())
    monkeypatch.setattr(decode_step, "build", lambda: object())
    monkeypatch.setattr(quant_gemm, "build", lambda: None)  # this one fails
    built = prebuild.prebuild_all()
    assert sorted(asked["paged_attention"]) == ["avx2", "avx512", "portable"]
    assert sorted(asked["fused_ops"]) == ["avx2", "avx512", "portable"]
    assert built["quant_gemm"] is False and built["bf16_gemm"] is True
    assert built["decode_step"] is True
    monkeypatch.setattr("sys.argv", ["prebuild"])
    assert prebuild.main() == 1
    for kernel in (paged_attention, fused_ops, bf16_gemm, decode_step):
        monkeypatch.setattr(kernel, "load", lambda: object())
    monkeypatch.setattr(quant_gemm, "load", lambda: None)
    monkeypatch.setattr("sys.argv", ["prebuild", "--this-machine"])
    assert prebuild.main() == 0
