"""Per-request sampling parameters (vLLM/OpenAI names), validated at construction."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top-k per position, as vLLM's default limit
# Temperatures below this are greedy: dividing by them overflows the logits to inf.
MIN_TEMPERATURE = 1e-5
# OpenAI's ranges: presence/frequency penalties in [-2, 2], logit_bias values in [-100, 100].
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_REPETITION_PENALTY = 10.0  # HF takes any positive value; beyond 10 it only ever bans tokens
MAX_LOGIT_BIAS_ENTRIES = 1024
# Samples per request (OpenAI's `n`): each is a sequence of its own, so n multiplies a
# request's decode work and its private KV blocks (the prompt's full blocks are shared).
MAX_NUM_SAMPLES = 16
STRUCTURED_OUTPUT_TYPES = ("json_object", "json_schema", "regex", "choice")


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed` (sample 0: the seed itself)."""
    return (seed + index) % 2**63


def derive_seed(key: str) -> int:
    """A stable seed in [0, 2**63) from a string: the same key always gives the same seed, in
    any process (unlike Python's `hash`), so a retried request samples the same tokens."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the output to a grammar (engine/structured). `spec` depends on `type`:
    json_object: None (any JSON object); json_schema: the schema as a JSON string; regex: the
    pattern; choice: a tuple of the allowed strings. The engine compiles it when the request is
    added (an invalid spec is a ValueError there)."""

    type: str
    spec: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.type not in STRUCTURED_OUTPUT_TYPES:
            raise ValueError(
                f"structured output type must be one of {STRUCTURED_OUTPUT_TYPES}, got {self.type!r}"
            )
        if self.type == "choice":
            if isinstance(self.spec, str):  # tuple("ab") would be two one-letter choices
                raise ValueError("choice needs a list of strings, not one string")
            choices = tuple(self.spec or ())
            if not choices or any(not isinstance(c, str) or not c for c in choices):
                raise ValueError("choice needs a non-empty list of non-empty strings")
            object.__setattr__(self, "spec", choices)
        elif self.type in ("json_schema", "regex") and (
            not isinstance(self.spec, str) or not self.spec
        ):
            raise ValueError(
                f"{self.type} needs its {'schema' if self.type == 'json_schema' else 'pattern'} as a non-empty string"
            )
        texts = self.spec if self.type == "choice" else (self.spec,)
        if self.type in ("regex", "choice") and any(_has_surrogate(t) for t in texts):
            raise ValueError(
                f"{self.type} contains a UTF-16 surrogate code point (U+D800-U+DFFF), not text"
            )


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) means no top-k cut. A request without a seed is
    seeded by the engine, so every request has its own reproducible random stream, independent
    of what else shares the batch. `n` > 1 asks for n samples of one prompt: sample i draws
    from its own stream seeded with (seed + i) mod 2**63, so sample 0 of an n-sample request
    is the n=1 request's completion.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # vLLM's: top-k log-probabilities (plus the actual token) per generated / prompt token;
    # None = not computed. 0 = the actual token only.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # OpenAI's: logit -= presence_penalty * (count > 0) + frequency_penalty * count, counts over
    # the generated tokens. HF's repetition penalty: a logit of any prompt or generated token
    # is divided by it when positive, multiplied when negative. 0 / 0 / 1 = off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Keep tokens whose probability is at least min_p times the top token's (0 = off).
    min_p: float = 0.0
    # token id -> bias added to its logit (before temperature); a dict is frozen to sorted pairs.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    structured_output: StructuredOutput | None = None
    n: int = 1

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen to tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        # No upper bound here: the context length bounds a request (the wire contract has its own
        # limit, schemas.contract.MAX_TOKENS_LIMIT, checked before a request reaches an engine).
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.temperature, int | float) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**63
        ):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int)
                or not 0 <= value <= MAX_LOGPROBS
            ):  # fmt: skip
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}]")
        if (
            isinstance(self.n, bool) or not isinstance(self.n, int)
            or not 1 <= self.n <= MAX_NUM_SAMPLES
        ):  # fmt: skip
            raise ValueError(f"n must be an integer in [1, {MAX_NUM_SAMPLES}], got {self.n!r}")
        self._check_penalties()
        self._freeze_logit_bias()
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutput
        ):
            raise ValueError("structured_output must be a StructuredOutput")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(
                    f"{name} must be in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}], got {value!r}"
                )
        value = self.repetition_penalty
        if not _is_real(value) or not 0.0 < value <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {value!r}"
            )
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

    def _freeze_logit_bias(self) -> None:
        bias = self.logit_bias or ()
        items = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = tuple(sorted((t, b) for t, b in items))
        except (TypeError, ValueError):
            raise ValueError("logit_bias must map token ids to numbers") from None
        if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias has {len(pairs)} entries, at most {MAX_LOGIT_BIAS_ENTRIES}"
            )
        for token, value in pairs:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not _is_real(value) or not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_ABS_LOGIT_BIAS}, {MAX_ABS_LOGIT_BIAS}], got {value!r}"
                )
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in pairs))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """The sampler needs the request's token history (prompt + output) this step."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def has_logits_processing(self) -> bool:
        """Anything that changes the logits before temperature/top-k/top-p."""
        return self.has_penalties or bool(self.logit_bias) or self.structured_output is not None

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def _has_surrogate(text: str) -> bool:
    """A lone surrogate in a str (a JSON "\\ud800" decodes to one): not encodable as UTF-8."""
    return any("\ud800" <= c <= "\udfff" for c in text)


def _is_real(value) -> bool:
    """A finite int or float (not a bool: True is not a penalty)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
