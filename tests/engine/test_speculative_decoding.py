"""Speculative decoding in the fused decode step (engine/fused_decode.py `speculate`): a greedy
request decoding alone drafts tokens on int4 copies of the layers and verifies them in one step
of consecutive rows; the prompt lookup proposes from the request's own tokens (int4/int8, and
sampled requests); greedy requests decoding together verify theirs in one step
(`speculate_batch`). Its promise is exactness: the tokens, the finish and the K/V written are
the ones one-token steps (of the same requests) give, whatever was proposed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine import LLMEngine, SamplingParams, fused_decode
from engine.config import EngineConfig
from engine.kernels.cpu import decode_step, quant_gemm
from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="module")
def built():
    if decode_step.load() is None or quant_gemm.load() is None:
        pytest.skip("the C++ kernels did not build here (no compiler)")


def _engine(model_dir, mode: str, **kwargs) -> LLMEngine:
    return LLMEngine(
        model_dir, dtype="bfloat16", quantization=None, num_kv_blocks=64,
        linear_kernel="gemv", speculative_decoding=mode, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["auto", "int8"], ids=["bf16-kv", "int8-kv"])
def pair(request, built, tiny_model_dir):
    """(speculating engine, one-token engine) over the same tiny model and KV cache dtype.
    Without prefix caching, as `uncached_pair`: the reference's second run (`_reference`, with
    its stop token) would find its prompt's first blocks cached where the speculating run
    computes them afresh, and a prompt's last tokens computed from cached K/V can round
    otherwise (a near-tie's first token flipped on the Zen 3: 22 against 172)."""
    kv = {"kv_cache_dtype": "int8"} if request.param == "int8" else {}
    kv["enable_prefix_caching"] = False
    spec, plain = _engine(tiny_model_dir, "on", **kv), _engine(tiny_model_dir, "off", **kv)
    assert spec.runner._forward.fused.draft is not None
    assert plain.runner._forward.fused.draft is None
    return spec, plain


def _generate(engine: LLMEngine, request_id: str, prompt, params: SamplingParams):
    """One request alone: (token ids, text, finish reason, the block ids its last step had).
    Every delta holds one token, from one-token and speculative steps alike (what a worker
    publishes must not depend on how many tokens a step verified)."""
    engine.add_request(request_id, prompt, params)
    tokens, text, reason, blocks = [], "", None, []
    schedule, outs = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda: outs.append(schedule()) or outs[-1]
    try:
        while engine.has_unfinished_requests():
            deltas = engine.step()
            blocks = outs[-1].scheduled[0].block_ids if outs[-1].scheduled else blocks
            for delta in deltas:
                assert len(delta.token_ids) == 1
                tokens += delta.token_ids
                text += delta.text
                reason = delta.finish_reason
    finally:
        del engine.scheduler.schedule
    return tokens, text, reason, blocks


_counter = iter(range(10**9))


def _reference(
    plain: LLMEngine, tag: str, prompt, max_tokens: int, stop_at: int | None, **sampling
):
    """(params, the one-token engine's run): greedy (or `sampling`'s params) up to max_tokens,
    and where `stop_at` falls inside that output, with the token there as a stop token (run
    again)."""
    sampling = {"temperature": 0.0, **sampling}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    want = _generate(plain, f"{tag}-p", prompt, params)
    if stop_at is not None and stop_at < len(want[0]):
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, stop_token_ids=[want[0][stop_at]],
            **sampling,
        )  # fmt: skip
        want = _generate(plain, f"{tag}-q", prompt, params)
    return params, want


def _check_matches(spec, plain, tag: str, prompt, params: SamplingParams, want) -> None:
    """`spec`'s run of `prompt` gives the one-token steps' tokens, text and finish (`want`),
    and both engines have every block back in the pool after."""
    assert _generate(spec, tag, prompt, params)[:3] == want[:3]
    for engine in (spec, plain):
        assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


# The hypothesis cases of the two proposers: a prompt, max_tokens and where a stop falls.
_CASES = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
_STOPS = {"max_tokens": st.integers(1, 40), "stop_at": st.one_of(st.none(), st.integers(0, 39))}


