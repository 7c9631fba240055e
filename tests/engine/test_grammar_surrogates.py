"""Regex and choice grammars never produce UTF-16 surrogate code points (engine/structured)."""

from __future__ import annotations

import re

import pytest
import xgrammar
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutput
from engine.structured.surrogates import _rewrite_class, exclude_surrogates, is_surrogate

# Patterns on which xgrammar and Python's re agree (`.` takes newlines: re.S).
PATTERNS = [r"[^a-z]{1,4}", r".{1,4}", r"[^0-9]{2,3}x", r"(ab|[^b]{1,3})", r"[\s\S]{1,3}"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_num_seqs=8)


def _code_points(class_text: str) -> set[int]:
    """The code points a rewritten class allows, by its ranges (positive classes only)."""
    _, text = _rewrite_class(class_text, 0)  # a rewrite leaves a rewritten class as it is
    assert text == class_text
    inner, points, i = class_text[1:-1], set(), 0
    while i < len(inner):
        low = int(inner[i + 2 : i + 10], 16)
        i += 10
        high = low
        if i < len(inner) and inner[i] == "-":
            high = int(inner[i + 3 : i + 11], 16)
            i += 11
        points |= set(range(low, high + 1))
    return points


ranges = st.lists(
    st.tuples(st.integers(0xD000, 0xE100), st.integers(0, 0x200)).map(lambda t: (t[0], t[0] + t[1])),
    min_size=1, max_size=4,
)  # fmt: skip


@given(ranges)
def test_a_class_keeps_every_code_point_but_the_surrogates(class_ranges):
    text = "[" + "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in class_ranges) + "]"
    want = {c for lo, hi in class_ranges for c in range(lo, hi + 1) if not is_surrogate(c)}
    if not want:
        with pytest.raises(ValueError, match="surrogates only"):
            exclude_surrogates(text)
        return
    rewritten = exclude_surrogates(text)
    assert _code_points(rewritten) == want
    xgrammar.Grammar.from_ebnf(f"root ::= {rewritten}")  # still xgrammar's EBNF


def test_negated_classes_and_literals():
    assert exclude_surrogates(r'root ::= [^a\]] "x\"[" [a-z]') == (
        r'root ::= [^a\]\ud800-\udfff] "x\"[" [a-z]'
    )
    with pytest.raises(ValueError, match="U\\+D800"):
        exclude_surrogates(r'root ::= "a\ud800"')


def test_surrogate_specs_are_clear_errors(llm):
    for spec in (
        StructuredOutput("regex", r"\uD800"),
        StructuredOutput("regex", "[\\ud800-\\udfff]"),
    ):
        with pytest.raises(ValueError, match="surrogate"):
            llm.engine.add_request("s", "hi", SamplingParams(structured_output=spec))
    for kind, spec in (("regex", "a\ud800"), ("choice", ["ok", "\udfff"])):
        with pytest.raises(ValueError, match="surrogate"):
            StructuredOutput(kind, spec)
    assert not llm.engine.has_unfinished_requests()


@settings(max_examples=8, deadline=None)
@given(pattern=st.sampled_from(PATTERNS), temperature=st.sampled_from([1.0, 1.5]),
       seed=st.integers(0, 99))  # fmt: skip
# Found by hypothesis: the tiny model spelt a surrogate byte by byte (ED then A0..BF) in a
# negated class, which xgrammar's regex allowed; the text decoded to U+FFFD.
@example(pattern=r"[^a-z]{1,4}", temperature=1.0, seed=53)
def test_regex_outputs_are_text_that_matches(llm, pattern, temperature, seed):
    structured = StructuredOutput("regex", pattern)
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=seed,
                            structured_output=structured)  # fmt: skip
    output = llm.generate("The quick brown fox", params)[0]
    assert output.finish_reason == "stop", output
    assert "\ufffd" not in output.text and re.fullmatch(pattern, output.text, re.S), output.text
