"""Where a consumed request message goes: to the engine, to an error final, or to the DLQ.

A pure function of the message bytes and headers (no I/O, no clock), so it can be fed arbitrary
bytes in property tests. It never raises: a worker that dies on input stops every partition
behind the bad message.

- `DeadLetter`: nobody can be answered (the bytes are not a request, name no usable `reply_to`,
  or a `reply_to` outside the allowed prefix, which a worker must never write to).
- `Rejected`: we know who asked and where, but the request is invalid: an error final.
- `Accepted`: a valid request with its sampling parameters, urgency and trace context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import structlog

from engine.sampling_params import SamplingParams, StructuredOutput, derive_seed
from schemas.codec import (
    InvalidRequestError,
    Limits,
    UndecodableError,
    decode_request,
)
from schemas.contract import DeadLetterReason
from schemas.headers import Headers, Urgency, read_content_type, read_traceparent, read_urgency
from schemas.messages import ErrorCode, Request, ResponseFormat

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class DeadLetter:
    reason: str  # a `DeadLetterReason` value
    message: str


@dataclass(frozen=True)
class Rejected:
    request_id: str
    reply_to: str
    code: str  # an `ErrorCode` value
    message: str
    urgency: Urgency = Urgency.NORMAL
    traceparent: str | None = None
    nonce: str | None = None
    reply_partition: int | None = None  # v1.2: the partition of reply_to its client reads


@dataclass(frozen=True)
class Accepted:
    request: Request
    params: SamplingParams
    urgency: Urgency
    traceparent: str | None

    @property
    def request_id(self) -> str:
        return self.request.id

    @property
    def reply_to(self) -> str:
        return self.request.reply_to

    @property
    def reply_partition(self) -> int | None:
        return self.request.reply_partition


@dataclass(frozen=True)
class RoutingPolicy:
    """What the deployment allows, beyond what a message can be judged by on its own."""

    limits: Limits
    reply_topic_prefix: str
    served_models: frozenset[str]  # names a request's `model` may use for the model we serve


def route(
    value: bytes | None, headers: Headers | None, policy: RoutingPolicy
) -> DeadLetter | Rejected | Accepted:
    try:
        decision = _route(value, headers, policy)
        if isinstance(decision, Rejected):  # the error final continues the producer's trace too
            return replace(
                decision, urgency=read_urgency(headers), traceparent=read_traceparent(headers)
            )
        return decision
    except Exception as error:  # a bug in decoding must not stop the partition: park the bytes
        log.exception("routing.failed")
        return DeadLetter(DeadLetterReason.INTERNAL, f"{type(error).__name__}: {error}"[:500])


def _route(
    value: bytes | None, headers: Headers | None, policy: RoutingPolicy
) -> DeadLetter | Rejected | Accepted:
    try:
        request = decode_request(value, read_content_type(headers), policy.limits)
    except UndecodableError as error:
        return DeadLetter(error.reason, error.message)
    except InvalidRequestError as error:
        if not error.reply_to.startswith(policy.reply_topic_prefix):
            return _outside_prefix(error.reply_to, policy)
        return Rejected(
            error.request_id, error.reply_to, error.code, error.message, nonce=error.nonce,
            reply_partition=error.reply_partition,
        )  # fmt: skip
    if not request.reply_to.startswith(policy.reply_topic_prefix):
        return _outside_prefix(request.reply_to, policy)
    if request.model is not None and request.model not in policy.served_models:
        return Rejected(
            request.id, request.reply_to, ErrorCode.MODEL_NOT_SERVED,
            f"model {request.model!r} is not served here; this worker serves {sorted(policy.served_models)}",
            nonce=request.nonce, reply_partition=request.reply_partition,
        )  # fmt: skip
    try:
        params = _sampling_params(request)
    except ValueError as error:
        return Rejected(
            request.id, request.reply_to, ErrorCode.INVALID_REQUEST, str(error),
            nonce=request.nonce, reply_partition=request.reply_partition,
        )  # fmt: skip
    return Accepted(request, params, read_urgency(headers), read_traceparent(headers))


def _outside_prefix(reply_to: str, policy: RoutingPolicy) -> DeadLetter:
    return DeadLetter(
        DeadLetterReason.BAD_REPLY_TO,
        f"reply_to {reply_to!r} does not start with the allowed prefix {policy.reply_topic_prefix!r}",
    )


def _sampling_params(request: Request) -> SamplingParams:
    return SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed if request.seed is not None else derive_seed(request.id),
        stop=tuple(request.stop),
        stop_token_ids=tuple(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        logprobs=request.num_logprobs,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        min_p=request.min_p,
        logit_bias=request.logit_bias_by_id,
        structured_output=_structured_output(request.response_format),
        n=request.n,
    )


def _structured_output(response_format: ResponseFormat | None) -> StructuredOutput | None:
    """The wire's `response_format` as the engine's spec (ValueError: an invalid request). A
    schema is serialized with sorted keys, so equal schemas share one compiled grammar."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_schema":
        try:
            schema = json.dumps(response_format.json_schema.json_schema, sort_keys=True)
        except (TypeError, ValueError) as error:  # msgpack can carry what JSON cannot
            raise ValueError(f"response_format.json_schema.schema is not JSON: {error}") from None
        return StructuredOutput("json_schema", schema)
    if response_format.type == "regex":
        return StructuredOutput("regex", response_format.regex)
    if response_format.type == "choice":
        return StructuredOutput("choice", tuple(response_format.choice))
    return StructuredOutput("json_object")


def safe_for_log(text: str | None, max_chars: int = 128) -> str | None:
    """A producer-controlled string made safe for a log line: bounded, and with control
    characters (newlines, ANSI escapes) escaped so that it cannot forge log lines."""
    if text is None:
        return None
    clipped = text[:max_chars]
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in clipped)
    return escaped + ("…" if len(text) > max_chars else "")