@_CASES
@given(prompt=st.lists(st.integers(3, 300), min_size=1, max_size=40), **_STOPS)
@example(  # the case a prefix-cache hit in the reference's second run failed (see `pair`)
    prompt=[160, 229, 204, 140, 300, 265, 3, 173, 26, 266, 115, 203, 257, 226, 143, 187, 3, 232,
            217, 169, 113, 166, 32],
    max_tokens=34, stop_at=6,
)  # fmt: skip
def test_the_tokens_and_finish_are_the_one_token_steps(pair, prompt, max_tokens, stop_at):
    """Any prompt, max_tokens and a stop token taken from inside the output (so the stop falls
    among drafted tokens as often as not): the same tokens, text and finish reason, and every
    block back in the pool after."""
    spec, plain = pair
    i = next(_counter)
    params, want = _reference(plain, f"d{i}", prompt, max_tokens, stop_at)
    fused = spec.runner._forward.fused
    before = fused.drafted_tokens
    _check_matches(spec, plain, f"d{i}-s", prompt, params, want)
    if len(want[0]) >= 8:  # 7 decode steps: not all at a block's last slot, so some drafted
        assert fused.drafted_tokens > before


@pytest.mark.parametrize("prompt_len", [5, 100])
def test_the_kv_written_is_the_one_token_steps(pair, prompt_len):
    """The K and V rows a speculating run leaves for its tokens (every row but the last
    token's, which no step computes) are the one-token steps' bits: the verifying step writes
    them (store task) before its rows attend, and its rows compute as they would alone (past
    64 tokens the tiny model's attention is split in partitions, whose size changes with the
    context: rows that would split otherwise are not drafted)."""
    spec, plain = pair
    params = SamplingParams(max_tokens=45, temperature=0.0, ignore_eos=True)
    prompt = [7 + i % 200 for i in range(prompt_len)]
    fused = spec.runner._forward.fused
    accepted = fused.accepted_tokens
    tokens, _, _, spec_blocks = _generate(spec, f"kv-s{prompt_len}", prompt, params)
    want, _, _, plain_blocks = _generate(plain, f"kv-p{prompt_len}", prompt, params)
    assert tokens == want
    assert fused.accepted_tokens > accepted  # drafts were kept: their K/V came from the verify
    _assert_same_kv(spec, spec_blocks, plain, plain_blocks, len(prompt) + len(tokens) - 1)


