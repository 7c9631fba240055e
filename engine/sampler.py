"""Logits -> token ids: greedy, temperature, top-k, top-p, one random stream per request.

Reproducibility rule: a request's samples depend only on its own logits row and its own
generator (seeded with `ScheduledRequest.seed` the first time the request is sampled, kept across
steps and preemptions, dropped when the request finishes), never on what else is in the batch.
So every random draw and every filtering decision is made per row, on ops whose result for one
row does not depend on the others (row-wise softmax, sequential cumsum).

Sampling is by inverse CDF: one uniform draw per token, `searchsorted` into the cumulative
weights. Full-vocabulary sorts are avoided (about 100 ms for 32 x 49k logits on this CPU):
top-k takes `topk(k)`; top-p alone takes `topk` of a growing candidate set until it holds the
nucleus. min_p is applied last (as in HF: after top-k and top-p), to the kept candidates.
Rows that start alike take that first `topk` (or cumsum) in one call over them (a row's values
are its own either way): W2 sampled at temperature 0.7, top-p 0.9 ran 1.09x faster than with a
call per row (loadtest/JOURNAL.md). That first `topk` is the fused ops' `topk_rows` where they
are built (`_topk`: of equal values the lower index first); torch's elsewhere.

Penalties, logit bias and the structured-output mask (engine/logits_processors.py) run first,
on a copy, only when some request of the batch asks for one.
"""

from __future__ import annotations

import functools

import torch

from engine.logits_processors import process_logits
from engine.sampling_params import MIN_TEMPERATURE
from engine.scheduler_output import ScheduledRequest

