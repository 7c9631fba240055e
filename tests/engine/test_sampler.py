"""Sampler: greedy is argmax, top-k/top-p never leave their allowed set, seeded streams are
independent of batch composition."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from engine import sampler as sampler_module
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest


def req(request_id: str, params: SamplingParams, seed: int = 0) -> ScheduledRequest:
    return ScheduledRequest(request_id, [1], 0, [0], True, params, seed)


def logits_arrays(max_vocab: int = 60):
    return st.integers(2, max_vocab).flatmap(
        lambda v: arrays(np.float32, (v,), elements=st.floats(-20, 20, width=32), unique=True)
    )


def allowed_tokens(logits: np.ndarray, params: SamplingParams) -> set[int]:
    """The tokens the spec allows, computed independently in float64 (with a little slack at
    the top-p boundary for float32 rounding in the sampler)."""
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    if 0 < params.top_k < len(logits):
        order = order[: params.top_k]
    scaled = logits.astype(np.float64)[order] / params.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    cumulative = np.cumsum(probs)
    num_kept = int(np.searchsorted(cumulative, params.top_p - 1e-6)) + 2  # +1 rank, +1 slack
    return set(order[:num_kept].tolist())


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        arrays(np.float32, (17,), elements=st.floats(-30, 30, width=32), unique=True),
        min_size=1,
        max_size=5,
    )
)
def test_greedy_is_argmax(rows):
    logits = torch.tensor(np.stack(rows))
    requests = [req(str(i), SamplingParams(temperature=0.0)) for i in range(len(rows))]
    assert Sampler()(logits, requests) == logits.argmax(-1).tolist()


def test_ids_found_already_are_taken_only_where_every_row_takes_the_argmax():
    """`greedy_ids` (the fused step's argmax) stand for the argmax only where every request
    takes it as is: a sampled row, a logits processor or a grammar makes the sampler work."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    found = torch.tensor([7, 8])  # not the argmax: shows which ids were used
    greedy = [req("a", SamplingParams(temperature=0.0)), req("b", SamplingParams(temperature=0.0))]
    assert Sampler()(logits, greedy, found) == [7, 8]
    assert Sampler()(logits, greedy) == [1, 0]
    sampled = [greedy[0], req("b", SamplingParams(temperature=0.7, top_k=1))]
    assert Sampler()(logits, sampled, found) == [1, 0]
    banned = [greedy[0], req("b", SamplingParams(temperature=0.0, logit_bias={0: -100.0}))]
    assert Sampler()(logits, banned, found) == [1, 2]


@settings(max_examples=150, deadline=None)
@given(
    logits=logits_arrays(),
    top_k=st.integers(0, 70),
    top_p=st.floats(0.01, 1.0),
    temperature=st.floats(0.05, 3.0),
    seed=st.integers(0, 2**32),
)
def test_top_k_top_p_stay_in_allowed_set(logits, top_k, top_p, temperature, seed):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    sampler = Sampler()
    allowed = allowed_tokens(logits, params)
    row = torch.tensor(logits)[None]
    for _ in range(5):
        (token,) = sampler(row, [req("r", params, seed)])
        assert token in allowed


def test_top_k_exact_set():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 3.0, -1.0]])
    params = SamplingParams(temperature=5.0, top_k=3)
    sampler = Sampler()
    seen = {sampler(logits, [req("r", params, 1)])[0] for _ in range(300)}
    assert seen == {1, 3, 4}


def test_top_p_applies_to_the_top_k_distribution():
    # Top-2 renormalised is [0.73, 0.27]: a 0.6 nucleus holds token 0 alone. Measured against
    # the whole vocabulary (token 0 has only 0.43 of it) both tokens would be needed.
    logits = torch.tensor([[3.0, 2.0, 1.0] + [0.0] * 17])
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.6)
    sampler = Sampler()
    assert {sampler(logits, [req("r", params, s)])[0] for s in range(100)} == {0}