def _assert_same_kv(spec, spec_blocks, plain, plain_blocks, num_positions: int) -> None:
    """The K/V rows (and int8 scales) of positions [0, num_positions) are the same bits in
    both engines' pools, each read through the blocks its request held."""
    size = spec.config.block_size
    positions = torch.arange(num_positions)
    for blocks in (spec_blocks, plain_blocks):
        assert len(blocks) * size >= positions.numel()

    def rows(engine, blocks):
        ids = torch.tensor(blocks)[positions // size]
        cache = engine.runner.kv_cache  # [layers, blocks, block_size, 2, kv heads, head dim]
        picked = cache[:, ids, positions % size]
        scales = engine.runner.kv_cache_scales
        if scales is not None:
            return picked, scales[:, ids, positions % size]
        return picked, None

    got, got_scales = rows(spec, spec_blocks)
    want_rows, want_scales = rows(plain, plain_blocks)
    assert torch.equal(got, want_rows)
    if want_scales is not None:
        assert torch.equal(got_scales, want_scales)


class _RightDraft:
    """Stands in for the draft plan: proposes the token the one-token steps gave after the
    row's position (read from the step's inputs), so every draft is kept and the verifying
    steps move the full DRAFT_TOKENS + 1 positions."""

    def __init__(self, fused, sequence: list[int]):
        self.fused, self.sequence = fused, sequence

    def run(self, rows, first, spin):
        self.fused.greedy_ids[0] = self.sequence[int(self.fused.positions[0]) + 1]


@pytest.mark.parametrize("offset", [0, 1, 2])
def test_drafts_that_are_always_kept(pair, offset):
    """With drafts that are always right, verifying steps cover 3 positions each, and over 3
    prompt lengths they start on every position of a block (up to its last slot, where the
    draft stops: the next block is not the request's yet): same tokens, same K/V."""
    spec, plain = pair
    fused = spec.runner._forward.fused
    _check_always_kept(spec, plain, f"right{offset}", offset, {  # the draft alone
        "draft_plan": lambda sequence: _RightDraft(fused, sequence),
        "lookup": lambda sequence: None,
    })  # fmt: skip


def _check_always_kept(
    spec, plain, tag: str, offset: int, stand_ins: dict, params: SamplingParams | None = None
) -> None:
    """`spec` with its fused step's proposers (the draft plan, the lookup) replaced by
    `stand_ins[name](prompt + the one-token steps' tokens)`, whose proposals are always right:
    the same tokens, every proposal kept, the same K/V bits. Greedy unless `params` say."""
    params = params or SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt = [9 + i % 250 for i in range(110 + offset)]
    want, _, _, plain_blocks = _generate(plain, f"{tag}-p", prompt, params)
    fused = spec.runner._forward.fused
    real = {name: getattr(fused, name) for name in stand_ins}
    drafted, accepted = fused.drafted_tokens, fused.accepted_tokens
    for name, stand_in in stand_ins.items():
        setattr(fused, name, stand_in(prompt + want))
    try:
        got, _, _, spec_blocks = _generate(spec, f"{tag}-s", prompt, params)
    finally:
        for name, value in real.items():
            setattr(fused, name, value)
    assert got == want
    assert fused.accepted_tokens - accepted == fused.drafted_tokens - drafted > 0
    _assert_same_kv(spec, spec_blocks, plain, plain_blocks, len(prompt) + len(got) - 1)


def test_rows_that_would_take_another_attention_split_are_not_drafted(built, tiny_model_dir):
    """A request holding blocks past its position (our scheduler gives a decode only the block
    it needs, so this guard is for any other): where the one-row attention split changes from
    one block to the next (on 2 threads, the tiny model's: 2 partitions of 4 blocks up to
    position 127, of 5 from 128), a draft stops before the row that would take the other
    split, and none is made from the last position before it."""
    from engine.scheduler_output import ScheduledRequest

    engine = _engine(tiny_model_dir, "on")
    fused = engine.runner._forward.fused
    size = fused.block_size
    widths = [w for w in range(1, 12) if fused._partitions(1, w) != fused._partitions(1, w + 1)]
    if not widths:
        pytest.skip("one attention split for every context here (one thread)")
    last = widths[0] * size - 1  # the last position of the old split
    blocks = list(range(widths[0] + 2))  # a fresh pool: no other request's data in them

    def drafted_from(position: int) -> int | None:
        request = ScheduledRequest("guard", [5], position, blocks, True, SamplingParams(), seed=0)
        before = fused.drafted_tokens
        tokens = fused.speculate(request, engine.runner.num_kv_blocks, engine.max_model_len, 50)
        return None if tokens is None else fused.drafted_tokens - before

    assert drafted_from(last - 5) == 2
    assert drafted_from(last - 1) == 1
    assert drafted_from(last) is None


def test_only_a_greedy_request_decoding_alone_speculates(built, tiny_model_dir):
    """bf16 on our GEMV (3 rows alike: no room for two requests' proposals): two requests at
    once, a sampled request, or one that wants logprobs take one-token steps."""
    engine = _engine(tiny_model_dir, "auto")
    fused = engine.runner._forward.fused
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], greedy)
    engine.add_request("b", [9, 10], greedy)
    engine.step()  # both prompts
    engine.step()  # both decode: no speculation with two rows
    assert fused.speculative_steps == 0
    for params in (
        SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True, seed=1),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
    ):
        engine.add_request(f"c{params.temperature}", [5, 6, 7], params)
    while engine.has_unfinished_requests():
        engine.step()
    assert fused.speculative_steps == 0
    assert engine.get_stats().num_draft_tokens == 0
    _generate(engine, "alone", [5, 6, 7], greedy)
    assert fused.speculative_steps > 0
    stats = engine.get_stats()
    assert stats.num_draft_tokens == fused.drafted_tokens > 0
    assert stats.num_draft_accepted == fused.accepted_tokens


def test_where_speculation_applies(built, tiny_model_dir, tmp_path):
    """bf16 projections on our GEMV with the lm_head's screen: yes; "off", int4 weights, or a
    head too small a share for its screen: no draft."""
    assert _engine(tiny_model_dir, "auto").runner._forward.fused.draft is not None
    assert _engine(tiny_model_dir, "off").runner._forward.fused.draft is None
    quantized = LLMEngine(tiny_model_dir, dtype="bfloat16", quantization="int4", num_kv_blocks=64)
    fused = quantized.runner._forward.fused
    assert fused.draft is None
    assert fused_decode.speculation_reason(quantized.runner.model, fused) is not None
    small_head = make_tiny_llama(tmp_path, num_hidden_layers=4, intermediate_size=1024)
    fused = _engine(small_head, "on").runner._forward.fused
    assert fused.draft is None and fused.screen is None
    with pytest.raises(ValueError, match="speculative_decoding"):
        EngineConfig(speculative_decoding="yes")


