"""Steps sized by urgency: with critical or high work in the engine, every step's predicted cost
stays under `step_time_target_ms` (a long prefill goes in chunks that fit), urgent waiting work
is admitted before less urgent running work; with only normal and low work the token budget
alone applies, or `max_step_time_ms` when set. The cost model here is exact and known: 1 ms per
step plus 1 ms per token."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_cost import StepCostModel, fit

CRITICAL, HIGH, NORMAL, LOW = 0, 1, 2, 3
FAKE_COST = StepCostModel(fixed_ms=1.0, per_token_ms=1.0, per_attention_ms=0.0)


def make(target_ms: float | None = 20.0, budget: int = 512, num_blocks: int = 512) -> Scheduler:
    config = EngineConfig(
        block_size=4, max_num_batched_tokens=budget, max_num_seqs=64,
        step_time_target_ms=target_ms,
    )  # fmt: skip
    sched = Scheduler(config, num_blocks)
    if target_ms is not None:
        sched.cost_model = StepCostModel(1.0, 1.0, 0.0)
    return sched


def add(sched: Scheduler, rid: str, num_prompt: int, priority: int, max_tokens: int = 4) -> None:
    index = len(sched.requests)
    params = SamplingParams(max_tokens=max_tokens)
    # Tokens of its own: no prefix-cache hit between requests.
    tokens = [100 + index] * num_prompt
    sched.add_request(Request(rid, tokens, params, priority=priority, arrival_index=index))


def step(sched: Scheduler):
    out = sched.schedule()
    sampled = {s.request_id: 5 for s in out.scheduled if s.needs_sample}
    for req in sched.update_from_output(out, sampled):
        if req.num_output_tokens >= req.params.max_tokens:
            sched.finish_request(req.request_id, "length")
    return out


def tokens_of(out) -> dict[str, int]:
    return {s.request_id: len(s.token_ids) for s in out.scheduled}


def test_a_long_prefill_is_chunked_under_the_target_while_critical_work_is_in() -> None:
    sched = make(target_ms=20.0, budget=64)  # the first-chunk floor (16 tokens) is below 19
    add(sched, "crit", 100, CRITICAL)
    chunks = []
    while sched.requests["crit"].num_computed_tokens < 100:
        out = step(sched)
        chunks.append(tokens_of(out)["crit"])
        assert FAKE_COST.predict_ms([(0, n) for n in tokens_of(out).values()]) <= 20.0
    assert chunks[:-1] == [19] * 5 and sum(chunks) == 100  # 1 ms fixed + 19 tokens


def test_an_unreachable_target_still_makes_progress() -> None:
    """A model that says the fixed cost alone is over the target (a slow machine, or a
    calibration under load): chunks still get half the target, and the first at least a quarter
    of the token budget (64 of 256 here)."""
    sched = make(target_ms=20.0, budget=256)
    sched.cost_model = StepCostModel(fixed_ms=50.0, per_token_ms=1.0, per_attention_ms=0.0)
    add(sched, "crit", 100, CRITICAL)
    assert tokens_of(step(sched)) == {"crit": 64}  # 10 ms of chunks: 10 tokens; the floor: 64
    sched.cost_model = StepCostModel(fixed_ms=50.0, per_token_ms=0.1, per_attention_ms=0.0)
    assert tokens_of(step(sched)) == {"crit": 36}  # the rest: 10 ms is 100 tokens


def test_no_cap_without_urgent_work() -> None:
    """Normal and low work: the throughput budget, the whole prompt in one step."""
    sched = make(target_ms=20.0)
    add(sched, "low", 300, LOW)
    add(sched, "normal", 200, NORMAL)
    assert tokens_of(step(sched)) == {"normal": 200, "low": 300}


def test_the_cap_goes_as_soon_as_the_urgent_work_finishes() -> None:
    sched = make(target_ms=20.0)
    add(sched, "high", 8, HIGH, max_tokens=1)
    add(sched, "low", 300, LOW)
    first = tokens_of(step(sched))
    assert first["high"] == 8 and first["low"] == 20 - 1 - 8  # the rest of the time budget
    assert "high" not in sched.requests  # finished: one token
    assert tokens_of(step(sched)) == {"low": 300 - 11}  # uncapped again


def test_a_critical_arrival_is_admitted_before_running_low_work_fills_the_step() -> None:
    """Guards against running work taking the time budget first: the low prefill in chunks
    would fill every step and the critical prompt would wait for the whole of it."""
    sched = make(target_ms=20.0, budget=64)
    add(sched, "low", 400, LOW)
    assert tokens_of(step(sched)) == {"low": 64}  # alone: the token budget only
    add(sched, "crit", 12, CRITICAL)
    assert tokens_of(step(sched)) == {"crit": 12, "low": 20 - 1 - 12}


def test_without_a_target_nothing_is_capped() -> None:
    sched = make(target_ms=None)
    add(sched, "crit", 300, CRITICAL)
    assert tokens_of(step(sched)) == {"crit": 300}


@settings(max_examples=60, deadline=None)
@given(
    target_ms=st.floats(min_value=20.0, max_value=200.0),  # >= the fixed cost + a first chunk
    requests=st.lists(
        st.tuples(st.integers(1, 300), st.sampled_from([CRITICAL, HIGH, NORMAL, LOW])),
        min_size=1,
        max_size=12,
    ),  # fmt: skip
)
def test_every_urgent_step_stays_under_the_target(target_ms, requests) -> None:
    """Whatever the mix: a step taken with urgent work in the engine is predicted under the
    target, or, when urgent chunks needed their floor to go past it, holds nothing more than
    they do; and everything still finishes."""
    sched = make(target_ms=target_ms, budget=256, num_blocks=4096)
    for i, (num_prompt, priority) in enumerate(requests):
        add(sched, f"r{i}", num_prompt, priority)
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        is_urgent = sched.has_urgent
        out = step(sched)
        chunks = [(s.start_position, len(s.token_ids)) for s in out.scheduled]
        urgent = [
            (s.start_position, len(s.token_ids))
            for s in out.scheduled
            if requests[int(s.request_id[1:])][1] <= HIGH
        ]
        if is_urgent and chunks:
            floor_ms = FAKE_COST.predict_ms(urgent or chunks[:1])
            assert FAKE_COST.predict_ms(chunks) <= max(target_ms, floor_ms) + 1e-9
    assert not sched.has_unfinished()


def test_the_fit_recovers_known_coefficients() -> None:
    truth = StepCostModel(fixed_ms=5.0, per_token_ms=0.3, per_attention_ms=0.01)
    steps = [[(0, 8)], [(0, 64)], [(0, 256)], [(0, 512)], [(4, 1)] * 16]
    model = fit([(chunks, truth.predict_ms(chunks)) for chunks in steps])
    for chunks in steps:
        assert abs(model.predict_ms(chunks) - truth.predict_ms(chunks)) < 1e-6


def test_the_online_correction_follows_a_slower_machine() -> None:
    model = StepCostModel(fixed_ms=1.0, per_token_ms=1.0, per_attention_ms=0.0)
    for _ in range(40):
        model.observe([(0, 9)], 20.0)  # predicted 10 ms, measured twice that
    assert abs(model.predict_ms([(0, 9)]) - 20.0) < 0.5
    assert model.max_new_tokens(0, 20.0) == 10


def test_the_engine_calibrates_at_start_up_and_serves_the_same_tokens(tmp_path) -> None:
    """On the real (tiny) engine: calibration leaves no request, block or count behind, and a
    critical request under the step cap generates exactly what it does without one."""
    from engine import LLMEngine
    from tests.tiny_model import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path)
    capped = LLMEngine(model_dir, block_size=4, num_kv_blocks=512, step_time_target_ms=5.0)
    model = capped.scheduler.cost_model
    assert model is not None and model.per_token_ms > 0
    stats = capped.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_tokens_computed) == (0, 0, 0)
    assert stats.num_blocks_free == stats.num_blocks_total
    plain = LLMEngine(model_dir, block_size=4, num_kv_blocks=512)
    outputs = []
    for engine in (capped, plain):
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        engine.add_request("crit", list(range(3, 300)), params, priority=CRITICAL)
        tokens = []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens.extend(delta.token_ids)
        outputs.append(tokens)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6
    assert model.num_observed > 0  # corrected online


@settings(deadline=None)
@given(
    num_tokens=st.integers(0, 20_000),
    max_step_tokens=st.integers(16, 4096),
    chunk=st.integers(16, 4096),
)
def test_the_admission_estimate_is_a_lower_bound(num_tokens, max_step_tokens, chunk) -> None:
    """Whatever chunks the scheduler really uses (at most `max_step_tokens` each), the predicted
    prefill time never exceeds what the model says those steps cost: admission expires only
    requests that truly cannot make it (by the model)."""
    model = StepCostModel(fixed_ms=3.0, per_token_ms=0.4, per_attention_ms=0.01)
    chunk = min(chunk, max_step_tokens)
    steps, start = [], 0
    while start < num_tokens:
        n = min(chunk, num_tokens - start)
        steps.append(model.predict_ms([(start, n)]))
        start += n
    assert model.prefill_ms(num_tokens, max_step_tokens) <= sum(steps) + 1e-6


def make_bounded(max_step_ms: float, target_ms: float | None = 20.0, budget: int = 512):
    config = EngineConfig(
        block_size=4, max_num_batched_tokens=budget, max_num_seqs=64,
        step_time_target_ms=target_ms, max_step_time_ms=max_step_ms,
    )  # fmt: skip
    sched = Scheduler(config, 512)
    sched.cost_model = StepCostModel(1.0, 1.0, 0.0)
    return sched


def test_without_urgent_work_a_step_stays_under_max_step_time() -> None:
    """The engine takes requests only between steps: a bulk prefill in one long step is what a
    critical arrival waits for. With `max_step_time_ms` the bulk prompts go in chunks of at most
    that (1 ms fixed + 49 tokens here), in arrival order, running work first."""
    sched = make_bounded(max_step_ms=50.0)
    add(sched, "low", 300, LOW)
    add(sched, "normal", 30, NORMAL)
    assert tokens_of(step(sched)) == {"normal": 30, "low": 19}
    assert tokens_of(step(sched)) == {"normal": 1, "low": 49}  # a decode is free, low goes on
    add(sched, "crit", 12, CRITICAL)  # arrives: the urgent target from the next step on
    assert tokens_of(step(sched)) == {"crit": 12, "normal": 1, "low": 20 - 1 - 12 - 1}


def test_an_urgent_step_gives_every_urgent_prompt_its_floor() -> None:
    """Three critical prompts that arrive together get their first tokens in the same step
    (the urgent floor, a quarter of the token budget, is shared by them), not one per step."""
    sched = make_bounded(max_step_ms=500.0, target_ms=20.0, budget=256)
    add(sched, "low", 200, LOW)
    for i in range(3):
        add(sched, f"crit{i}", 20, CRITICAL)
    assert tokens_of(step(sched)) == {"crit0": 20, "crit1": 20, "crit2": 20}
    sampled = {rid: r.num_output_tokens for rid, r in sched.requests.items()}
    assert sampled == {"crit0": 1, "crit1": 1, "crit2": 1, "low": 0}


def test_max_step_time_zero_means_off() -> None:
    config = EngineConfig(max_step_time_ms=0)
    assert config.max_step_time_ms is None and not config.has_step_cost
    assert EngineConfig(max_step_time_ms=300).has_step_cost


@settings(max_examples=60, deadline=None)
@given(
    max_step_ms=st.floats(min_value=10.0, max_value=400.0),
    requests=st.lists(
        st.tuples(st.integers(1, 300), st.sampled_from([NORMAL, LOW])), min_size=1, max_size=12
    ),
)
def test_every_bulk_step_stays_under_max_step_time(max_step_ms, requests) -> None:
    """Only normal and low work: every step is predicted under `max_step_time_ms` plus its
    one-token chunks (decodes, never cut), and everything finishes."""
    sched = make_bounded(max_step_ms=max_step_ms, budget=256)
    for i, (num_prompt, priority) in enumerate(requests):
        add(sched, f"r{i}", num_prompt, priority, max_tokens=8)
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        chunks = [(s.start_position, len(s.token_ids)) for s in step(sched).scheduled]
        num_ones = sum(1 for _, n in chunks if n == 1)  # decodes (and one-token prompts)
        bound_ms = max(max_step_ms, FAKE_COST.predict_ms([(0, 1)]))
        assert FAKE_COST.predict_ms(chunks) <= bound_ms + num_ones * FAKE_COST.chunk_ms(0, 1)
    assert not sched.has_unfinished()


def test_without_urgent_work_decodes_are_never_cut() -> None:
    """A corrected model that says each token costs 40 ms (a loaded machine) and a 50 ms cap:
    all five decodes still run, and the prefill still gets the whole 49 ms (one token)."""
    sched = make_bounded(max_step_ms=50.0)
    for i in range(5):
        add(sched, f"d{i}", 4, LOW, max_tokens=8)
    step(sched)  # the five prefills
    add(sched, "late", 100, LOW)
    sched.cost_model = StepCostModel(fixed_ms=1.0, per_token_ms=40.0, per_attention_ms=0.0)
    assert tokens_of(step(sched)) == {**{f"d{i}": 1 for i in range(5)}, "late": 1}
    sched.cost_model = StepCostModel(fixed_ms=1.0, per_token_ms=1.0, per_attention_ms=0.0)
    # The decodes spend none of the 49 ms the prefill may take.
    assert tokens_of(step(sched)) == {**{f"d{i}": 1 for i in range(5)}, "late": 49}
