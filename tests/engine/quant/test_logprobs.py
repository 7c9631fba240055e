"""Logprobs (vLLM's `logprobs` / `prompt_logprobs`) against Hugging Face's log-softmax on the
tiny fp32 model, including chunked prefill, preemption and prefix caching. Tolerance 1e-4:
the engine computes the same fp32 logits as HF up to summation order."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.tiny_model import make_tiny_llama

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("logprob-llama"), seed=6)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def _hf_log_softmax(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # [len, vocab]: row i predicts token i + 1


def _check_position(entry, row: torch.Tensor, actual: int, k: int):
    top = row.topk(k)
    expected_ids = set(top.indices.tolist()) | {actual}
    assert set(entry) == expected_ids
    for token_id, logprob in entry.items():
        assert abs(logprob.logprob - float(row[token_id])) < TOLERANCE
    assert entry[actual].rank == int((row > row[actual]).sum()) + 1


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(max_num_batched_tokens=8),  # prompts in chunks of 8
        dict(num_kv_blocks=10, block_size=4, max_num_batched_tokens=64),  # preemption
    ],
)
def test_logprobs_equal_hf_log_softmax(tiny_dir, hf, options):
    llm = LLM(tiny_dir, **options)
    prompts = [list(range(3, 3 + n)) for n in (1, 5, 19)] + [[7, 8, 9, 7, 8, 9, 30, 31]]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2)
    outs = llm.generate(prompts, params)
    if "num_kv_blocks" in options:
        assert llm.get_stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        full = prompt + out.token_ids
        rows = _hf_log_softmax(hf, full)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            _check_position(out.prompt_logprobs[i], rows[i - 1], prompt[i], 2)
        assert len(out.logprobs) == len(out.token_ids)
        for j, token in enumerate(out.token_ids):
            _check_position(out.logprobs[j], rows[len(prompt) + j - 1], token, 3)
            assert out.logprobs[j][token].rank == 1  # greedy picks the top token


def test_prompt_logprobs_bypass_prefix_cache(tiny_dir, hf):
    llm = LLM(tiny_dir, block_size=4)
    prompt = list(range(3, 23))
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))  # caches the prefix
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    rows = _hf_log_softmax(hf, prompt)
    entries = out[0].prompt_logprobs
    assert all(entries[i] is not None for i in range(1, len(prompt)))
    for i in range(1, len(prompt)):
        assert set(entries[i]) == {prompt[i]}
        assert abs(entries[i][prompt[i]].logprob - float(rows[i - 1, prompt[i]])) < TOLERANCE


def test_no_logprobs_unless_asked_and_bad_values_refused(tiny_dir):
    out = LLM(tiny_dir).generate([[3, 4, 5]], SamplingParams(max_tokens=2, temperature=0.0))
    assert out[0].logprobs is None and out[0].prompt_logprobs is None
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