def test_the_step_cost_model_prices_one_token_steps_only(built, tiny_model_dir):
    """Steps sized by time correct their cost model after every step; a speculative step (two
    drafts and a verifying step for a chunk of one token) is left out of that, the others not."""
    engine = _engine(tiny_model_dir, "on", max_step_time_ms=500)
    model = engine.scheduler.cost_model
    fused = engine.runner._forward.fused
    observed = model.num_observed
    engine.add_request("timed", [5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert 0 < fused.speculative_steps < steps
    assert model.num_observed - observed == steps - fused.speculative_steps


_ISA_SCRIPT = """
import json, sys
from engine import LLMEngine, SamplingParams

def run(mode, scheme):
    engine = LLMEngine(sys.argv[1], dtype="bfloat16", quantization=scheme, num_kv_blocks=64,
                       linear_kernel="gemv", speculative_decoding=mode)
    outputs = []
    prompts = [[5, 6, 7, 8, 9], [11, 12], list(range(30, 100)), [5, 6, 7] * 4]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt,
                           SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        tokens = []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens += delta.token_ids
        outputs.append(tokens)
    fused = getattr(engine.runner._forward, "fused", None)
    return outputs, fused.drafted_tokens if fused is not None else None, fused.lookup_tokens

result = {}
for scheme in (None, "int4", "int4@exact"):
    on, off = run("on", scheme), run("off", scheme)
    result[str(scheme)] = {"same": on[0] == off[0], "drafted": on[1], "lookup_tokens": on[2]}
print(json.dumps(result))
"""


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_a_narrower_cpus_paths_speculate_with_the_same_tokens(built, tiny_model_dir, isa):
    """The AVX2 and portable paths of every kernel the draft and the verifying step run (the
    CPU's flags above them hidden, torch's own dispatch lowered to match), in a process of
    their own: drafts are made and the tokens are the one-token steps'; with int4 weights the
    lookup's proposals too, as many a step as the path keeps a row's bits for (the AVX2 int8
    path and the portable one: LOOKUP_TOKENS; AVX2's exact path, "int4@exact": 1, its GEMV
    regroups its sums at 3 rows)."""
    import json
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "MINI_INFER_MAX_ISA": isa,
        "ATEN_CPU_CAPABILITY": "avx2" if isa == "avx2" else "default",
    }
    done = subprocess.run(
        [sys.executable, "-c", _ISA_SCRIPT, str(tiny_model_dir)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for scheme in ("None", "int4", "int4@exact"):
        assert result[scheme]["same"] and result[scheme]["drafted"] > 0, result
    assert result["int4"]["lookup_tokens"] == fused_decode.LOOKUP_TOKENS, result
    exact = 1 if isa == "avx2" else fused_decode.LOOKUP_TOKENS
    assert result["int4@exact"]["lookup_tokens"] == exact, result


@pytest.mark.parametrize("proposer", ["draft", "lookup"])
def test_the_context_limit_ends_a_request_where_one_token_steps_do(
    built, tiny_model_dir, proposer
):
    """Near max_model_len the proposals shorten (no row past the last position the context
    allows): the request ends with "length" after the same tokens. Over several limits, so
    that verifying steps (which move 1 to k + 1 positions) land on each of the last
    positions. The lookup's prompt repeats itself, so it proposes."""
    prompt = list(range(40, 50)) if proposer == "draft" else [40, 41, 42] * 3 + [40]
    for max_model_len in range(22, 31):
        got = {}
        for mode in ("on", "off"):
            if proposer == "draft":
                engine = _engine(tiny_model_dir, mode, max_model_len=max_model_len)
            else:
                engine = _quantized(tiny_model_dir, mode, "int4", max_model_len=max_model_len)
            params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
            got[mode] = _generate(engine, "limit", prompt, params)[:3]
            assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
            if mode == "on":
                assert engine.runner._forward.fused.speculative_steps > 0
        assert got["on"] == got["off"], max_model_len
        assert got["on"][2] == "length" and len(got["on"][0]) == max_model_len - 10


# -- proposals from the request's own tokens (engine/ngram_lookup.py), where no draft applies --

def _quantized(model_dir, mode: str, scheme: str, **kwargs) -> LLMEngine:
    return LLMEngine(
        model_dir, dtype="bfloat16", quantization=scheme, num_kv_blocks=64,
        speculative_decoding=mode, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["int4", "int8"])
def lookup_pair(request, built, tiny_model_dir):
    """(engine verifying the lookup's proposals, one-token engine): int4 or int8 weights;
    without prefix caching, as `pair`."""
    spec = _quantized(tiny_model_dir, "on", request.param, enable_prefix_caching=False)
    plain = _quantized(tiny_model_dir, "off", request.param, enable_prefix_caching=False)
    fused = spec.runner._forward.fused
    assert fused.draft is None and fused.lookup is not None
    assert fused.lookup_tokens == min(
        fused_decode.LOOKUP_TOKENS, fused.rows_alike - 1, fused.max_rows - 1
    )
    assert plain.runner._forward.fused.lookup is None
    return spec, plain


@_CASES
@given(prompt=st.lists(st.integers(3, 8), min_size=1, max_size=40), **_STOPS)
def test_lookup_the_tokens_and_finish_are_the_one_token_steps(
    lookup_pair, prompt, max_tokens, stop_at
):
    """Prompts over a few token ids (their n-grams repeat, so proposals are made from the
    first step), any max_tokens, a stop token from inside the output: the same tokens, text
    and finish reason, and every block back in the pool after."""
    spec, plain = lookup_pair
    i = next(_counter)
    params, want = _reference(plain, f"l{i}", prompt, max_tokens, stop_at)
    fused = spec.runner._forward.fused
    before = fused.drafted_tokens
    _check_matches(spec, plain, f"l{i}-s", prompt, params, want)
    history = [*prompt, want[0][0]]  # the first decode step's; it may propose if its tail
    tail_occurred = any(  # occurred before, 2 tokens may follow and its block has room
        history[-n:] == history[j : j + n] for n in (2, 3) for j in range(len(history) - n)
    )
    if tail_occurred and len(want[0]) >= 3 and len(prompt) % 16 != 15:
        assert fused.drafted_tokens > before


class _RightLookup:
    """Stands in for the lookup: proposes the tokens the one-token steps gave, so every
    proposal is kept and the verifying steps move the full lookup_tokens + 1 positions."""

    def __init__(self, sequence: list[int]):
        self.sequence = sequence

    def propose(self, request_id, tokens, k):
        return self.sequence[len(tokens) : len(tokens) + k]

    def record(self, request_id, proposed, kept):
        assert kept == proposed

    def drop(self, request_ids):
        pass


@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_lookup_proposals_that_are_always_kept(lookup_pair, offset):
    """Verifying steps of lookup_tokens + 1 rows starting on every position of a block (over
    4 prompt lengths): the same tokens and the same K/V bits as one-token steps."""
    spec, plain = lookup_pair
    _check_always_kept(spec, plain, f"lright{offset}", offset, {"lookup": _RightLookup})


def test_where_the_lookup_applies(built, tiny_model_dir):
    """int4/int8 weights: the lookup alone, with as many proposals as the GEMVs keep a row's
    bits for; bf16 on our GEMV: the lookup (2 proposals: the GEMV's 3 rows) and the draft;
    "off": neither."""
    assert _quantized(tiny_model_dir, "auto", "int4").runner._forward.fused.lookup is not None
    assert _quantized(tiny_model_dir, "off", "int4").runner._forward.fused.lookup is None
    bf16 = _engine(tiny_model_dir, "auto").runner._forward.fused
    assert bf16.draft is not None and bf16.lookup is not None and bf16.lookup_tokens == 2


def test_the_lookup_proposes_before_the_draft(built, tiny_model_dir):
    """bf16 with both: a step whose lookup proposes runs no draft step; one whose lookup has
    nothing runs the draft; the same tokens as one-token steps either way."""
    spec, plain = _engine(tiny_model_dir, "on"), _engine(tiny_model_dir, "off")
    fused = spec.runner._forward.fused
    draft_steps, proposing_steps = set(), set()
    real_plan, real_lookup = fused.draft_plan, fused.lookup

    class Plan:  # the draft plan, noting the speculative step it runs for
        def run(self, *args):
            draft_steps.add(fused.speculative_steps)
            return real_plan.run(*args)

    class Lookup(type(real_lookup)):  # the lookup, noting the steps it proposes for
        def propose(self, *args):
            proposal = super().propose(*args)
            if proposal:
                proposing_steps.add(fused.speculative_steps)
            return proposal

    fused.draft_plan, fused.lookup = Plan(), Lookup()
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    try:
        got = _generate(spec, "both", [5, 6, 7] * 4, params)[:3]
    finally:
        fused.draft_plan, fused.lookup = real_plan, real_lookup
    assert got == _generate(plain, "both-p", [5, 6, 7] * 4, params)[:3]
    assert draft_steps and proposing_steps  # both kinds of step ran
    assert not draft_steps & proposing_steps


# -- sampled requests: the lookup's proposals, each row drawn as a one-token step draws it ----


@pytest.fixture(scope="module", params=["int4", "int8"])
def uncached_pair(request, built, tiny_model_dir):
    """As `lookup_pair`, without prefix caching: a prompt met again is computed again, so
    the sampled runs compare the same bits (a prefix-cache hit computes the prompt's last
    tokens from cached K/V, which can round otherwise, and a sampled draw near a boundary of
    the CDF then picks another token, speculation or not)."""
    spec = _quantized(tiny_model_dir, "on", request.param, enable_prefix_caching=False)
    plain = _quantized(tiny_model_dir, "off", request.param, enable_prefix_caching=False)
    return spec, plain

_SAMPLING = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.3, 0.8, 1.2]),
    "top_p": st.sampled_from([1.0, 0.9]),
    "top_k": st.sampled_from([0, 20]),
    "min_p": st.sampled_from([0.0, 0.1]),
    "seed": st.integers(0, 2**31 - 1),
})  # fmt: skip


