"""Prompt lookup: draft tokens for speculative decoding taken from the request's own tokens.

A greedy continuation often repeats what its context holds: a name or a phrase of the prompt,
a list's pattern, code it is editing, a small model's loops. The lookup finds the latest
earlier place where the context's last n tokens occurred (n from MAX_NGRAM down to MIN_NGRAM)
and proposes the tokens that followed them there (a copy that runs past the end of the context
goes on from its own start, as LZ77's copies do: a loop of p tokens is proposed for as
long as it lasts). It costs no model pass: the verifying step
(engine/fused_decode.py `speculate`) computes each proposed row's greedy token exactly and keeps
the proposals that match, so the output is the one-token steps' whatever was proposed.

Where proposals keep failing (a text that does not repeat itself), each costs a verifying step's
extra rows for nothing; the lookup then stops proposing for a while (`record`): where none is
ever kept, after the first ~11 it tries one in PAUSE_CALLS + 1 steps, about 2% of the step
time at 4 rows' cost (1.5 one-row steps).

The index is incremental: per n, a dict from each n-gram to where it last began, extended with
the tokens the request gained since the last call (a few dict operations a step, not a scan of
the context). Each running request has its own (requests that decode together propose in the
same step: `FusedDecode.speculate_batch`), dropped when the request leaves; at most
MAX_NUM_INDEXES are kept (the least recently used goes, and is built again in one pass should
its request ask again).
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_NGRAM, MAX_NGRAM = 2, 3
# A proposal's share of tokens kept, below which proposing stops: a verifying step's extra rows
# cost a fraction of a one-row step each (int4 SmolLM2 on 2 cores: 1.17x the one-row step's time
# at 2 rows, 1.39x at 3, 1.50x at 4), and every kept token saves a whole step.
MIN_KEPT_SHARE = 0.25
KEPT_SHARE_WEIGHT = 0.125  # of the latest proposal in the running share
PAUSE_CALLS = 16  # calls without a proposal after the share fell below MIN_KEPT_SHARE
# Requests whose indexes are kept (a bound, should a request leave without `drop`).
MAX_NUM_INDEXES = 256


class _Index:
    """One request's n-gram index, and its proposals' running share kept."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.indexed = 0  # tokens of the request indexed so far
        self.starts: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.match: dict[int, int | None] = dict.fromkeys(sizes)  # per n: the tail's
        self.kept_share = 1.0
        self.paused = 0


class NgramLookup:
    def __init__(self, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.sizes = tuple(range(max_n, min_n - 1, -1))  # the longest match first
        self._indexes: dict[str, _Index] = {}  # by request id, the latest used last

    def drop(self, request_ids) -> None:
        """Forget the indexes of requests that left."""
        for request_id in request_ids:
            self._indexes.pop(request_id, None)

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the last n of `tokens`
        (the request's prompt and output so far: only ever extended between calls for one
        request id); [] where none occurred or proposing is paused."""
        index = self._indexes.pop(request_id, None)
        if index is None or len(tokens) < index.indexed:
            index = _Index(self.sizes)
        self._indexes[request_id] = index  # the latest used last
        if len(self._indexes) > MAX_NUM_INDEXES:
            del self._indexes[next(iter(self._indexes))]
        self._extend(index, tokens)
        if k <= 0:
            return []
        if index.paused:
            index.paused -= 1
            return []
        for n in self.sizes:
            start = index.match[n]
            if start is not None:
                return _copy(tokens, start + n, k)
        return []

    def _extend(self, index: _Index, tokens: Sequence[int]) -> None:
        length = len(tokens)
        for end in range(index.indexed + 1, length + 1):  # the n-grams ending before `end`
            for n in self.sizes:
                if end >= n:
                    gram = tuple(tokens[end - n : end])
                    starts = index.starts[n]
                    if end == length:  # the tail: where it occurred before, for `propose`
                        index.match[n] = starts.get(gram)
                    starts[gram] = end - n
        index.indexed = length

    def record(self, request_id: str, proposed: int, kept: int) -> None:
        """The verifying step kept `kept` of the `proposed` tokens of the request's last
        proposal."""
        index = self._indexes.get(request_id)
        if index is None:
            return
        share = kept / proposed if proposed else 0.0
        index.kept_share += KEPT_SHARE_WEIGHT * (share - index.kept_share)
        if index.kept_share < MIN_KEPT_SHARE:
            index.paused = PAUSE_CALLS
            index.kept_share = MIN_KEPT_SHARE  # one proposal after the pause may resume it


def _copy(tokens: Sequence[int], source: int, k: int) -> list[int]:
    """k tokens from `source` on; past the end of `tokens`, the copy's own first tokens again
    (source < len(tokens), so each index past the end names a token already copied)."""
    out: list[int] = []
    length = len(tokens)
    for i in range(k):
        j = source + i
        out.append(tokens[j] if j < length else out[j - length])
    return out
