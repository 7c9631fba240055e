"""Mini-Infer wire contract v1 (docs/CONTRACT.md). Imports nothing of ours and nothing of Kafka.

Producers build a `Request` and `encode` it; the worker calls `decode_request`, which raises
`UndecodableError` (dead-letter it) or `InvalidRequestError` (answer with an error final).
"""

from schemas.codec import (
    DEFAULT_LIMITS,
    JSON,
    MSGPACK,
    DecodeError,
    InvalidRequestError,
    Limits,
    UndecodableError,
    UndecodableReason,
    check_limits,
    decode_cancel,
    decode_reply,
    decode_request,
    decode_value,
    encode,
    normalize_content_type,
)
from schemas.headers import Urgency
from schemas.messages import (
    FINISH_REASONS,
    SCHEMA_VERSION,
    Cancel,
    ChatMessage,
    ErrorCode,
    ErrorInfo,
    FinalReply,
    FinishReason,
    Reply,
    Request,
    Timing,
    TokenReply,
    Usage,
)

__all__ = [
    "DEFAULT_LIMITS",
    "FINISH_REASONS",
    "JSON",
    "MSGPACK",
    "SCHEMA_VERSION",
    "Cancel",
    "ChatMessage",
    "DecodeError",
    "ErrorCode",
    "ErrorInfo",
    "FinalReply",
    "FinishReason",
    "InvalidRequestError",
    "Limits",
    "Reply",
    "Request",
    "Timing",
    "TokenReply",
    "UndecodableError",
    "UndecodableReason",
    "Urgency",
    "Usage",
    "check_limits",
    "decode_cancel",
    "decode_reply",
    "decode_request",
    "decode_value",
    "encode",
    "normalize_content_type",
]