@_CASES
@given(prompt=st.lists(st.integers(3, 8), min_size=1, max_size=40), sampling=_SAMPLING, **_STOPS)
def test_sampled_the_tokens_and_finish_are_the_one_token_steps(
    uncached_pair, prompt, sampling, max_tokens, stop_at
):
    """A seeded sampled request (temperature, top-p, top-k, min-p) decoding alone: the same
    tokens, text and finish as one-token steps draw, and every block back in the pool. The
    sampler draws one number a token from the request's stream, in order, whatever the step
    verified."""
    spec, plain = uncached_pair
    i = next(_counter)
    params, want = _reference(plain, f"sm{i}", prompt, max_tokens, stop_at, **sampling)
    _check_matches(spec, plain, f"sm{i}-s", prompt, params, want)


@pytest.mark.parametrize("offset", [0, 2])
def test_sampled_proposals_that_are_always_kept(uncached_pair, offset):
    """Proposals that are the tokens one-token steps drew: every one kept, so each verifying
    step draws up to lookup_tokens + 1 tokens in a row from the stream; the same tokens and
    the same K/V bits."""
    spec, plain = uncached_pair
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    _check_always_kept(spec, plain, f"sright{offset}", offset, {"lookup": _RightLookup}, params)


def test_which_sampled_requests_speculate(built, tiny_model_dir):
    """Sampled requests take the lookup's proposals only (the bf16 draft, which proposes its
    argmax, never runs for them), and not with penalties or logprobs. (The lookup stands in
    with the one-token steps' tokens, so that it proposes at every step.)"""
    spec, plain = _engine(tiny_model_dir, "on"), _engine(tiny_model_dir, "off")
    fused = spec.runner._forward.fused
    real_plan, real_lookup = fused.draft_plan, fused.lookup
    draft_runs = []

    class Plan:
        def run(self, *args):
            draft_runs.append(args)
            return real_plan.run(*args)

    prompt = [5, 6, 7] * 4
    sampled = SamplingParams(max_tokens=30, temperature=0.5, seed=3, ignore_eos=True)
    want = _generate(plain, "sampled-p", prompt, sampled)[:3]
    fused.draft_plan, fused.lookup = Plan(), _RightLookup(prompt + want[0])
    try:
        steps = fused.speculative_steps
        assert _generate(spec, "sampled", prompt, sampled)[:3] == want
        assert fused.speculative_steps > steps and not draft_runs
        for i, params in enumerate((
            SamplingParams(max_tokens=30, temperature=0.5, seed=3, ignore_eos=True,
                           repetition_penalty=1.3),
            SamplingParams(max_tokens=30, temperature=0.5, seed=3, ignore_eos=True, logprobs=1),
        )):  # fmt: skip
            steps = fused.speculative_steps
            _generate(spec, f"unspeculated{i}", prompt, params)
            assert fused.speculative_steps == steps
    finally:
        fused.draft_plan, fused.lookup = real_plan, real_lookup


