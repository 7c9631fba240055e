"""The oracle for every registered non-Llama family: greedy fp32 output equals HF's `generate`
token for token on a tiny random checkpoint (tests/tiny_archs.py), through the paged,
prefix-cached, chunked-prefill and preempting paths and each attention backend; the weight-only
quantized engine equals HF running the dequantized weights."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.kernels.cpu import quant_gemm
from engine.quant.config import QuantConfig
from tests.engine.quant.test_linear import _dequantized_hf
from tests.engine.test_llm_oracle import _prompts, hf_greedy
from tests.hf_reference import hf_greedy_continuation
from tests.tiny_archs import make_tiny_family

FAMILIES = ["qwen3", "phi3", "gemma2", "gemma3_text"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    return make_tiny_family(
        tmp_path_factory.mktemp(f"oracle-{request.param}"), request.param, seed=2,
        max_position_embeddings=512,
    )  # fmt: skip


def _check(llm: LLM, path, prompts, max_tokens=12):
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    for prompt, out in zip(prompts, outs, strict=True):
        expected = hf_greedy(path, prompt, max_tokens)
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens"
    return outs


@pytest.mark.parametrize(
    "options",
    [
        dict(),  # defaults: chunked prefill, prefix caching, the "auto" attention backend
        dict(attention_backend="torch", enable_chunked_prefill=False, enable_prefix_caching=False),
        dict(max_num_batched_tokens=16),  # long prompts are prefilled in chunks
        dict(attention_backend="torch", max_num_batched_tokens=16, max_num_seqs=2),
    ],
    ids=["default", "torch-no-chunk-no-cache", "chunked-16", "torch-chunked-16-2seqs"],
)
def test_mixed_batch_matches_hf(family_dir, options):
    llm = LLM(family_dir, block_size=4, dtype="float32", **options)
    _check(llm, family_dir, _prompts(6, llm.engine.vocab_size, seed=7))
    stats = llm.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total


def test_prefix_sharing_and_preemption_match_hf(family_dir):
    llm = LLM(
        family_dir, block_size=4, dtype="float32", num_kv_blocks=24, max_num_batched_tokens=32
    )
    vocab = llm.engine.vocab_size
    system = _prompts(1, vocab, seed=3, lengths=(37,))[0]
    shared = [system + tail for tail in _prompts(3, vocab, seed=4, lengths=(2, 5, 9))]
    _check(llm, family_dir, shared[:1])  # warm the cache with the shared prefix
    outs = _check(llm, family_dir, shared[1:])
    assert all(o.num_cached_tokens >= 36 for o in outs)
    _check(llm, family_dir, _prompts(6, vocab, seed=11, lengths=(20, 33, 45, 8, 60, 27)), 16)
    assert llm.get_stats().num_preemptions > 0


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_weight_only_quantized_matches_hf_on_dequantized_weights(
    family_dir, spec, tmp_path, monkeypatch
):
    quant_gemm.load()  # built under the real cache dir, not once more in the private one
    monkeypatch.setenv("MINI_INFER_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(family_dir, quantization=spec, dtype="float32", num_kv_blocks=64)
    hf = _dequantized_hf(family_dir, QuantConfig.parse(spec))
    prompts = [[5, 9, 30, 41, 7], list(range(3, 40)), [11]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy_continuation(hf, prompt, 10)


def test_phi3_long_rope_matches_hf(tmp_path):
    """Phi-3's "longrope": short factors while a sequence stays within
    original_max_position_embeddings (64 here), long ones for a prompt beyond it, prefilled
    in one chunk (HF's own regimes; engine/models/phi3.py says why crossing differs)."""
    rng = random.Random(0)
    rope = {
        "rope_type": "longrope", "rope_theta": 10000.0,
        "short_factor": [1 + rng.random() for _ in range(8)],  # head_dim 16: 8 frequencies
        "long_factor": [2 + 3 * rng.random() for _ in range(8)],
    }  # fmt: skip
    path = make_tiny_family(
        tmp_path / "phi3-longrope", "phi3", seed=2, max_position_embeddings=256,
        original_max_position_embeddings=64, rope_parameters=rope,
    )  # fmt: skip
    llm = LLM(path, dtype="float32", enable_chunked_prefill=False, max_num_batched_tokens=256)
    vocab = llm.engine.vocab_size
    _check(llm, path, _prompts(3, vocab, seed=5, lengths=(3, 20, 40)), max_tokens=12)
    for prompt in _prompts(3, vocab, seed=6, lengths=(70, 90, 100)):  # one at a time
        _check(llm, path, [prompt], max_tokens=8)


def test_llama3_rope_scaling_matches_hf(tmp_path):
    """Llama 3.x's "llama3" rope scaling, computed by HF's own rope functions."""
    rope = {
        "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
    }  # fmt: skip
    path = make_tiny_family(tmp_path / "llama3", "llama", seed=4, rope_parameters=rope)
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16)
    _check(llm, path, _prompts(4, llm.engine.vocab_size, seed=8, lengths=(5, 40, 70)))
