"""Bytes <-> messages: msgpack (the default) or JSON, chosen by the `content-type` header.

Decoding a request fails in one of two ways, because the worker routes them differently:
- `UndecodableError`: the bytes are not a message, or name no usable `id`/`reply_to`. Nobody can
  be told, so the worker sets the bytes aside on the dead-letter topic (`reason` goes in a header).
- `InvalidRequestError`: we know who asked and where to answer, but the request is wrong. The
  worker answers with an error final carrying `code` and the user-actionable `message`.

Hostile input: the size is checked before parsing, and msgpack's container limits cap what one
message can allocate (Python objects cost tens of bytes each, so a 1 MiB message can still make
tens of MB; the limits stop the unbounded cases). Contract limits (`max_stop_strings`, ...) sit
below the msgpack caps, so a slightly-too-long list earns an error final rather than the DLQ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, TypeAdapter, ValidationError

from schemas.contract import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_PROMPT_CHARS,
    MAX_CHAT_MESSAGES,
    MAX_NONCE_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    DeadLetterReason,
)
from schemas.messages import (
    Cancel,
    ErrorCode,
    FinalReply,
    Reply,
    ReplyPartition,
    Request,
    RequestId,
    TokenReply,
    TopicName,
    WireModel,
)

MSGPACK = "application/msgpack"
JSON = "application/json"
DEFAULT_CONTENT_TYPE = MSGPACK
_ALIASES = {
    MSGPACK: MSGPACK,
    "application/x-msgpack": MSGPACK,
    "application/vnd.msgpack": MSGPACK,
    JSON: JSON,
}
_MAX_FIELDS = 256  # a v1 request has 17 fields; room for later versions, not for a memory bomb

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Limits:
    """Per-message size limits, checked while decoding. The defaults suit one worker pod."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    max_stop_strings: int = MAX_STOP_STRINGS
    max_messages: int = MAX_CHAT_MESSAGES
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS

    @property
    def max_container_len(self) -> int:
        """msgpack array cap: well above every contract list limit (see module docstring)."""
        return 4 * max(self.max_messages, self.max_stop_strings, self.max_stop_token_ids, 256)


DEFAULT_LIMITS = Limits()


UndecodableReason = DeadLetterReason  # the reasons decoding can give (contract.py has them all)


class DecodeError(ValueError):
    """Base of both decode failures, for callers that treat them alike."""