def test_tiny_top_p_is_greedy_and_big_nucleus_grows_candidates():
    logits = torch.randn(1, 500)
    sampler = Sampler()
    params = SamplingParams(temperature=1.0, top_p=1e-4)
    assert {sampler(logits, [req("g", params, s)])[0] for s in range(20)} == {int(logits.argmax())}
    # Nearly flat logits: the 0.9 nucleus holds ~450 tokens, far past the first 64 candidates.
    flat = -torch.arange(500, dtype=torch.float32)[None] * 1e-4
    params = SamplingParams(temperature=1.0, top_p=0.9)
    tokens = [sampler(flat, [req("f", params, 3)])[0] for _ in range(400)]
    assert max(tokens) > 64
    allowed = allowed_tokens(flat[0].numpy(), params)
    assert set(tokens) <= allowed and len(allowed) < 460


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]]))
    sampler = Sampler()
    params = SamplingParams(temperature=1.0)
    counts = Counter(sampler(logits, [req("d", params, 5)])[0] for _ in range(4000))
    assert counts[3] == 0
    for token, p in ((0, 0.5), (1, 0.3), (2, 0.2)):
        assert abs(counts[token] / 4000 - p) < 0.04


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**62),
    mates=st.lists(
        st.tuples(st.floats(0.0, 2.0), st.integers(0, 20), st.floats(0.1, 1.0)), max_size=4
    ),
    position=st.integers(0, 4),
)
def test_seeded_stream_independent_of_batch(seed, mates, position):
    vocab = 40
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(vocab, generator=gen) * 3 for _ in range(6)]
    params = SamplingParams(temperature=0.8, top_k=25, top_p=0.9)

    def run(with_mates: bool) -> list[int]:
        sampler, out = Sampler(), []
        for step_logits in steps:
            requests, rows = [], []
            if with_mates:
                for i, (t, k, p) in enumerate(mates):
                    mate = SamplingParams(temperature=t, top_k=k, top_p=p)
                    requests.append(req(f"m{i}", mate, seed=i))
                    rows.append(torch.randn(vocab, generator=gen))
            at = min(position, len(requests))
            requests.insert(at, req("me", params, seed))
            rows.insert(at, step_logits)
            out.append(sampler(torch.stack(rows), requests)[at])
        return out

    assert run(False) == run(True)


def test_drop_restarts_the_stream():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0)
    sampler = Sampler()
    first = [sampler(logits, [req("a", params, 9)])[0] for _ in range(5)]
    assert len(set(first)) > 1  # the stream advances between steps
    sampler.drop(["a"])
    assert [sampler(logits, [req("a", params, 9)])[0] for _ in range(5)] == first


_ROW_PARAMS = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    "top_k": st.sampled_from([0, 1, 3, 70, 200]),
    "top_p": st.sampled_from([1.0, 0.95, 0.5, 0.05]),
    "min_p": st.sampled_from([0.0, 0.0, 0.2]),
})  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(
    vocab=st.integers(2, 300),
    row_params=st.lists(_ROW_PARAMS, min_size=1, max_size=8),
    levels=st.integers(2, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_batch_draws_each_row_as_the_row_alone_draws_it(vocab, row_params, levels, seed):
    """Rows sampled together (the first candidates of rows alike taken in one call over them)
    draw each row's token as that row draws it alone: the same tokens from the same streams,
    over top-k, top-p (a nucleus within the first 64 candidates or past them, in vocabularies
    smaller and larger than that), min-p, greedy rows among them, and logits with ties (drawn
    from `levels` values). Alone: the row's probabilities by their own softmax, through the
    same `_sample_rows`."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (len(row_params), vocab), generator=generator).float()
    logits = logits * (8.0 / levels)
    requests = [req(f"r{i}", SamplingParams(**p), seed=seed + i) for i, p in enumerate(row_params)]
    batched = Sampler()(logits, requests)
    alone = Sampler()
    want = []
    for i, request in enumerate(requests):
        if request.params.temperature < 0.01:
            want.append(int(logits[i].argmax()))
            continue
        alone._generators[request.request_id] = torch.Generator().manual_seed(request.seed)
        probs = torch.softmax(logits[i : i + 1] / request.params.temperature, dim=-1)
        want.append(alone._sample_rows(probs, [request])[0])
    assert batched == want


def test_topk_takes_each_row_on_its_own_and_torchs_for_a_row_with_a_nan() -> None:
    """`_topk`: value descending, of equal values the lower index first; a row holding a NaN
    gets torch's topk (which ranks NaN first) and leaves the other rows as they were."""
    probs = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.1], [0.5, float("nan"), 0.2, 0.2, 0.1]])
    values, indices = sampler_module._topk(probs, 3)
    assert indices[0].tolist() == [1, 2, 3] and values[0].tolist() == pytest.approx([0.3, 0.3, 0.2])
    want_values, want_indices = probs[1].topk(3)
    assert torch.equal(indices[1], want_indices)
    assert torch.equal(values[1].isnan(), want_values.isnan())


