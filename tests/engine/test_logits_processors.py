"""Penalties, logit bias, min_p and the grammar mask against reference computations: HF's logits
processors for repetition penalty and min_p, OpenAI's formula (in numpy) for presence /
frequency penalties, and a bit-by-bit unpack for the mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

import engine.sampler as sampler_module
from engine.logits_processors import process_logits
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest

VOCAB = 50


def scheduled(params: SamplingParams, prompt: list[int], output: list[int], grammar=None, i=0):
    tokens = prompt + output
    return ScheduledRequest(
        f"r{i}", tokens[-1:], len(tokens) - 1, [0], True, params, seed=i,
        num_output_tokens=len(output),
        all_token_ids=tokens if params.has_penalties else None,
        grammar=grammar,
    )  # fmt: skip


token_lists = st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=30)
logit_rows = st.lists(st.floats(-30, 30, width=32), min_size=VOCAB, max_size=VOCAB)


def openai_penalties(logits, output, presence, frequency):
    """OpenAI's definition: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence."""
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=VOCAB).astype(np.float64)
    return logits - counts * frequency - (counts > 0) * presence


@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            logit_rows,
            token_lists,
            token_lists,
            st.floats(0.05, 10.0),
            st.floats(-2, 2),
            st.floats(-2, 2),
        ),
        min_size=1,
        max_size=4,
    )  # fmt: skip
)
def test_penalties_match_hf_and_openai(rows):
    requests, expected = [], []
    for i, (logits, prompt, output, repetition, presence, frequency) in enumerate(rows):
        params = SamplingParams(
            repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency
        )
        requests.append(scheduled(params, [1, *prompt], output, i=i))
        # HF's processor sees every token so far (prompt and output) as input_ids.
        ids = torch.tensor([[1, *prompt, *output]])
        hf = RepetitionPenaltyLogitsProcessor(repetition)(ids, torch.tensor([logits]))[0]
        expected.append(openai_penalties(hf.double().numpy(), output, presence, frequency))
    out = process_logits(torch.tensor([r[0] for r in rows]), requests)  # in place: fresh tensor
    np.testing.assert_allclose(out.double().numpy(), np.stack(expected), rtol=1e-5, atol=1e-4)


def test_unpenalized_rows_of_a_mixed_batch_stay_raw():
    logits = torch.randn(3, VOCAB)
    requests = [
        scheduled(SamplingParams(), [1, 2], [3, 3]),
        scheduled(SamplingParams(frequency_penalty=1.0), [1, 2], [3, 3], i=1),
        scheduled(SamplingParams(temperature=0.0), [4], [5], i=2),
    ]
    raw = logits.clone()
    out = process_logits(logits, requests)
    assert torch.equal(out[0], raw[0]) and torch.equal(out[2], raw[2])
    assert out[1, 3] == pytest.approx(float(raw[1, 3]) - 2.0)


def test_logits_stay_raw_when_the_batch_wants_logprobs():
    """The runner scores logprobs on the raw logits after sampling: a batch with a logprobs
    request gets a copy; one without is processed in place (no [batch, vocab] copy)."""
    logits = torch.randn(2, VOCAB)
    raw = logits.clone()
    requests = [
        scheduled(SamplingParams(frequency_penalty=1.0), [1], [3]),
        scheduled(SamplingParams(logprobs=2), [1], [3], i=1),
    ]
    out = process_logits(logits, requests)
    assert torch.equal(logits, raw) and out[0, 3] == pytest.approx(float(raw[0, 3]) - 1.0)
    assert process_logits(logits, requests[:1]).data_ptr() == logits.data_ptr()
    bf16 = raw.bfloat16()
    process_logits(bf16, requests[:1])
    assert torch.equal(bf16, raw.bfloat16())  # another dtype is converted, hence copied


@settings(max_examples=60, deadline=None)
@given(
    logits=logit_rows,
    bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=10),
)
def test_logit_bias_adds_to_the_named_tokens(logits, bias):
    params = SamplingParams(logit_bias=bias)
    out = process_logits(torch.tensor([logits]), [scheduled(params, [1], [])])[0]
    expected = np.asarray(logits, dtype=np.float32)
    for token, value in bias.items():
        expected[token] += np.float32(value)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-4)