class UndecodableError(DecodeError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class InvalidRequestError(DecodeError):
    def __init__(
        self,
        request_id: str,
        reply_to: str,
        message: str,
        code: str = ErrorCode.INVALID_REQUEST,
        nonce: str | None = None,
        reply_partition: int | None = None,
    ) -> None:
        super().__init__(f"request {request_id!r}: {message}")
        self.request_id = request_id
        self.reply_to = reply_to
        self.message = message
        self.code = code
        self.nonce = nonce  # echoed in the error final, so the client accepts it
        self.reply_partition = reply_partition  # where the client reads (v1.2)


def normalize_content_type(content_type: str | bytes | None) -> str:
    """`MSGPACK` or `JSON`; parameters (`; charset=utf-8`) and case are ignored, None is msgpack."""
    if content_type is None:
        return DEFAULT_CONTENT_TYPE
    if isinstance(content_type, bytes):
        content_type = content_type.decode("utf-8", errors="replace")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if not media_type:
        return DEFAULT_CONTENT_TYPE
    try:
        return _ALIASES[media_type]
    except KeyError:
        raise UndecodableError(
            UndecodableReason.UNSUPPORTED_CONTENT_TYPE,
            f"content-type {media_type!r} is not one of {MSGPACK!r}, {JSON!r}",
        ) from None


def encode(message: BaseModel, content_type: str | None = DEFAULT_CONTENT_TYPE) -> bytes:
    """Absent (None) fields are left out; decoding restores them as None. Fields whose wire
    name is not a Python name (`response_format.json_schema.schema`) go by their alias."""
    if normalize_content_type(content_type) == JSON:
        return message.model_dump_json(exclude_none=True, by_alias=True).encode()
    if type(message) is TokenReply and message.logprobs is None:
        return msgpack.packb(_token_reply_map(message), use_bin_type=True)
    return _encode_msgpack(message)


def _encode_msgpack(message: BaseModel) -> bytes:
    return msgpack.packb(
        message.model_dump(mode="json", exclude_none=True, by_alias=True), use_bin_type=True
    )


# TokenReply's fields, in the model's order: `_token_reply_map` writes them by hand.
TOKEN_REPLY_FIELDS = ("id", "attempt", "seq", "nonce", "type", "text", "token_ids", "logprobs",
                      "index")  # fmt: skip


def _token_reply_map(message: TokenReply) -> dict[str, Any]:
    """The map pydantic's dump gives for a token message without logprobs (the same keys in the
    same order, None left out), built directly: a worker encodes one per streamed token, and
    the dump cost twice this on the event loop (tests/schemas/test_roundtrip.py holds the two
    to the same bytes)."""
    out: dict[str, Any] = {"id": message.id, "attempt": message.attempt, "seq": message.seq}
    if message.nonce is not None:
        out["nonce"] = message.nonce
    out["type"] = "token"
    out["text"] = message.text
    out["token_ids"] = message.token_ids
    if message.index is not None:
        out["index"] = message.index
    return out


def decode_value(
    value: bytes | None, content_type: str | bytes | None, limits: Limits = DEFAULT_LIMITS
) -> dict[str, Any]:
    """Bytes to a plain dict, or `UndecodableError`. Never any other exception."""
    media_type = normalize_content_type(content_type)
    if value is None:
        raise UndecodableError(UndecodableReason.MALFORMED, "the message has no value")
    if len(value) > limits.max_message_bytes:
        raise UndecodableError(
            UndecodableReason.TOO_LARGE,
            f"{len(value)} bytes is over the limit of {limits.max_message_bytes}",
        )
    try:
        obj = _parse(bytes(value), media_type, limits)
    # Any parser failure on untrusted bytes is "not a message": msgpack raises ValueError
    # subclasses, ExtraData, TypeError; json raises ValueError and RecursionError.
    except Exception as exc:
        raise UndecodableError(UndecodableReason.MALFORMED, _describe_parse_error(exc)) from None
    if not isinstance(obj, dict):
        raise UndecodableError(
            UndecodableReason.NOT_A_MAP, f"expected a map, got {type(obj).__name__}"
        )
    return obj


def _parse(value: bytes, media_type: str, limits: Limits) -> Any:
    if media_type == JSON:
        return json.loads(value)
    return msgpack.unpackb(
        value,
        raw=False,
        strict_map_key=True,
        max_str_len=limits.max_message_bytes,
        max_bin_len=limits.max_message_bytes,
        max_array_len=limits.max_container_len,
        max_map_len=_MAX_FIELDS,
        max_ext_len=0,
    )


def _describe_parse_error(exc: Exception) -> str:
    detail = str(exc)[:200]
    return f"cannot parse: {type(exc).__name__}" + (f": {detail}" if detail else "")


class _Routing(WireModel):
    """Just what is needed to answer: decoded before the rest so a bad request gets a reply."""

    id: RequestId
    reply_to: TopicName
    reply_partition: ReplyPartition | None = None  # a bad one names nobody who reads


def decode_request(
    value: bytes | None, content_type: str | bytes | None = None, limits: Limits = DEFAULT_LIMITS
) -> Request:
    obj = decode_value(value, content_type, limits)
    try:
        routing = _Routing.model_validate(obj, strict=True)
    except ValidationError as exc:
        is_id_bad = any(err["loc"][:1] == ("id",) for err in exc.errors())
        reason = UndecodableReason.NO_ID if is_id_bad else UndecodableReason.BAD_REPLY_TO
        raise UndecodableError(reason, describe_validation_error(exc)) from None
    try:
        request = Request.model_validate(obj, strict=True)
    except ValidationError as exc:
        raise InvalidRequestError(
            routing.id,
            routing.reply_to,
            describe_validation_error(exc),
            nonce=_nonce_of(obj),
            reply_partition=routing.reply_partition,
        ) from None
    check_limits(request, limits)
    return request


def check_limits(request: Request, limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise `InvalidRequestError(code=limit_exceeded)` for the first limit `request` breaks."""
    problem = None
    if request.num_prompt_chars > limits.max_prompt_chars:
        problem = f"the prompt has {request.num_prompt_chars} characters, the limit is {limits.max_prompt_chars}"
    elif len(request.stop) > limits.max_stop_strings:
        problem = f"{len(request.stop)} stop strings, the limit is {limits.max_stop_strings}"
    elif len(request.stop_token_ids) > limits.max_stop_token_ids:
        problem = f"{len(request.stop_token_ids)} stop_token_ids, the limit is {limits.max_stop_token_ids}"
    elif request.messages is not None and len(request.messages) > limits.max_messages:
        problem = f"{len(request.messages)} messages, the limit is {limits.max_messages}"
    if problem is not None:
        raise InvalidRequestError(
            request.id,
            request.reply_to,
            problem,
            ErrorCode.LIMIT_EXCEEDED,
            request.nonce,
            request.reply_partition,
        )


def _nonce_of(obj) -> str | None:
    """The nonce of a request that is otherwise invalid, if it is a valid nonce itself."""
    nonce = obj.get("nonce") if isinstance(obj, dict) else None
    return nonce if isinstance(nonce, str) and 0 < len(nonce) <= MAX_NONCE_CHARS else None


_REPLY_ADAPTER: TypeAdapter[TokenReply | FinalReply] = TypeAdapter(Reply)
_CANCEL_ADAPTER: TypeAdapter[Cancel] = TypeAdapter(Cancel)


def decode_reply(
    value: bytes | None, content_type: str | bytes | None = None, limits: Limits = DEFAULT_LIMITS
) -> TokenReply | FinalReply:
    obj = decode_value(value, content_type, limits)
    return _validate_or_undecodable(_REPLY_ADAPTER, obj)


def decode_cancel(
    value: bytes | None, content_type: str | bytes | None = None, limits: Limits = DEFAULT_LIMITS
) -> Cancel:
    obj = decode_value(value, content_type, limits)
    return _validate_or_undecodable(_CANCEL_ADAPTER, obj)


def _validate_or_undecodable(adapter: TypeAdapter[M], obj: dict[str, Any]) -> M:
    try:
        return adapter.validate_python(obj, strict=True)
    except ValidationError as exc:
        raise UndecodableError(UndecodableReason.INVALID, describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError, max_num_errors: int = 5) -> str:
    """One line a user can act on: `field: problem; ...` without echoing the (maybe huge) input."""
    parts = []
    for err in exc.errors(include_url=False, include_input=False)[:max_num_errors]:
        where = ".".join(str(p) for p in err["loc"])
        what = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {what}" if where else what)
    return "; ".join(parts)