def test_sampled_requests_keep_real_proposals(uncached_pair):
    """The lookup itself (no stand-in), sampled at a low temperature over a prompt that repeats
    itself: proposals are made and some kept, and the tokens are the one-token steps'."""
    spec, plain = uncached_pair
    fused = spec.runner._forward.fused
    steps, accepted = fused.speculative_steps, fused.accepted_tokens
    for seed in range(4):
        params = SamplingParams(max_tokens=40, temperature=0.3, seed=seed, ignore_eos=True)
        want = _generate(plain, f"real-p{seed}", [5, 6, 7] * 4, params)
        _check_matches(spec, plain, f"real-s{seed}", [5, 6, 7] * 4, params, want)
    assert fused.speculative_steps > steps and fused.accepted_tokens > accepted


def _generate_together(engine: LLMEngine, tag: str, prompts, params):
    """The prompts' requests added at once and run to the end (`params`: one SamplingParams
    for all, or one each): per request (tokens, the block ids its last step had, how many
    tokens it had when the first of the others finished)."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for request_id, prompt, each in zip(ids, prompts, params_list, strict=True):
        engine.add_request(request_id, prompt, each)
    tokens = {i: [] for i in ids}
    blocks = dict.fromkeys(ids)
    alone_after: dict[str, int | None] = dict.fromkeys(ids)
    schedule, outs = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda: outs.append(schedule()) or outs[-1]
    try:
        while engine.has_unfinished_requests():
            deltas = engine.step()
            for s in outs[-1].scheduled:
                blocks[s.request_id] = s.block_ids
            for delta in deltas:
                assert len(delta.token_ids) == 1
                tokens[delta.request_id] += delta.token_ids
            finished = {d.request_id for d in deltas if d.finished}
            if finished:  # the others' tokens from here on come from a different batch
                for i in ids:
                    if alone_after[i] is None and i not in finished:
                        alone_after[i] = len(tokens[i])
    finally:
        del engine.scheduler.schedule
    return [(tokens[i], blocks[i], alone_after[i]) for i in ids]


@_CASES
@given(
    prompts=st.lists(
        st.lists(st.integers(3, 8), min_size=1, max_size=30), min_size=2, max_size=3
    ),
    max_tokens=st.integers(1, 40),
)
def test_batch_the_tokens_are_the_one_token_steps_while_the_batch_holds(
    lookup_pair, prompts, max_tokens
):
    """Two or three greedy requests decoding together verify their proposals in one step
    (`speculate_batch`): each request's tokens are the one-token steps' as long as the same
    requests share the steps (once one finishes, the others decode in steps of fewer rows,
    whose attention split a one-token run of the same batch need not share), and every
    block is back in the pool after."""
    spec, plain = lookup_pair
    i = next(_counter)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    want = _generate_together(plain, f"b{i}-p", prompts, params)
    got = _generate_together(spec, f"b{i}-s", prompts, params)
    _same_while_the_batch_holds(got, want, max_tokens)
    for engine in (spec, plain):
        assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def _same_while_the_batch_holds(got, want, max_tokens: int) -> None:
    for (got_tokens, _, alone_after), (want_tokens, _, _) in zip(got, want, strict=True):
        assert len(got_tokens) == len(want_tokens) == max_tokens
        shared = len(got_tokens) if alone_after is None else alone_after
        assert got_tokens[:shared] == want_tokens[:shared]


@_CASES
@given(
    prompts=st.lists(
        st.lists(st.integers(3, 8), min_size=1, max_size=30), min_size=2, max_size=3
    ),
    max_tokens=st.integers(1, 40),
    samplings=st.lists(st.one_of(st.none(), _SAMPLING), min_size=3, max_size=3),
)
def test_batch_sampled_the_tokens_are_the_one_token_steps_while_the_batch_holds(
    uncached_pair, prompts, max_tokens, samplings
):
    """Sampled requests (seeded: temperature, top-p, top-k, min-p), greedy ones among them or
    not, decoding together verify their proposals in one step: each draws row by row from its
    own stream, so its tokens are the one-token steps' while the same requests share the
    steps; every block back in the pool."""
    spec, plain = uncached_pair
    i = next(_counter)
    params = [
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(sampling or {"temperature": 0.0}))
        for sampling in samplings[: len(prompts)]
    ]
    want = _generate_together(plain, f"bs{i}-p", prompts, params)
    got = _generate_together(spec, f"bs{i}-s", prompts, params)
    _same_while_the_batch_holds(got, want, max_tokens)
    for engine in (spec, plain):
        assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


class _RightBatchLookup(_RightLookup):
    """`_RightLookup` for several requests: each proposes its own one-token steps' tokens."""

    def __init__(self, sequences: dict[str, list[int]]):
        self.sequences = sequences

    def propose(self, request_id, tokens, k):
        sequence = self.sequences[request_id]
        return sequence[len(tokens) : len(tokens) + k]


