"""SamplingParams.n > 1: n samples of one prompt that share its KV blocks (tiny random Llama)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine import LLM, LLMEngine, SamplingParams
from engine.sampling_params import MAX_NUM_SAMPLES, StructuredOutput
from tests.tiny_model import make_tiny_llama

PROMPT = list(range(3, 22))  # 19 tokens: four full blocks of 4 and a partial one


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(
        tmp_path_factory.mktemp("samples-llama"), seed=3, max_position_embeddings=128
    )


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32", quantization=None, block_size=4, num_kv_blocks=64)


@pytest.fixture(scope="module")
def small(tiny_dir):
    """A pool too small for four long samples at once: some are preempted and resumed."""
    return LLMEngine(tiny_dir, dtype="float32", quantization=None, block_size=4, num_kv_blocks=16)


def _assert_pool_whole(engine: LLMEngine) -> None:
    engine.scheduler.kv.pool.check_invariants()
    stats = engine.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    assert not engine.has_unfinished_requests() and not engine._samples
    assert engine.scheduler.num_held == 0 and not engine._detokenizers


@pytest.mark.parametrize("n", [0, -1, MAX_NUM_SAMPLES + 1, 2.0, True, "2", None])
def test_invalid_n_is_a_clear_value_error(n):
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 16\]"):
        SamplingParams(n=n)


@settings(max_examples=50, deadline=None)
@given(n=st.one_of(st.integers(-5, 40), st.floats(allow_nan=True), st.booleans()))
def test_n_is_valid_or_a_value_error(n):
    try:
        params = SamplingParams(n=n)
    except ValueError as error:
        assert "n must be" in str(error)
        return
    assert type(params.n) is int and 1 <= params.n <= MAX_NUM_SAMPLES


def test_greedy_samples_equal_the_single_completion(llm):
    params = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = llm.generate(PROMPT, SamplingParams(**params))[0]
    many = llm.generate(PROMPT, SamplingParams(**params, n=4))[0]
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    for choice in many.choices:
        assert choice.token_ids == one.token_ids and choice.text == one.text
        assert choice.finish_reason == "length"
    # n=1 keeps its shape: the output's own fields, and one choice that repeats them.
    assert (many.token_ids, many.text) == (one.token_ids, one.text)
    assert len(one.choices) == 1 and one.choices[0].token_ids == one.token_ids
    _assert_pool_whole(llm.engine)


def test_sample_i_draws_from_seed_plus_i(llm):
    params = dict(max_tokens=10, temperature=1.0, top_k=50, ignore_eos=True)
    many = llm.generate(PROMPT, SamplingParams(**params, seed=40, n=3))[0]
    for i, choice in enumerate(many.choices):
        alone = llm.generate(PROMPT, SamplingParams(**params, seed=40 + i))[0]
        assert choice.token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in many.choices}) > 1  # distinct streams
    # The seed wraps at 2**63, as the seed field does.
    top = llm.generate(PROMPT, SamplingParams(**params, seed=2**63 - 1, n=2))[0]
    wrapped = llm.generate(PROMPT, SamplingParams(**params, seed=0))[0]
    assert top.choices[1].token_ids == wrapped.token_ids


def test_the_prompt_is_computed_once_and_its_blocks_are_shared(tiny_dir):
    engine = LLMEngine(
        tiny_dir, dtype="float32", quantization=None, block_size=4, num_kv_blocks=64,
        max_num_batched_tokens=8,
    )  # fmt: skip
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=3, temperature=0.0, n=3))
    sched = engine.scheduler
    assert sched.num_held == 2
    while sched.requests["r"].num_computed_tokens < len(PROMPT):  # prefill in chunks of 8
        assert sched.num_held == 2 and [r.request_id for r in sched.running] in ([], ["r"])
        engine.step()
    assert sched.num_held == 0  # released once the leader's prompt is in the cache
    engine.step()  # the two samples join: four cached blocks each, their last partial block
    samples = [sched.requests[f"r\x1f{i}"] for i in (1, 2)]
    assert [s.num_cached_tokens for s in samples] == [16, 16]
    tables = [sched.kv.block_ids(r.request_id) for r in [sched.requests["r"], *samples]]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]  # one copy of the prompt's blocks
    assert all(sched.kv.pool.blocks[b].ref_count == 3 for b in tables[0][:4])
    assert len({t[4] for t in tables}) == 3  # each sample writes its own tail
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().num_tokens_computed == len(PROMPT) + 2 * 3 + 3 * 2
    _assert_pool_whole(engine)


def test_deltas_carry_the_request_id_and_choice_index(llm):
    engine = llm.engine
    engine.add_request(
        "d", PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=1, n=3, ignore_eos=True)
    )
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
    assert {d.request_id for d in deltas} == {"d"}
    for i in range(3):
        mine = [d for d in deltas if d.index == i]
        assert len(mine) == 5 and mine[-1].finished and not any(d.finished for d in mine[:-1])
    assert [d.is_request_finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    _assert_pool_whole(engine)


def test_abort_takes_every_sample_and_only_the_callers_id_aborts(llm):
    engine = llm.engine
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True, n=3))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("a", [5, 6], SamplingParams())
    for _ in range(4):
        engine.step()
    assert not engine.abort_request("a\x1f1")  # a sample's internal id is not a request id
    assert engine.abort_request("a") and not engine.abort_request("a")
    assert engine.step() == []
    _assert_pool_whole(engine)


def test_each_sample_has_its_own_grammar(llm):
    colours = ["red", "green", "blue", "yellow", "purple"]
    params = SamplingParams(
        max_tokens=16, temperature=1.0, seed=9, n=4,
        structured_output=StructuredOutput("choice", colours),
    )  # fmt: skip
    out = llm.generate(["The quick brown fox"], params)[0]
    assert all(c.text in colours and c.finish_reason == "stop" for c in out.choices)
    _assert_pool_whole(llm.engine)


def test_prompt_logprobs_come_once_and_logprobs_per_sample(llm):
    params = SamplingParams(
        max_tokens=4, temperature=1.0, seed=2, n=2, logprobs=2, prompt_logprobs=1, ignore_eos=True
    )
    out = llm.generate(PROMPT, params)[0]
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    for choice in out.choices:
        assert len(choice.logprobs) == 4
        assert all(t in entry for t, entry in zip(choice.token_ids, choice.logprobs, strict=True))
    _assert_pool_whole(llm.engine)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 4),
    max_tokens=st.integers(1, 24),
    prompt_len=st.integers(1, 30),
    abort_after=st.one_of(st.none(), st.integers(0, 30)),
    seed=st.integers(0, 1000),
)
@example(n=4, max_tokens=24, prompt_len=30, abort_after=None, seed=0)  # preempts
@example(n=3, max_tokens=1, prompt_len=8, abort_after=None, seed=0)  # done at prefill
@example(n=2, max_tokens=10, prompt_len=9, abort_after=0, seed=0)  # aborted while held
def test_samples_survive_preemption_and_abort_leaks_nothing(
    small, llm, n, max_tokens, prompt_len, abort_after, seed
):
    prompt = [(7 * i + seed) % 380 + 3 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, n=n, ignore_eos=True)
    small.add_request("h", prompt, params)
    tokens: dict[int, list[int]] = {i: [] for i in range(n)}
    num_preemptions = small.get_stats().num_preemptions
    num_steps = 0
    while small.has_unfinished_requests():
        if num_steps == abort_after:
            assert small.abort_request("h")
            break
        for d in small.step():
            tokens[d.index].extend(d.token_ids)
        num_steps += 1
    _assert_pool_whole(small)
    if abort_after is not None and num_steps == abort_after:
        return
    if (n, max_tokens, prompt_len) == (4, 24, 30):  # 7 shared + 4 x 7 own blocks: > 16
        assert small.get_stats().num_preemptions > num_preemptions
    # Preempted or not, each sample is the n=1 completion of its seed (on a roomy engine).
    for i in range(n):
        alone = llm.generate(prompt, SamplingParams(**{**_kwargs(params), "seed": seed + i}))[0]
        assert tokens[i] == alone.token_ids


def _kwargs(params: SamplingParams) -> dict:
    return dict(max_tokens=params.max_tokens, temperature=1.0, ignore_eos=True)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_nothing_is_held_without_a_block_to_share(tiny_dir, enable_prefix_caching):
    engine = LLMEngine(
        tiny_dir, dtype="float32", quantization=None, block_size=4, num_kv_blocks=64,
        enable_prefix_caching=enable_prefix_caching,
    )  # fmt: skip
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2)
    engine.add_request("short", [5, 6, 7, 8], greedy)  # no full block before the last token
    if not enable_prefix_caching:
        engine.add_request("long", PROMPT, greedy)
    assert engine.scheduler.num_held == 0
    tokens: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            tokens.setdefault((d.request_id, d.index), []).extend(d.token_ids)
    for request_id in {r for r, _ in tokens}:
        assert tokens[request_id, 0] == tokens[request_id, 1] and len(tokens[request_id, 0]) == 6
    _assert_pool_whole(engine)
