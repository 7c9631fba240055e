"""SamplingParams validation: every bad value is a ValueError naming the field, never another
exception; good values are frozen to hashable tuples."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling_params import SamplingParams, StructuredOutput

anything = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=5), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.integers(-5, 5), st.floats(allow_nan=True), max_size=3),
)  # fmt: skip


def _valid(name: str, value) -> bool:
    """The rule, written independently of the implementation."""
    real = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if name in ("presence_penalty", "frequency_penalty"):
        return real and -2 <= value <= 2
    if name == "repetition_penalty":
        return real and 0 < value <= 10
    if name == "min_p":
        return real and 0 <= value <= 1
    raise AssertionError(name)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(["presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"]),
    value=anything,
)
def test_penalties_and_min_p_accept_exactly_their_range(name, value):
    if _valid(name, value):
        assert getattr(SamplingParams(**{name: value}), name) == value
    else:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: value})


@settings(max_examples=300, deadline=None)
@given(bias=anything)
def test_logit_bias_is_validated_never_crashes(bias):
    try:
        params = SamplingParams(logit_bias=bias)
    except ValueError as error:
        assert "logit_bias" in str(error)
        return
    # Accepted: a mapping of non-negative ids to finite numbers within +-100, frozen sorted.
    assert isinstance(params.logit_bias, tuple)
    for token, value in params.logit_bias:
        assert isinstance(token, int) and token >= 0 and -100 <= value <= 100
    hash(params)


def test_logit_bias_examples():
    assert SamplingParams(logit_bias={5: 1, 2: -3.5}).logit_bias == ((2, -3.5), (5, 1.0))
    for bad in (
        {-1: 1.0},
        {1: 101.0},
        {1: math.inf},
        {True: 1.0},
        {"a": 1.0},
        [(1, 1.0), (1, 2.0)],
    ):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="at most"):
        SamplingParams(logit_bias={i: 0.0 for i in range(1025)})


def test_stop_as_a_string_or_a_list():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["ok", ""])


def test_structured_output_specs():
    assert StructuredOutput("choice", ["a", "b"]).spec == ("a", "b")
    assert StructuredOutput("json_object").spec is None
    for kind, spec in [("yaml", None), ("choice", []), ("choice", ["a", ""]), ("json_schema", ""),
                       ("regex", None), ("json_schema", {"type": "object"})]:  # fmt: skip
        with pytest.raises(ValueError):
            StructuredOutput(kind, spec)
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(structured_output={"type": "json_object"})
