"""After a large step (a burst of prompts), the runner hands the heap's free pages back once,
before the next step; decode steps alone never trim (they keep their pages for speed)."""

import pytest

from engine import LLM, SamplingParams, model_runner


@pytest.fixture
def trims(monkeypatch):
    calls = []
    monkeypatch.setattr(model_runner, "trim_heap", lambda: calls.append(1))
    return calls


def test_a_large_step_is_followed_by_one_trim(tiny_model_dir, trims):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=128)
    trims.clear()  # loading trims too
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[5] * 8, [7] * 9], params)  # small prefill, then decodes
    assert trims == []
    prompt = list(range(3, 3 + model_runner.TRIM_AFTER_TOKENS))
    (out,) = llm.generate([prompt], params)  # one large prefill step, then 3 decode steps
    assert len(out.token_ids) == 4 and trims == [1]
