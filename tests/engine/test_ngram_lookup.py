"""The prompt lookup's proposals (engine/ngram_lookup.py): what a scan of the whole context
would propose, from an index kept up to date a few tokens at a time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import ngram_lookup
from engine.ngram_lookup import NgramLookup


def scan(tokens: list[int], sizes, k: int) -> list[int]:
    """The reference: for n from the longest size down, the latest earlier occurrence of the
    last n tokens, and the k tokens after it, the context extended by the proposal itself as
    the copy goes (a loop goes on)."""
    for n in sizes:
        if len(tokens) <= n:
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[start + n + i])
                return extended[len(tokens) :]
    return []


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), min_size=1, max_size=120),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=60),
    k=st.integers(0, 4),
    sizes=st.sampled_from([(2, 3), (1, 3), (3, 3), (1, 1)]),
)
def test_proposals_are_a_scan_of_the_whole_context(tokens, cuts, k, sizes):
    """A request's tokens grow by a few at a time (as verifying steps take 1 to k + 1); at
    each call the proposal equals the scan's. A small alphabet makes matches common."""
    lookup = NgramLookup(*sizes)
    length = 0
    for cut in cuts:
        length = min(len(tokens), length + cut)
        got = lookup.propose("r", tokens[:length], k)
        assert got == (scan(tokens[:length], lookup.sizes, k) if k else [])
        if length == len(tokens):
            break


def test_another_request_or_a_shorter_history_starts_a_new_index():
    lookup = NgramLookup()
    assert lookup.propose("a", [1, 2, 3, 9, 1, 2], 2) == [3, 9]
    assert lookup.propose("b", [1, 2, 7, 1, 2], 2) == [7, 1]  # not a's index
    assert lookup.propose("b", [1, 2, 7, 1, 2, 7, 1, 2], 4) == [7, 1, 2, 7]  # the loop goes on
    assert lookup.propose("b", [1, 2], 2) == []  # not an extension of b's: built again
    lookup.drop({"b"})
    assert lookup.propose("b", [4, 5, 6, 4, 5], 3) == [6, 4, 5]


def test_proposals_that_keep_failing_pause_proposing():
    """A share of kept tokens below MIN_KEPT_SHARE stops proposals for PAUSE_CALLS calls; one
    proposal after the pause may resume them."""
    lookup = NgramLookup()
    tokens = [1, 2, 3] * 10
    calls = 0
    while (proposal := lookup.propose("r", tokens, 3)) != []:
        assert proposal == [1, 2, 3]
        lookup.record(3, 0)
        calls += 1
    assert calls > 1  # one failure does not pause: the share is a running one
    for _ in range(ngram_lookup.PAUSE_CALLS - 1):
        assert lookup.propose("r", tokens, 3) == []
    assert lookup.propose("r", tokens, 3) == [1, 2, 3]
    lookup.record(3, 3)
    assert lookup.propose("r", tokens, 3) == [1, 2, 3]  # kept: proposing goes on


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="n-gram"):
        NgramLookup(3, 2)