@pytest.mark.parametrize("offset", [0, 2])
def test_batch_proposals_that_are_always_kept(lookup_pair, offset):
    """Two requests of the same length (so the same room in their blocks: they move in step)
    whose proposals are always right: every proposal kept, the same tokens and the same K/V
    bits as one-token steps of the two together, over verifying steps that start on every
    position of a block."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    _check_batch_always_kept(*lookup_pair, f"bright{offset}", offset, [params, params])


@pytest.mark.parametrize(("offset", "both"), [(0, False), (1, True)])
def test_batch_sampled_proposals_that_are_always_kept(uncached_pair, offset, both):
    """As above with one request drawing (seeded) beside a greedy one, or both drawing, each
    proposing the tokens its one-token steps drew: every proposal kept, each verifying step
    drawing up to lookup_tokens + 1 tokens in a row from a request's stream."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    drawn = [SamplingParams(max_tokens=40, temperature=t, top_p=0.9, seed=seed, ignore_eos=True)
             for t, seed in ((0.8, 11), (1.1, 12))]  # fmt: skip
    params = drawn if both else [greedy, drawn[0]]
    _check_batch_always_kept(*uncached_pair, f"bsright{offset}", offset, params)


def _check_batch_always_kept(spec, plain, tag: str, offset: int, params: list) -> None:
    prompts = [[9 + (i * (7 + r)) % 250 for i in range(110 + offset)] for r in range(2)]
    want = _generate_together(plain, f"{tag}-p", prompts, params)
    fused = spec.runner._forward.fused
    real, drafted, accepted = fused.lookup, fused.drafted_tokens, fused.accepted_tokens
    steps = fused.speculative_steps
    fused.lookup = _RightBatchLookup({f"{tag}-s-{r}": prompts[r] + want[r][0] for r in range(2)})
    try:
        got = _generate_together(spec, f"{tag}-s", prompts, params)
    finally:
        fused.lookup = real
    assert fused.accepted_tokens - accepted == fused.drafted_tokens - drafted > 0
    assert fused.speculative_steps - steps < 40  # several tokens a verifying step
    for r in range(2):
        assert got[r][0] == want[r][0] and got[r][2] is None  # they finished together
        _assert_same_kv(spec, got[r][1], plain, want[r][1], len(prompts[r]) + 39)


