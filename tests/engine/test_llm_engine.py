"""LLMEngine behaviour on a tiny random model: validation, streaming, abort, seeds, stops."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, LLMEngine, SamplingParams
from engine.config import EngineConfig
from tests.engine.smaps import mapping_field
from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(
        tmp_path_factory.mktemp("engine-llama"), seed=2, max_position_embeddings=128
    )


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return LLMEngine(tiny_dir, block_size=4, num_kv_blocks=64)


def _drain(eng: LLMEngine) -> dict[str, list]:
    deltas: dict[str, list] = {}
    for _ in range(10_000):
        if not eng.has_unfinished_requests():
            break
        for d in eng.step():
            deltas.setdefault(d.request_id, []).append(d)
    assert not eng.has_unfinished_requests()
    return deltas


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-5), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-1), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(stop=[""]), "stop"),
        (dict(seed=-1), "seed"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@settings(max_examples=100, deadline=None)
@given(
    max_tokens=st.integers(-10, 1 << 40),
    top_p=st.one_of(st.floats(-1, 2), st.just(float("nan"))),
    temperature=st.one_of(st.floats(-5, 200), st.just(float("nan"))),
    top_k=st.integers(-5, 100),
)
def test_sampling_params_valid_or_value_error(max_tokens, top_p, temperature, top_k):
    try:
        p = SamplingParams(max_tokens=max_tokens, top_p=top_p, temperature=temperature, top_k=top_k)
    except ValueError:
        return
    assert p.max_tokens >= 1 and 0 < p.top_p <= 1 and p.top_k >= -1


def test_invalid_prompts_raise_and_leak_nothing(engine):
    free = engine.get_stats().num_blocks_free
    for prompt, match in [
        ("", "empty"),
        ([], "empty"),
        ([10**9], "not in"),
        ([1] * 200, "context"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", prompt, SamplingParams())
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already"):
        engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    _drain(engine)
    assert engine.get_stats().num_blocks_free == free


def test_request_that_can_never_fit_the_pool_is_refused(tiny_dir):
    small = LLMEngine(tiny_dir, block_size=4, num_kv_blocks=16)  # 64 tokens < max_model_len 128
    with pytest.raises(ValueError, match="KV blocks"):
        small.add_request("huge", [1] * 10, SamplingParams(max_tokens=100))
    small.add_request("fits", [1] * 10, SamplingParams(max_tokens=54))
    assert small.has_unfinished_requests()


def test_stream_deltas_concatenate_to_generate_output(tiny_dir, engine):
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=5)
    engine.add_request("s", "Kafka streams", params)
    deltas = _drain(engine)["s"]
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
    out = LLM(tiny_dir, block_size=4, num_kv_blocks=64).generate(["Kafka streams"], params)[0]
    assert "".join(d.text for d in deltas) == out.text
    assert [t for d in deltas for t in d.token_ids] == out.token_ids


def test_abort_frees_blocks_at_once(engine):
    total = engine.get_stats().num_blocks_total
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.get_stats().num_blocks_free < total
    assert engine.abort_request("a")
    assert not engine.abort_request("a")
    assert engine.get_stats().num_blocks_free == total
    assert engine.step() == [] and not engine.has_unfinished_requests()


def test_seeded_sampling_is_independent_of_the_batch(tiny_dir):
    llm = LLM(tiny_dir, block_size=4, num_kv_blocks=64)
    target = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], target)[0].token_ids
    crowd = [[9, 8, 7, 6], [5, 6, 7], [1, 2], [40, 41, 42, 43, 44]]
    others = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    outs = llm.generate(crowd, [others, target, others, others])
    assert outs[1].token_ids == alone
    different = llm.generate(
        [[5, 6, 7]],
        SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=99, ignore_eos=True),
    )[0].token_ids
    assert different != alone  # the seed matters (a 16-token collision is vanishingly unlikely)


def test_stop_token_ids_and_max_tokens(tiny_dir):
    llm = LLM(tiny_dir, block_size=4, num_kv_blocks=64)
    free_run = llm.generate(
        [[7, 8, 9]], SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    )[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 12
    stop_at = free_run.token_ids[5]
    first = free_run.token_ids.index(stop_at)
    out = llm.generate(
        [[7, 8, 9]],
        SamplingParams(
            max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, stop_token_ids=[stop_at]
        ),
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == free_run.token_ids[: first + 1]


def test_stop_string_is_cut_from_text(tiny_dir):
    llm = LLM(tiny_dir, block_size=4, num_kv_blocks=64)
    params = dict(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    free_run = llm.generate([[7, 8, 9]], SamplingParams(**params))[0]
    text = free_run.text
    assert len(text) >= 6, text
    stop = text[3:6]
    out = llm.generate([[7, 8, 9]], SamplingParams(**params, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dropped_engine_frees_weights_and_kv_pool_without_the_cyclic_gc(tiny_dir, dtype):
    import gc
    import weakref

    gc.collect()
    gc.disable()  # only reference counting may free it
    try:
        eng = LLMEngine(tiny_dir, dtype=dtype, block_size=4, num_kv_blocks=64)
        eng.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0))
        _drain(eng)
        layer = eng.runner.model.model.layers[0]
        alive = [
            weakref.ref(layer.self_attn.qkv_proj),  # a Linear with a loader
            weakref.ref(eng.runner.model.model.embed_tokens.weight),
            weakref.ref(eng.runner.kv_cache),
        ]
        del eng, layer
        assert [r() is None for r in alive] == [True, True, True]
    finally:
        gc.enable()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("prefault", [False, True])
def test_kv_pool_is_committed_on_use_or_at_start_up(tiny_dir, prefault):
    """The pool's own pages (mincore), not the process's RSS: the engine also hands library
    pages back while it starts (engine/library_pages.py), which would hide a committed pool."""
    pool_bytes = 96 << 20
    # Enough sequences that the pool is sized by the budget, not by what they can use.
    eng = LLMEngine(
        tiny_dir, kv_cache_memory_bytes=pool_bytes, kv_cache_prefault=prefault, max_num_seqs=4096
    )
    resident = _resident_bytes(eng.runner.kv_cache)
    assert eng.runner.kv_cache_bytes > pool_bytes * 0.9
    if prefault:
        assert resident >= eng.runner.kv_cache_bytes * 0.95
    else:  # a tiny model and untouched blocks: a small fraction of the pool
        assert resident < pool_bytes // 3
    eng.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(_drain(eng)["r"]) == 4


def _mapping_flags(address: int) -> set[str]:
    """The VmFlags of the mapping holding `address` ("nh" = MADV_NOHUGEPAGE, "hg" =
    MADV_HUGEPAGE)."""
    return set(mapping_field(address, "VmFlags").split())


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s pages that are in memory (mincore)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    start = tensor.data_ptr() & ~4095
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = (ctypes.c_ubyte * ((length + 4095) // 4096))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages) == 0
    return 4096 * sum(page & 1 for page in pages)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_lazy_kv_pool_commits_small_pages_per_block(tiny_dir, kv_cache_dtype):
    """A block is a few KiB in each layer's slice: with transparent huge pages its first write
    would commit 2 MiB in every layer. The lazy pool asks for none; a prefaulted one may."""
    eng = LLMEngine(
        tiny_dir, kv_cache_memory_bytes=64 << 20, max_num_seqs=4096,
        kv_cache_dtype=kv_cache_dtype, dtype="float32", quantization=None,
    )  # fmt: skip
    pools = [eng.runner.kv_cache] + (
        [eng.runner.kv_cache_scales] if kv_cache_dtype == "int8" else []
    )
    assert all("nh" in _mapping_flags(pool.data_ptr()) for pool in pools)
    assert sum(_resident_bytes(pool) for pool in pools) == 0
    eng.add_request("r", list(range(1, 21)), SamplingParams(max_tokens=4, temperature=0.0))
    assert len(_drain(eng)["r"]) == 4
    # 24 tokens: 2 blocks of 16 in each layer's slice, at most one partial page either side.
    num_layers, num_blocks = eng.runner.kv_cache.shape[:2]
    block_bytes = [pool.numel() * pool.element_size() // num_layers // num_blocks for pool in pools]
    bound = sum(num_layers * (2 * b + 2 * 4096) for b in block_bytes)
    assert 0 < sum(_resident_bytes(pool) for pool in pools) <= bound
    prefaulted = LLMEngine(tiny_dir, num_kv_blocks=16, kv_cache_prefault=True)
    assert "nh" not in _mapping_flags(prefaulted.runner.kv_cache.data_ptr())


def test_device_choice_on_a_machine_without_cuda(tiny_model_dir, monkeypatch):
    """`device="auto"` runs on the CPU where torch sees no GPU, and `device="cuda"` there is a
    clear error, not a crash deep in the runner."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine = LLMEngine(str(tiny_model_dir), num_kv_blocks=16)
    assert type(engine.runner).__name__ == "ModelRunner"
    with pytest.raises(ValueError, match="no CUDA GPU"):
        LLMEngine(str(tiny_model_dir), device="cuda", num_kv_blocks=16)
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device="tpu")
