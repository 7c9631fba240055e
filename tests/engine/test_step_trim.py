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


def test_the_first_fused_decode_step_after_per_operator_steps_trims_once(tiny_model_dir, trims):
    """The fused decode step allocates nothing: before the first of them after steps on the
    per-operator path (a prefill, whatever its size), the heap is trimmed once; the decode
    steps after it do not trim. Without the fused step, small prefills do not trim."""
    fused = LLM(str(tiny_model_dir), dtype="bfloat16", quantization="int4", num_kv_blocks=128)
    assert fused.engine.runner.fused_decode is None  # the fused step runs
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    trims.clear()
    fused.generate([[5] * 8, [7] * 9], params)  # one prefill step, then 5 fused decode steps
    assert trims == [1]
    fused.generate([[9] * 5], params)
    assert trims == [1, 1]
    off = LLM(str(tiny_model_dir), dtype="bfloat16", quantization="int4", num_kv_blocks=128,
              fused_decode="off")  # fmt: skip
    trims.clear()
    off.generate([[5] * 8, [7] * 9], params)
    assert trims == []
