"""The whole engine through the Triton attention backend (interpreter on CPU) gives the torch
path's greedy tokens, across fresh prefills, chunked prefill after a cached prefix, a prefix
cache hit, and batched decodes whose split-K path runs."""

from __future__ import annotations

from engine import LLM, SamplingParams
from engine.kernels.triton import attention

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Kafka streams prompts to workers",
    "Paged attention keeps the KV cache in fixed-size blocks; the quick brown fox jumps",
]


def generate(model_dir, backend: str) -> list[list[int]]:
    llm = LLM(
        str(model_dir),
        attention_backend=backend,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=16,  # longer prompts are prefilled in chunks (extend)
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    again = [o.token_ids for o in llm.generate(PROMPTS[:1], params)]  # prefix-cache hit
    return first + again


def test_triton_engine_matches_torch_greedy(tiny_model_dir, monkeypatch):
    expected = generate(tiny_model_dir, "torch")
    assert all(len(tokens) == 6 for tokens in expected)
    # 16-key tiles: these 20-40 token contexts then span several tiles, so decodes split.
    monkeypatch.setattr(attention, "_DECODE_BLOCK_N", 16)
    split_counts = []
    choose = attention.choose_num_splits
    monkeypatch.setattr(
        attention,
        "choose_num_splits",
        lambda *args: split_counts.append(choose(*args)) or split_counts[-1],
    )
    assert generate(tiny_model_dir, "triton") == expected
    assert max(split_counts) > 1