# Candidate set for a top-p-only row before doubling; nuclei of real models are usually smaller.
_INITIAL_NUCLEUS_CANDIDATES = 64


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def drop(self, request_ids: list[str]) -> None:
        """Forget finished requests' random streams."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[ScheduledRequest],
        greedy_ids: torch.Tensor | None = None,
    ) -> list[int]:
        """logits [num_requests, vocab] (row i belongs to requests[i]; any float dtype: greedy
        rows take the argmax as is, sampled rows are computed in float32) -> token ids.
        `greedy_ids`: the argmax of every row of `logits`, found already (the fused decode
        step's), used where every request takes it (`takes_argmax`)."""
        if greedy_ids is not None and all(takes_argmax(r) for r in requests):
            return greedy_ids.tolist()
        if any(r.params.has_logits_processing or r.grammar is not None for r in requests):
            logits = process_logits(logits, requests)
        random_rows = [i for i, r in enumerate(requests) if r.params.temperature >= MIN_TEMPERATURE]
        if not random_rows:  # all greedy: one argmax over the batch, one host sync
            return _argmax(logits).tolist()
        for i in random_rows:  # greedy rows never draw, so they need no generator
            self._generator_for(requests[i])
        token_ids = [0] * len(requests)
        greedy_rows = [i for i, r in enumerate(requests) if r.params.temperature < MIN_TEMPERATURE]
        if greedy_rows:
            for i, token in zip(greedy_rows, _argmax(logits[greedy_rows]).tolist(), strict=True):
                token_ids[i] = token
        temperatures = torch.tensor(
            [requests[i].params.temperature for i in random_rows], dtype=torch.float32
        )
        # (the logits may hold rows past the requests': only the requests' are read)
        rows = logits if len(random_rows) == logits.shape[0] else logits[random_rows]
        probs = _probabilities(rows, temperatures)  # [rows, vocab]
        sampled = self._sample_rows(probs, [requests[i] for i in random_rows])
        for i, token in zip(random_rows, sampled, strict=True):
            token_ids[i] = token
        return token_ids

    def verify(
        self, logits: torch.Tensor, request: ScheduledRequest, proposals: list[int]
    ) -> list[int]:
        """A speculative step's rows for one request (engine/fused_decode.py `speculate`):
        logits [k + 1, vocab], row j computed with proposals[j - 1] as its input -> the tokens
        sampled row by row, each as a one-token step samples it (as this sampler's call on a
        one-row batch draws it: the request's own random stream, one draw a token), up to the first that differs
        from the proposal the next row was computed with, that one included. So the tokens, and
        the draws left in the stream, are the one-token steps'. The rows' probabilities and
        first candidates are computed in one call over them (row-wise ops: each row's values
        are the ones it gets alone); the draws go row by row and stop there."""
        if takes_argmax(request) or request.params.has_logits_processing or request.grammar:
            return self._verify_rows(logits, request, proposals)
        self._generator_for(request)
        params = request.params
        temperatures = torch.full((logits.shape[0],), params.temperature, dtype=torch.float32)
        probs = _probabilities(logits, temperatures)
        firsts = _firsts(probs, _first_candidates(params, probs.shape[1]))
        tokens: list[int] = []
        for j in range(probs.shape[0]):
            tokens.append(self._sample_row(probs[j], request, firsts[j]))
            if j == len(proposals) or tokens[-1] != proposals[j]:
                break
        return tokens

    def _verify_rows(
        self, logits: torch.Tensor, request: ScheduledRequest, proposals: list[int]
    ) -> list[int]:
        """`verify` as one-row calls of the sampler, row by row."""
        tokens: list[int] = []
        for j in range(logits.shape[0]):
            tokens.append(self(logits[j : j + 1], [request])[0])
            if j == len(proposals) or tokens[-1] != proposals[j]:
                break
        return tokens

    def _generator_for(self, request: ScheduledRequest) -> torch.Generator:
        """The request's random stream, seeded with its seed the first time it is sampled."""
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(request.seed)
            self._generators[request.request_id] = generator
        return generator

    def _sample_rows(self, probs: torch.Tensor, requests: list[ScheduledRequest]) -> list[int]:
        """probs [rows, vocab] (row i: requests[i]'s) -> a token id per row, each drawn as
        `_sample_row` draws it alone. Rows whose first step is the same op (the whole
        vocabulary's cumsum, or `topk` of the same count, then its cumsum) take it in one call
        over their group: these ops compute each row on its own, so a row's values are the ones
        it gets alone (tests/engine/test_sampler.py holds them to it), and one call over 32 rows
        costs under half of 32 calls. The rest (a nucleus past the first candidates, min-p, the
        draw) goes row by row."""
        vocab_size = probs.shape[1]
        groups: dict[int, list[int]] = {}  # the first op's candidate count (0: the cumsum) -> rows
        for row, request in enumerate(requests):
            groups.setdefault(_first_candidates(request.params, vocab_size), []).append(row)
        tokens = [0] * len(requests)
        for count, rows in groups.items():
            # (the rows' own copy only where the group's first op reads them: count >= 0)
            group = probs if len(rows) == probs.shape[0] or count < 0 else probs[rows]
            firsts = _firsts(group, count)
            for j, row in enumerate(rows):
                tokens[row] = self._sample_row(probs[row], requests[row], firsts[j])
        return tokens

    def _sample_row(
        self, probs: torch.Tensor, request: ScheduledRequest, first=None
    ) -> int:
        """probs [vocab] -> one token id, honouring the request's top-k and top-p. `first`:
        the first op's result for this row where `_sample_rows` took it over a group (the
        whole vocabulary's cumsum, or the first candidates' (values, indices, cumsum))."""
        params = request.params
        generator = self._generators[request.request_id]
        vocab_size = probs.shape[0]
        top_k = _top_k(params, vocab_size)
        if top_k is None and params.top_p >= 1.0:
            if first is not None:
                return _draw(first, generator)
            if params.min_p > 0.0:
                probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
            return _draw(probs.cumsum(0), generator)
        num_candidates = top_k or min(_INITIAL_NUCLEUS_CANDIDATES, vocab_size)
        while True:
            if first is not None:
                values, indices, cdf = first
                first = None
            else:
                values, indices = probs.topk(num_candidates)  # sorted, descending
                cdf = values.cumsum(0)
            # Top-p is taken over the top-k renormalised distribution (as in HF and vLLM).
            mass = float(cdf[-1]) if top_k else 1.0
            threshold = params.top_p * mass
            if top_k or float(cdf[-1]) >= threshold or num_candidates == vocab_size:
                break
            num_candidates = min(2 * num_candidates, vocab_size)
        # Smallest prefix whose mass reaches the threshold; always at least one token.
        num_kept = min(int(torch.searchsorted(cdf, threshold)) + 1, num_candidates)
        if params.min_p > 0.0:  # values are sorted: min_p keeps a prefix, the top one at least
            num_kept = min(num_kept, max(int((values >= params.min_p * values[0]).sum()), 1))
        return int(indices[_draw(cdf[:num_kept], generator)])


def _topk(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of probs [rows, vocab] (float32), sorted: value descending,
    of equal values the lower index first. The fused ops' `topk_rows` where they are built (a
    vector compare skips most of a row once k values are kept: 32 x 49k rows in 0.6 ms against
    torch's 2.1); torch's topk otherwise, and for a row holding a NaN (ranked first there).
    Either way a row's result depends on that row alone."""
    kernels = _fused_ops()
    if kernels is None or probs.device.type != "cpu" or probs.dtype != torch.float32:
        return probs.topk(k, dim=-1)
    probs = probs.contiguous()
    values, indices, taken = kernels.topk_rows(probs, k)
    if not bool(taken.all()):
        for row in (~taken).nonzero().flatten().tolist():
            values[row], indices[row] = probs[row].topk(k)
    return values, indices


def _probabilities(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """softmax(float32 logits [rows, vocab] / temperatures [rows], row by row) [rows, vocab]: the
    fused ops' `softmax_rows` where they are built (torch's bits in one call, each row on one
    thread: 43 against ~70 us for a 49k row, where the chain below also woke the second thread
    at each of its three ops), else that chain; the chain too for a call with a row that is NaN
    or all -inf (its probabilities are torch's NaN either way)."""
    kernels = _row_kernels(logits)
    if kernels is not None:
        probs, done = kernels.softmax_rows(logits, temperatures, _exp_lanes())
        if bool(done.all()):
            return probs
    return torch.softmax(_scaled(logits, temperatures), dim=-1)


@functools.cache
def _exp_lanes() -> int:
    """The lanes of torch's vectorised exp in this process (fused_ops.lanes)."""
    from engine.kernels.cpu import fused_ops

    return (fused_ops.lanes() or (8, 0))[1]


def _scaled(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """float32 logits [rows, vocab] / temperatures [rows], row by row, in one new tensor (the
    division in place on the float32 copy, or on a copy of float32 logits)."""
    scaled = logits.float()
    if scaled is logits:
        scaled = scaled.clone()
    return scaled.div_(temperatures[:, None])


def _first_candidates(params, vocab_size: int) -> int:
    """How `Sampler._sample_row` starts on a row: `topk` of this many candidates (top-k, or
    top-p's first nucleus), 0 for the whole vocabulary's cumsum, -1 for that after min-p's
    mask (a row's own op first)."""
    top_k = _top_k(params, vocab_size)
    if top_k is None and params.top_p >= 1.0:
        return -1 if params.min_p > 0.0 else 0
    return top_k or min(_INITIAL_NUCLEUS_CANDIDATES, vocab_size)


def _top_k(params, vocab_size: int) -> int | None:
    """The request's top-k where it keeps fewer than the whole vocabulary, else None."""
    return params.top_k if 0 < params.top_k < vocab_size else None


def _firsts(group: torch.Tensor, count: int) -> list:
    """`Sampler._sample_row`'s first op for every row of `group` [rows, vocab] (rows that start
    alike: `_first_candidates` gave them `count`), in one call over them: the whole vocabulary's
    cumsum (count 0), the first candidates' (values, indices, cumsum), or None each (count -1:
    min-p masks each row on its own first)."""
    if count < 0:
        return [None] * group.shape[0]
    if count == 0:
        return list(group.cumsum(-1))
    values, indices = _topk(group, count)
    return list(zip(values, indices, values.cumsum(-1), strict=True))


def takes_argmax(request: ScheduledRequest) -> bool:
    """Whether the request's token is the argmax of its logits as the model gives them
    (greedy, no logits processing, no grammar)."""
    params = request.params
    return (
        params.temperature < MIN_TEMPERATURE
        and not params.has_logits_processing
        and request.grammar is None
    )


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy ids [rows]: the fused ops' row-wise argmax on CPU (the same indices as
    `max(dim).indices`, 3.5x faster for [32, 49152] bf16: 0.19 against 0.66 ms), else torch's
    `max(dim).indices` (itself 3x faster than `argmax` on CPU)."""
    kernels = _row_kernels(logits)
    if kernels is not None:
        return kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices


def _row_kernels(logits: torch.Tensor):
    """The fused ops where they are built and can read `logits` (CPU rows of float32 or bf16,
    unit last stride, at least one column); else None."""
    kernels = _fused_ops()
    if (
        kernels is not None
        and logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.stride(1) == 1
    ):
        return kernels
    return None


def _fused_ops():
    """The fused C++ ops (argmax_rows, topk_rows, softmax_rows) where they load, else None."""
    from engine.kernels.cpu import fused_ops

    return fused_ops.load()


def _draw(cdf: torch.Tensor, generator: torch.Generator) -> int:
    """Index i with probability (cdf[i] - cdf[i-1]) / cdf[-1]; zero-weight entries never win."""
    total = cdf[-1:]
    uniform = torch.rand(1, generator=generator, dtype=cdf.dtype)
    index = torch.searchsorted(cdf, uniform * total, right=True)
    # Rounding can push uniform * total up to the total; fall back on the last entry with weight.
    last_weighted = torch.searchsorted(cdf, total)
    return int(torch.minimum(index, last_weighted))