def test_where_batch_speculation_applies(built, tiny_model_dir):
    """Requests decoding together, greedy or sampled, up to BATCH_MAX_REQUESTS, with GEMVs
    that keep a row's bits for a proposal each: int4 does; a request with a penalty among them,
    more requests than that, or bf16 on our GEMV (3 rows alike: no room for 2 requests'
    proposals) do not."""
    repeating = [5, 6, 7, 8] * 6
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True, seed=3)

    def batch_steps(engine, params_list) -> int:
        """Verifying steps taken while more than one request decoded."""
        fused = engine.runner._forward.fused
        for k, params in enumerate(params_list):
            engine.add_request(f"w{k}", repeating[k:], params)
        engine.step()  # the prompts
        steps = 0
        while engine.has_unfinished_requests():
            running = len(engine.scheduler.running)
            before = fused.speculative_steps
            engine.step()
            steps += running > 1 and fused.speculative_steps > before
        return steps

    penalized = SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True, seed=3,
                               presence_penalty=0.5)  # fmt: skip
    int4 = _quantized(tiny_model_dir, "auto", "int4")
    assert batch_steps(int4, [greedy, greedy]) > 0
    assert batch_steps(int4, [greedy, greedy, greedy]) > 0
    assert batch_steps(int4, [greedy, sampled]) > 0
    assert batch_steps(int4, [sampled, greedy, greedy]) > 0
    assert batch_steps(int4, [greedy, penalized]) == 0
    many = [greedy] * (fused_decode.BATCH_MAX_REQUESTS + 1)
    assert batch_steps(int4, many) == 0
    assert batch_steps(_engine(tiny_model_dir, "auto"), [greedy, greedy]) == 0
