"""The oracle: the engine's greedy output equals Hugging Face transformers' greedy `generate`,
token for token, in fp32. Keep these tests forever.

Covered: mixed prompt lengths in one batch, prompts spanning many blocks, chunked prefill on
and off, prefix caching on and off, a pool so small that preemption must happen, and a few
prompts on the real default model.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.hf_reference import hf_model
from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("oracle-llama"), seed=1, max_position_embeddings=512)


@functools.cache
def _hf(path):
    return hf_model(path)


def hf_greedy(path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = _hf(str(path))
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
    return out[0, len(prompt_ids):].tolist()


def _prompts(n: int, vocab: int, seed: int, lengths=(1, 3, 17, 40, 70)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def _check(llm: LLM, path, prompts, max_tokens=12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(path, prompt, max_tokens), f"prompt of {len(prompt)} tokens"
    return outs


@pytest.mark.parametrize(
    "options",
    [
        dict(),  # defaults: chunked prefill and prefix caching on
        dict(enable_chunked_prefill=False, enable_prefix_caching=False),
        dict(max_num_batched_tokens=16),  # long prompts are prefilled in chunks
        dict(max_num_batched_tokens=16, max_num_seqs=2),
    ],
    ids=["default", "no-chunk-no-cache", "chunked-16", "chunked-16-2seqs"],
)
def test_mixed_batch_matches_hf(tiny_dir, options):
    llm = LLM(tiny_dir, block_size=4, **options)
    prompts = _prompts(6, llm.engine.vocab_size, seed=7)
    _check(llm, tiny_dir, prompts)
    stats = llm.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total


def test_prefix_sharing_matches_hf_and_reuses_blocks(tiny_dir):
    llm = LLM(tiny_dir, block_size=4)
    system = _prompts(1, llm.engine.vocab_size, seed=3, lengths=(37,))[0]
    prompts = [system + tail for tail in _prompts(4, llm.engine.vocab_size, seed=4, lengths=(2, 5, 9))]
    _check(llm, tiny_dir, prompts[:1])  # warm the cache with the shared prefix
    outs = _check(llm, tiny_dir, prompts[1:])
    assert all(o.num_cached_tokens >= 36 for o in outs)
    assert llm.get_stats().num_tokens_reused > 0


def test_preemption_under_tiny_pool_matches_hf(tiny_dir):
    # 12 blocks of 4 tokens: six requests of up to 70 + 12 tokens cannot all stay resident.
    llm = LLM(tiny_dir, block_size=4, num_kv_blocks=24, max_num_batched_tokens=32)
    prompts = _prompts(6, llm.engine.vocab_size, seed=11, lengths=(20, 33, 45, 8, 60, 27))
    _check(llm, tiny_dir, prompts, max_tokens=16)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert stats.num_blocks_free == stats.num_blocks_total


def test_text_prompts_and_finish_reasons(tiny_dir):
    llm = LLM(tiny_dir)
    out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=5, temperature=0))[0]
    assert out.finish_reason in ("length", "stop")
    assert out.token_ids == hf_greedy(tiny_dir, llm.tokenizer.encode("The quick brown fox"), 5)[: len(out.token_ids)]
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.real_model
def test_real_model_matches_hf():
    # The default runs int4/bf16; fp32 without quantization is the HF-exact path (the GGUF
    # dequantized in memory, as transformers does).
    llm = LLM("smollm2-135m", dtype="float32", quantization=None, num_kv_blocks=64)
    assert llm.engine.runner.quant is None and llm.engine.dtype == torch.float32
    tok = llm.tokenizer
    chats = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
        for c in chats
    ]
    ids = [tok.encode(p) for p in prompts]
    outs = llm.generate(ids, SamplingParams(max_tokens=24, temperature=0.0))
    for prompt_ids, out in zip(ids, outs, strict=True):
        assert out.token_ids == hf_greedy(llm.model_path, prompt_ids, 24)
    assert "Paris" in outs[0].text