def test_logit_bias_steers_greedy():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 5.0
    params = SamplingParams(temperature=0.0, logit_bias={9: 100.0, 7: -100.0})
    assert Sampler()(logits, [scheduled(params, [1], [])]) == [9]


@settings(max_examples=80, deadline=None)
@given(
    logits=st.lists(st.floats(-8, 8, width=32), min_size=VOCAB, max_size=VOCAB, unique=True),
    min_p=st.floats(0.01, 1.0),
    temperature=st.floats(0.3, 2.0),
    top_k=st.sampled_from([0, 5, 20]),
    seed=st.integers(0, 2**32),
)
def test_min_p_samples_only_what_hf_keeps(logits, min_p, temperature, top_k, seed):
    params = SamplingParams(temperature=temperature, min_p=min_p, top_k=top_k)
    row = torch.tensor([logits]) / temperature
    if top_k:
        row = row.masked_fill(row < row.topk(top_k).values[:, -1:], float("-inf"))
    kept = MinPLogitsWarper(min_p)(None, row)[0]
    allowed = set(torch.nonzero(kept > float("-inf"))[:, 0].tolist())
    sampler = Sampler()
    for draw in range(5):
        request = scheduled(params, [1], [], i=seed % 1000)
        request.seed = seed + draw
        token = sampler(torch.tensor([logits]), [request])[0]
        assert token in allowed


class FixedGrammar:
    """A matcher stub that allows a fixed set of tokens."""

    def __init__(self, allowed: set[int]):
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = [0] * bitmask.shape[1]
        for token in self.allowed:
            words[token // 32] |= 1 << (token % 32)
        # int32 two's complement: bit 31 set is a negative word
        bitmask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words])


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(1, 130),  # sizes that are not multiples of 32 too (bitmask.py)
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_grammar_mask_keeps_exactly_the_allowed_tokens(vocab, data, dtype):
    allowed = data.draw(st.sets(st.integers(0, vocab - 1), min_size=1))
    logits = torch.randn(2, vocab).to(dtype)
    requests = [
        scheduled(SamplingParams(), [1], [], grammar=FixedGrammar(allowed)),
        scheduled(SamplingParams(), [1], [], i=1),  # unconstrained row of the same batch
    ]
    raw = logits.clone()
    out = process_logits(logits, requests)
    finite = set(torch.nonzero(out[0] > float("-inf"))[:, 0].tolist())
    assert finite == allowed
    assert torch.equal(out[1], raw[1])
    sampled = Sampler()(raw.clone(), [requests[0]])[0]
    assert sampled in allowed


def test_nothing_is_processed_when_no_request_asks(monkeypatch):
    def fail(*args):
        raise AssertionError("process_logits ran for a batch without penalties, bias or grammar")

    monkeypatch.setattr(sampler_module, "process_logits", fail)
    logits = torch.randn(2, VOCAB)
    requests = [
        scheduled(SamplingParams(temperature=0.0), [1], [2]),
        scheduled(SamplingParams(top_p=0.9, min_p=0.1), [1], [2], i=1),
    ]
    Sampler()(logits, requests)
    assert requests[0].all_token_ids is None  # no history handed over either


@settings(max_examples=80, deadline=None)
@given(
    vocab=st.integers(2, 100),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_greedy_under_a_grammar_is_the_argmax_of_the_allowed_tokens(vocab, data, dtype):
    """Greedy rows whose raw pick the grammar allows skip the mask; the pick must be the same
    as the masked argmax either way (reference: argmax over the allowed tokens, first on ties)."""
    logits = data.draw(
        st.lists(
            st.lists(st.integers(-3, 3), min_size=vocab, max_size=vocab), min_size=1, max_size=4
        )
    )  # small integers: ties are common
    rows = torch.tensor(logits, dtype=torch.float32).to(dtype)
    allowed = [data.draw(st.sets(st.integers(0, vocab - 1), min_size=1)) for _ in logits]
    requests = [
        scheduled(SamplingParams(temperature=0.0), [1], [], grammar=FixedGrammar(a), i=i)
        for i, a in enumerate(allowed)
    ]
    expected = []
    for row, a in zip(rows.float(), allowed, strict=True):
        masked = torch.full_like(row, float("-inf"))
        masked[sorted(a)] = row[sorted(a)]
        expected.append(int(masked.max(dim=-1).indices))
    assert Sampler()(rows.clone(), requests) == expected
