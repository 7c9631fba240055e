"""The constants of wire contract v1, defined once for every side of the wire.

Producers (the client SDK), workers and tools import these; nothing else may restate them. A
worker deployment can override topic names and limits in its settings, but the defaults here
are what a producer and a worker agree on out of the box. See docs/CONTRACT.md.
"""

from __future__ import annotations

SCHEMA_VERSION = 1
# Additions within v1 that old readers ignore: 1 = `logprobs` (request and token replies) and
# the latency split of `timing`; 2 = the reply `nonce`, penalties, `min_p`, `logit_bias`,
# `top_logprobs`, `stop` as one string, `response_format` (structured output), `n` (choices).
SCHEMA_MINOR_VERSION = 2
# v1.2 additions of urgency lanes (request_topic_for): only topic names, no field, so readers of
# any minor version agree on them.

# --- Topics ------------------------------------------------------------------------------------
DEFAULT_REQUEST_TOPIC = "mini-infer.requests"
DEFAULT_CONTROL_TOPIC = "mini-infer.control"
DEFAULT_DLQ_TOPIC = "mini-infer.dlq"
# A worker writes only to topics under this prefix; a client's reply topic is <prefix><uuid>.
DEFAULT_REPLY_TOPIC_PREFIX = "mini-infer.replies."
# Kafka's own rule for topic names; the embedded broker does not enforce it, so we do.
TOPIC_NAME_PATTERN = r"^[a-zA-Z0-9._-]{1,249}$"
NUM_REPLY_TOPIC_PARTITIONS = 1  # one client reads it; one partition keeps its replies in order
# v1.2: the SDK's default reply topic, shared by every client and created by the workers (or by
# ops) like their other topics. A client reads one partition of it (`reply_partition`, chosen by
# a hash of its instance id) and takes its replies by key (the request id) and nonce.
SHARED_REPLY_TOPIC_SUFFIX = "shared"  # after the reply prefix
DEFAULT_SHARED_REPLY_TOPIC = DEFAULT_REPLY_TOPIC_PREFIX + SHARED_REPLY_TOPIC_SUFFIX
NUM_SHARED_REPLY_TOPIC_PARTITIONS = 16
MAX_REPLY_PARTITION = 2**31 - 1  # Kafka's partition ids are int32
# Urgency lanes (v1.2): `critical` and `high` requests go to topics of their own next to the
# request topic, so that a backlog of bulk work in Kafka never stands in front of them (a
# partition is an ordered log). `normal` and `low` share the base topic: they are the bulk, and
# a worker orders them among what it has read by the `urgency` header. Lanes in urgency order.
LANE_URGENCIES = ("critical", "high")
LANE_SEPARATOR = "."


def request_topic_for(
    urgency: str = "normal", base: str = DEFAULT_REQUEST_TOPIC, *, is_laned: bool = True
) -> str:
    """The topic a request of `urgency` goes to: `<base>.critical`, `<base>.high`, or `base`
    for `normal` and `low` (and for every urgency when `is_laned` is False)."""
    value = str(urgency).strip().lower()  # an Urgency is a StrEnum; unknown ones are `normal`
    if is_laned and value in LANE_URGENCIES:
        return f"{base}{LANE_SEPARATOR}{value}"
    return base


def request_topics(base: str = DEFAULT_REQUEST_TOPIC, *, is_laned: bool = True) -> list[str]:
    """Every topic a worker of `base` consumes, most urgent lane first, the base topic last."""
    lanes = [request_topic_for(u, base) for u in LANE_URGENCIES] if is_laned else []
    return [*lanes, base]


# CreateTopics answers this code for a topic that is already there: success for our purposes.
KAFKA_TOPIC_ALREADY_EXISTS = 36

# --- Limits (defaults; a deployment may lower or raise the configurable ones) ------------------
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
DEFAULT_MAX_PROMPT_CHARS = 32_000
MAX_TOKENS_LIMIT = 1 << 20  # the largest max_tokens a request may ask for
MAX_ID_CHARS = 256
# v1.2: a request's reply nonce (the SDK sends 22 URL-safe characters: 128 random bits).
MAX_NONCE_CHARS = 128
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63 - 1
# deadline_ms is absolute Unix epoch ms: year 9999 is far enough, and it fits every clock we use.
MAX_DEADLINE_MS = 253_402_300_799_999
MAX_MODEL_NAME_CHARS = 256
MAX_ROLE_CHARS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_STRINGS = 16
MAX_CHAT_MESSAGES = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20  # top-k alternatives per position (the engine has the same default bound)
MAX_N = 16  # v1.2: samples (choices) per request (the engine's MAX_NUM_SAMPLES)
MAX_TOKEN_ID = 2**31 - 1
# v1.2 sampling fields, OpenAI's ranges (the engine checks the same bounds).
MAX_ABS_PENALTY = 2.0  # presence_penalty, frequency_penalty
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


class DeadLetterReason:
    """Values of the DLQ `x-error-reason` header: why a message was set aside."""

    # The bytes are not a request, or name nobody who could be answered.
    TOO_LARGE = "too_large"
    UNSUPPORTED_CONTENT_TYPE = "unsupported_content_type"
    MALFORMED = "malformed"
    NOT_A_MAP = "not_a_map"
    NO_ID = "no_id"
    BAD_REPLY_TO = "bad_reply_to"
    INVALID = "invalid"  # a reply or control message that does not validate
    # Decodable, but the worker could not answer it.
    REPLY_TOPIC_UNAVAILABLE = "reply_topic_unavailable"  # the reply topic could not be created
    FINAL_UNDELIVERABLE = "final_undeliverable"  # the reply topic refused the final every try
    INTERNAL = "internal"  # a bug while handling it; the bytes are kept for a replay
