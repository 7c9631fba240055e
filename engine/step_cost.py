"""How long a step takes, from what it computes. Pure Python: no torch.

The scheduler asks this model how many tokens fit under `step_time_target_ms` while urgent
work waits or runs (and under `max_step_time_ms` otherwise), and the worker asks it whether a
deadline can still be met. A step is a
set of chunks, each `num_new` tokens at positions `start ... start + num_new`:

    cost_ms = fixed_ms + per_token_ms * sum(num_new) + per_attention_ms * sum(num_new * context)

where `context = start + num_new` (the tokens each new token attends to, at most) and
`per_attention_ms` is per 1000 token pairs. The fixed part is the per-step overhead (the
scheduler, weights streamed once per step, sampling), the linear part the matmuls, the product
part attention. Coefficients come from `calibrate_on` at start-up (a few steps timed on the
running machine); after every real step `observe` corrects them: one scale factor, an EWMA of
measured over predicted, so a machine that got busier (or a model that runs faster once warm)
is followed within a few steps without refitting the shape.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from engine.sampling_params import SamplingParams

Chunk = tuple[int, int]  # (start position, number of new tokens)

# Untimed defaults, in the range of a 135M model on two CPU cores; `calibrate` replaces them.
DEFAULT_FIXED_MS = 10.0
DEFAULT_PER_TOKEN_MS = 0.5
DEFAULT_PER_ATTENTION_MS = 0.002
EWMA_ALPHA = 0.2
MIN_SCALE, MAX_SCALE = 0.25, 4.0
UNBOUNDED = 1 << 30  # tokens: a model that says a chunk costs nothing


class StepCostModel:
    def __init__(
        self,
        fixed_ms: float = DEFAULT_FIXED_MS,
        per_token_ms: float = DEFAULT_PER_TOKEN_MS,
        per_attention_ms: float = DEFAULT_PER_ATTENTION_MS,
    ) -> None:
        if min(fixed_ms, per_token_ms, per_attention_ms) < 0:
            raise ValueError("step cost coefficients must be >= 0")
        self.fixed_ms = fixed_ms
        self.per_token_ms = per_token_ms
        self.per_attention_ms = per_attention_ms
        self.scale = 1.0  # measured / predicted, smoothed (the online correction)
        self.num_observed = 0

    def chunk_ms(self, start: int, num_new: int) -> float:
        """The variable cost of one chunk (no fixed part), corrected."""
        pairs_k = num_new * (start + num_new) / 1000
        return self.scale * (self.per_token_ms * num_new + self.per_attention_ms * pairs_k)

    def step_fixed_ms(self) -> float:
        return self.scale * self.fixed_ms

    def predict_ms(self, chunks: Iterable[Chunk]) -> float:
        return self.step_fixed_ms() + sum(self.chunk_ms(s, n) for s, n in chunks)

    def max_new_tokens(self, start: int, budget_ms: float) -> int:
        """The most tokens a chunk starting at `start` may have and cost at most `budget_ms`.
        Solves a*n^2 + b*n <= budget for n (a: attention, b: linear plus attention to `start`)."""
        if budget_ms <= 0:
            return 0
        a = self.scale * self.per_attention_ms / 1000
        b = self.scale * (self.per_token_ms + self.per_attention_ms * start / 1000)
        if a <= 0:
            return UNBOUNDED if b <= 0 else int(budget_ms / b)
        return int((-b + math.sqrt(b * b + 4 * a * budget_ms)) / (2 * a))

    def prefill_ms(self, num_tokens: int, max_tokens_per_step: int) -> float:
        """A lower bound on the time to prefill `num_tokens` in steps of at most
        `max_tokens_per_step` tokens (attention between them left out: it only adds)."""
        if num_tokens <= 0:
            return 0.0
        num_steps = math.ceil(num_tokens / max(1, max_tokens_per_step))
        return num_steps * self.step_fixed_ms() + self.scale * self.per_token_ms * num_tokens

    def observe(self, chunks: list[Chunk], measured_ms: float) -> None:
        """Correct the scale by one measured step (ignored if it computed nothing)."""
        if not chunks or measured_ms <= 0:
            return
        raw = self.fixed_ms + sum(self.chunk_ms(s, n) for s, n in chunks) / self.scale
        if raw <= 0:
            return
        ratio = min(MAX_SCALE, max(MIN_SCALE, measured_ms / raw))
        self.scale = (1 - EWMA_ALPHA) * self.scale + EWMA_ALPHA * ratio
        self.num_observed += 1

    def __repr__(self) -> str:
        return (
            f"StepCostModel(fixed_ms={self.fixed_ms:.2f}, per_token_ms={self.per_token_ms:.4f}, "
            f"per_attention_ms={self.per_attention_ms:.5f}, scale={self.scale:.2f})"
        )


def fit(samples: list[tuple[list[Chunk], float]]) -> StepCostModel:
    """Least squares of the three coefficients over timed steps, each clamped at >= 0.

    A tiny normal-equations solve (3x3): the samples are a handful of start-up steps."""
    rows = [
        (1.0, float(sum(n for _, n in chunks)), sum(n * (s + n) for s, n in chunks) / 1000, ms)
        for chunks, ms in samples
    ]
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    atb = [sum(r[i] * r[3] for r in rows) for i in range(3)]
    coefficients = _solve3(ata, atb)
    if coefficients is None or min(coefficients) < 0:
        # Degenerate or a negative term (noise): fit fixed + per token only, attention default.
        return _fit_linear(rows)
    return StepCostModel(*coefficients)


def _fit_linear(rows) -> StepCostModel:
    n = len(rows)
    xs, ys = [r[1] for r in rows], [r[3] for r in rows]
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var_x = sum((x - mean_x) ** 2 for x in xs)
    slope = (
        sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var_x
        if var_x
        else 0
    )
    slope = max(slope, 1e-4)
    return StepCostModel(max(0.0, mean_y - slope * mean_x), slope, DEFAULT_PER_ATTENTION_MS)


def _solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    m = [row[:] + [v] for row, v in zip(a, b, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(3):
            if r != col:
                factor = m[r][col] / m[col][col]
                m[r] = [x - factor * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][3] / m[i][i] for i in range(3)]


# The start-up probe: a decode step of a few requests, then prefills of growing size (the n^2
# attention term shows in the longest), until the time budget is spent: on a slow or loaded
# machine (or a slow prefill kernel) start-up must not wait for the long probes, and the online
# correction takes it from there.
CALIBRATION_PROMPT_LENS = (8, 64, 256, 512)
CALIBRATION_NUM_DECODES = 8
CALIBRATION_BUDGET_S = 3.0


def calibrate_on(engine, budget_s: float = CALIBRATION_BUDGET_S) -> StepCostModel:
    """Time a few real steps of `engine` (an `LLMEngine` with nothing in it) and fit the model.

    Each prefill runs twice on fresh token ids (no prefix-cache hit) and the faster counts (the
    first may pay for cold caches), as long as `budget_s` lasts. The requests are aborted and the
    scheduler's counters (and the engine's arrival count, which derives seeds) put back, so
    nothing shows afterwards. About a second for a 135M model on 2 idle cores."""
    scheduler = engine.scheduler
    counters = {k: v for k, v in vars(scheduler).items() if k.startswith("num_")}
    num_arrivals = getattr(engine, "_num_arrivals", None)  # derives seeds: put back as well
    max_len = min(engine.max_model_len - 2, engine.config.max_num_batched_tokens)
    vocab = max(2, engine.vocab_size)
    serial = iter(range(1 << 30))
    priority = engine.config.urgent_priority + 1  # not urgent: never the urgent cap
    cost_model, scheduler.cost_model = scheduler.cost_model, None  # no cap at all: whole steps
    deadline_s = time.perf_counter() + budget_s

    def prompt(num_tokens: int) -> list[int]:
        base = next(serial) * 7919
        return [1 + (base + i * 31) % (vocab - 1) for i in range(num_tokens)]

    def timed_step() -> float:
        started = time.perf_counter()
        engine.step()
        return (time.perf_counter() - started) * 1000

    samples = [_decode_sample(engine, prompt, timed_step, serial, priority)]
    for num_tokens in (n for n in CALIBRATION_PROMPT_LENS if n <= max_len):
        if time.perf_counter() > deadline_s and len(samples) >= 2:
            break
        times_ms = []
        for _ in range(2):
            rid = f"step-cost-{next(serial)}"
            engine.add_request(rid, prompt(num_tokens), SamplingParams(max_tokens=2), priority)
            times_ms.append(timed_step())
            engine.abort_request(rid)
            if time.perf_counter() > deadline_s:
                break
        samples.append(([(0, num_tokens)], min(times_ms)))
    engine.step()  # lets the runner drop the aborted requests' state
    vars(scheduler).update(counters)
    scheduler.cost_model = cost_model
    if num_arrivals is not None:
        engine._num_arrivals = num_arrivals
    return fit(samples)


def _decode_sample(engine, prompt, timed_step, serial, priority) -> tuple[list[Chunk], float]:
    """A decode step of a few 4-token requests (the best of two)."""
    num_decodes = min(CALIBRATION_NUM_DECODES, engine.config.max_num_seqs)
    rids = [f"step-cost-{next(serial)}" for _ in range(num_decodes)]
    for rid in rids:
        engine.add_request(rid, prompt(4), SamplingParams(max_tokens=8, ignore_eos=True), priority)
    engine.step()  # the prefills
    decode_ms = min(timed_step() for _ in range(2))
    for rid in rids:
        engine.abort_request(rid)
    return [(4, 1)] * len(rids), decode_ms
