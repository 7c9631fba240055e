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


def test_each_request_has_its_own_index_and_a_shorter_history_starts_a_new_one():
    lookup = NgramLookup()
    assert lookup.propose("a", [1, 2, 3, 9, 1, 2], 2) == [3, 9]
    assert lookup.propose("b", [1, 2, 7, 1, 2], 2) == [7, 1]  # not a's index
    assert lookup.propose("a", [1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]  # a's, extended
    assert lookup.propose("b", [1, 2, 7, 1, 2, 7, 1, 2], 4) == [7, 1, 2, 7]  # the loop goes on
    assert lookup.propose("b", [1, 2], 2) == []  # not an extension of b's: built again
    lookup.drop({"b"})
    assert lookup.propose("b", [4, 5, 6, 4, 5], 3) == [6, 4, 5]


@settings(max_examples=50, deadline=None)
@given(
    streams=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=40), min_size=2, max_size=4),
    order=st.lists(st.integers(0, 3), min_size=1, max_size=80),
)
def test_requests_taking_turns_propose_what_each_alone_would(streams, order):
    """Requests that decode together call in turns: each one's proposals are the scan of its
    own context, however the calls interleave and however many indexes are kept."""
    lookup = NgramLookup()
    lengths = [0] * len(streams)
    for turn in order:
        i = turn % len(streams)
        lengths[i] = min(len(streams[i]), lengths[i] + 1)
        context = streams[i][: lengths[i]]
        assert lookup.propose(f"r{i}", context, 3) == scan(context, lookup.sizes, 3)


def test_the_indexes_kept_are_bounded(monkeypatch):
    monkeypatch.setattr(ngram_lookup, "MAX_NUM_INDEXES", 2)
    lookup = NgramLookup()
    for name in "abc":
        assert lookup.propose(name, [1, 2, 3, 1, 2], 1) == [3]
    assert len(lookup._indexes) == 2 and "a" not in lookup._indexes  # the least recent went
    assert lookup.propose("a", [1, 2, 3, 1, 2, 3], 1) == [1]  # built again from its tokens


def test_proposals_that_keep_failing_pause_proposing():
    """A share of kept tokens below MIN_KEPT_SHARE stops proposals for PAUSE_CALLS calls; one
    proposal after the pause may resume them."""
    lookup = NgramLookup()
    tokens = [1, 2, 3] * 10
    calls = 0
    while (proposal := lookup.propose("r", tokens, 3)) != []:
        assert proposal == [1, 2, 3]
        lookup.record("r", 3, 0)
        calls += 1
    assert calls > 1  # one failure does not pause: the share is a running one
    for _ in range(ngram_lookup.PAUSE_CALLS - 1):
        assert lookup.propose("r", tokens, 3) == []
    assert lookup.propose("r", tokens, 3) == [1, 2, 3]
    lookup.record("r", 3, 3)
    assert lookup.propose("r", tokens, 3) == [1, 2, 3]  # kept: proposing goes on
    assert lookup.propose("other", tokens, 3) == [1, 2, 3]  # another request's own share


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="n-gram"):
        NgramLookup(3, 2)
