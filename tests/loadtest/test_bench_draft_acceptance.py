"""The draft-acceptance bench's arithmetic: tokens a verification pass yields for drafts of k."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from loadtest.bench_draft_acceptance import tokens_per_pass


def test_tokens_per_pass_by_hand():
    # All agree: each pass takes k drafted tokens and the verifier's own; the last pass what is
    # left. 6 tokens, k=2: passes of 3 and 3.
    assert tokens_per_pass([[True] * 6], 2) == 3.0
    # None agree: one token (the verifier's) a pass.
    assert tokens_per_pass([[False] * 5], 4) == 1.0
    # T F T T F, k=2: [T, F] -> 2 tokens (T + the verifier's at F); [T, T] -> 3 tokens (k=2
    # accepted + the verifier's, which is position 4's): 2 passes, 5 tokens.
    assert tokens_per_pass([[True, False, True, True, False]], 2) == 2.5


@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=40), min_size=1, max_size=5),
       st.integers(1, 8))  # fmt: skip
def test_a_pass_yields_one_to_k_plus_one_tokens(hits, k):
    value = tokens_per_pass(hits, k)
    assert 1.0 <= value <= k + 1
    if all(all(stream) for stream in hits) and all(len(s) % (k + 1) == 0 for s in hits):
        assert value == k + 1
