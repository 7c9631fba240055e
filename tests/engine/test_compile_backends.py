"""The compiled step over the other attention paths: the int8 KV cache (which once crashed at
load with compile="on": the compiled model was handed per-layer caches only the float pool
set up) and the Triton kernels (interpreter), each giving its eager path's greedy tokens
across chunked prefill after a cached prefix, batched decodes and a prefix-cache hit."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Kafka streams prompts to workers"]


def generate(model_dir, **options) -> list[list[int]]:
    llm = LLM(
        str(model_dir), dtype="float32", block_size=4, num_kv_blocks=64,
        max_num_batched_tokens=8, **options,
    )  # fmt: skip
    assert llm.engine.runner.is_compiled == (options["compile"] == "on")
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    return first + [o.token_ids for o in llm.generate(PROMPTS[:1], params)]


@pytest.mark.parametrize(
    "options",
    [{"kv_cache_dtype": "int8"}, {"attention_backend": "triton"}],
    ids=["int8-kv", "triton"],
)
def test_compiled_matches_eager(tiny_model_dir, options):
    eager = generate(tiny_model_dir, compile="off", **options)
    assert all(len(tokens) == 5 for tokens in eager)
    assert generate(tiny_model_dir, compile="on", **options) == eager