@settings(max_examples=80, deadline=None)
@given(
    vocab=st.integers(2, 300),
    num_proposals=st.integers(0, 3),
    wrong_at=st.integers(0, 3),
    params=_ROW_PARAMS.filter(lambda p: p["temperature"] > 0),
    levels=st.integers(2, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_verify_draws_what_one_row_calls_draw(
    vocab, num_proposals, wrong_at, params, levels, seed
):
    """A speculative step's rows verified at once (`verify`: the rows' probabilities and first
    candidates in one call) draw the tokens one-row calls draw row by row, stop after the same
    row (the first whose token differs from the proposal after it), and leave the request's
    stream where those calls leave it."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (num_proposals + 1, vocab), generator=generator).float()
    logits = logits * (8.0 / levels)
    request = req("r", SamplingParams(**params), seed=seed)
    steps = Sampler()
    drawn = [steps(logits[j : j + 1], [request])[0] for j in range(num_proposals + 1)]
    proposals = drawn[:num_proposals]
    if wrong_at < num_proposals:
        proposals[wrong_at] = (proposals[wrong_at] + 1) % vocab
    verifier, rows = Sampler(), Sampler()
    got = verifier.verify(logits, request, proposals)
    assert got == rows._verify_rows(logits, request, proposals)
    assert got == drawn[: len(got)]
    assert len(got) == min(wrong_at, num_proposals) + 1
    assert torch.equal(verifier._generators["r"].get_state(), rows._generators["r"].get_state())


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(2, 300),
    params=_ROW_PARAMS.filter(lambda p: p["temperature"] > 0),
    seed=st.integers(0, 2**31 - 1),
)
def test_without_ties_the_kernels_draw_is_torchs(vocab, params, seed):
    """Where a row's probabilities are all distinct (no order among equals to choose), a row
    drawn through `_topk` (the fused ops' kernel) draws what torch's topk path draws
    (`_sample_row` with nothing precomputed), from the same stream."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(1, vocab, generator=generator) * 3, dim=-1)
    if len(set(probs[0].tolist())) < vocab:
        return  # (rounding made two equal)
    request = req("r", SamplingParams(**params), seed=seed)
    through_kernel, through_torch = Sampler(), Sampler()
    for sampler in (through_kernel, through_torch):
        sampler._generator_for(request)
    assert through_kernel._sample_rows(probs, [request]) == [
        through_torch._sample_row(probs[0], request)
    ]


@settings(max_examples=40, deadline=None)
@given(
    vocab=st.integers(2, 3000),
    row_params=st.lists(_ROW_PARAMS, min_size=1, max_size=6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    masked=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_probabilities_in_one_call_draw_what_the_torch_chain_draws(
    vocab, row_params, dtype, masked, seed
):
    """`_probabilities` (the fused ops' softmax_rows where built) gives the sampler the torch
    chain's probabilities: the same tokens and streams for bf16 and float32 logits, with a
    masked (-inf) logit among them."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(len(row_params), vocab, generator=generator) * 4).to(dtype)
    if masked:
        logits[0, vocab // 2] = float("-inf")
    requests = [req(f"r{i}", SamplingParams(**p), seed=seed + i) for i, p in enumerate(row_params)]
    fused = Sampler()(logits, requests)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            sampler_module, "_probabilities",
            lambda rows, t: torch.softmax(rows.float() / t[:, None], dim=-1),
        )  # fmt: skip
        assert fused == Sampler()(logits, requests)


def test_probabilities_of_a_batch_with_a_nan_row_are_the_torch_chains():
    logits = torch.randn(3, 40)
    logits[1, 7] = float("nan")
    temperatures = torch.tensor([0.5, 1.0, 2.0])
    got = sampler_module._probabilities(logits, temperatures)
    want = torch.softmax(logits / temperatures[:, None], dim=-1)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_integer_temperatures_and_spare_logit_rows_draw_as_before():
    """A temperature given as an int, and logits with rows past the requests' (the caller's
    buffer): the draws are those of float temperatures on the requests' rows alone."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    ints = [req(f"r{i}", SamplingParams(temperature=t), seed=i) for i, t in enumerate([1, 2])]
    floats = [req(f"r{i}", SamplingParams(temperature=float(t)), seed=i)
              for i, t in enumerate([1, 2])]  # fmt: skip
    assert Sampler()(logits, ints) == Sampler()(logits[:2].clone(), floats)
    assert Sampler().verify(logits[:2], ints[0], [7]) == Sampler().verify(logits[:2], floats[0], [7])
