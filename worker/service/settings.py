"""Worker settings: typed, grouped, read from `MINI_INFER_*` variables (nested with `__`) and
CLI flags, and validated as a whole at start-up.

There is no module-level instance: the composition root (`worker.service.worker`) builds one
`WorkerSettings` and hands the pieces down, so tests can run several workers side by side.
Invalid combinations (SASL without credentials, idempotence forced on against the embedded
broker, a reply prefix that covers the request topic, ...) raise here, before anything connects.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.config import EngineConfig
from schemas.contract import (
    DEFAULT_CONTROL_TOPIC,
    DEFAULT_DLQ_TOPIC,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_PROMPT_CHARS,
    DEFAULT_REPLY_TOPIC_PREFIX,
    DEFAULT_REQUEST_TOPIC,
    NUM_SHARED_REPLY_TOPIC_PARTITIONS,
    SHARED_REPLY_TOPIC_SUFFIX,
    TOPIC_NAME_PATTERN,
    request_topics,
)
from schemas.headers import Urgency
from worker.client.security import aiokafka_security_options, check_security
from worker.offset_gaps import DEFAULT_MAX_REFETCHES


def _not_dot_or_dotdot(name: str) -> str:
    if name in (".", ".."):
        raise ValueError("a topic cannot be named '.' or '..'")
    return name


TopicName = Annotated[str, Field(pattern=TOPIC_NAME_PATTERN), AfterValidator(_not_dot_or_dotdot)]
# Kafka's own topics: a reply prefix must never let a producer name one of them.
KAFKA_INTERNAL_TOPICS = ("__consumer_offsets", "__transaction_state", "__cluster_metadata")
PositiveMs = Annotated[int, Field(ge=1)]
# While critical or high work is in the engine, a step stays under this (engine/step_cost.py).
DEFAULT_STEP_TIME_TARGET_MS = 100.0
# With nothing urgent in the engine, a step stays under this: the wait of a critical request
# that arrives while a bulk step runs (engine/config.py, max_step_time_ms).
DEFAULT_MAX_STEP_TIME_MS = 500.0
_STEP_DEFAULTS = {
    "step_time_target_ms": DEFAULT_STEP_TIME_TARGET_MS,
    "max_step_time_ms": DEFAULT_MAX_STEP_TIME_MS,
}


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplyTopicSettings(_Group):
    """How a worker may create reply topics, which producers name (see `TopicAdmin`)."""

    create: bool = Field(default=True, description="False: pre-provisioned reply topics only")
    max_created: int = Field(default=10_000, ge=0, description="reply topics one worker creates")
    max_creations_per_s: float = Field(default=20.0, gt=0)
    max_creation_burst: int = Field(default=100, ge=1)
    num_retries: int = Field(default=3, ge=0, description="of a transient CreateTopics failure")
    retry_backoff_s: float = Field(default=0.5, gt=0, description="doubled after each try")


class KafkaSettings(_Group):
    bootstrap_servers: str | None = Field(
        default=None,
        description="host:port[,host:port]; required unless embedded_broker is set",
    )
    # A development convenience (`make run`, `demo`, tests): a worker with no broker configured
    # must fail at start, not serve an in-memory broker that no producer can reach.
    embedded_broker: bool = Field(
        default=False, description="start an in-memory broker (development only)"
    )
    embedded_port: int | None = Field(
        default=None, ge=1, le=65535, description="embedded broker port"
    )
    request_topic: TopicName = DEFAULT_REQUEST_TOPIC
    # Urgency lanes (contract v1.2): also consume <request_topic>.critical and .high, read and
    # admitted before the base topic, paused last. False: the base topic only (producers that
    # send by lane then need lanes off too, or their critical requests go unread).
    urgency_lanes: bool = True
    control_topic: TopicName = DEFAULT_CONTROL_TOPIC
    dlq_topic: TopicName = DEFAULT_DLQ_TOPIC
    num_partitions: int = Field(default=4, ge=1, description="for topics the worker creates")
    replication_factor: int = Field(default=1, ge=1)
    group_id: str = Field(default="mini-infer-workers", min_length=1)
    # Static membership (KIP-345): a pod restarted under the same instance id within the
    # session timeout gets its partitions back without a rebalance of the whole group. Set it
    # to something stable per pod (a StatefulSet's pod name); None: dynamic membership.
    group_instance_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]{1,249}$")
    reply_topic_prefix: str = Field(
        default=DEFAULT_REPLY_TOPIC_PREFIX, pattern=r"^[a-zA-Z0-9._-]{1,200}$"
    )
    client_id: str = "mini-infer-worker"
    reply_topics: ReplyTopicSettings = Field(default_factory=ReplyTopicSettings)
    # v1.2: the SDK's default reply topic, created with the worker's own topics so that no
    # client creates one. Under reply_topic_prefix; None: `<reply_topic_prefix>shared`.
    shared_reply_topic: TopicName | None = Field(
        default=None, description="default: <reply_topic_prefix>shared"
    )
    num_shared_reply_partitions: int = Field(
        default=NUM_SHARED_REPLY_TOPIC_PARTITIONS,
        ge=0,
        description="of the shared reply topic; 0: not created (ops provision it)",
    )
    # None: on for an external Kafka, off for the embedded broker (whose InitProducerId answer
    # stock aiokafka cannot read, see docs/KAFKA.md).
    enable_idempotence: bool | None = None
    session_timeout_ms: PositiveMs = 10_000
    heartbeat_interval_ms: PositiveMs = 3_000
    max_poll_interval_ms: PositiveMs = 300_000
    # Kafka clients need this well above 5 s; below it a consumer never joined the embedded broker.
    request_timeout_ms: PositiveMs = 40_000
    # How long a fetch may wait for data. Apache Kafka answers as soon as data arrives, but the
    # embedded broker holds every fetch for the whole wait (measured: 500 ms put ~250 ms on each
    # hop), so this bounds the added latency there; an idle worker pays one fetch per wait.
    fetch_max_wait_ms: PositiveMs = 20
    # The fetch wait while the worker has requests in flight (never below fetch_max_wait_ms);
    # the poll loop waits as long, unless a partition is paused (then fetch_max_wait_ms).
    # Fewer empty fetches beside a busy engine: W2 through the embedded broker went from 0.71x
    # to 0.83x the direct engine (medians of 6 pairs; 250 ms did no better than 100), the
    # loop's and broker's CPU down by a third. Costs a request that arrives while the worker works up to this
    # long on the embedded broker, nothing on Apache Kafka (which answers when data arrive).
    fetch_max_wait_busy_ms: PositiveMs = 100
    # Refetches of an offset gap before it is believed (worker/offset_gaps.py): the embedded
    # broker can hide a batch from a fetch that races a concurrent write, which the worker
    # would otherwise commit over. On Apache Kafka a real gap (a transaction marker, compaction)
    # costs this many refetches and is then accepted; 0 turns the check off (a request topic
    # written by transactional producers, on Kafka only).
    max_gap_refetches: int = Field(default=DEFAULT_MAX_REFETCHES, ge=0)
    consumer_stop_timeout_s: float = Field(default=10.0, gt=0)
    # TLS and/or SASL to the brokers (docs/OPERATIONS.md); the mechanism below for SASL_*.
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = None
    sasl_username: str | None = None  # PLAIN and SCRAM-*
    sasl_password: SecretStr | None = None  # PLAIN and SCRAM-*; from a Secret, never a ConfigMap
    # OAUTHBEARER: the token is read from this file at each connection (a projected
    # service-account token or a file a sidecar refreshes), so it rotates without a restart.
    sasl_oauth_token_file: Path | None = None
    ssl_cafile: Path | None = None  # the brokers' CA (PEM); None: the system's CAs
    ssl_certfile: Path | None = None  # a client certificate (mutual TLS)
    ssl_keyfile: Path | None = None  # its private key
    ssl_password: SecretStr | None = None  # of the private key, if encrypted

    @property
    def shared_reply_topic_name(self) -> str:
        return self.shared_reply_topic or f"{self.reply_topic_prefix}{SHARED_REPLY_TOPIC_SUFFIX}"

    @property
    def is_embedded(self) -> bool:
        return self.bootstrap_servers is None

    @property
    def request_topics(self) -> list[str]:
        """The request topic's lanes, most urgent first, the base topic last."""
        return request_topics(self.request_topic, is_laned=self.urgency_lanes)

    @model_validator(mode="after")
    def _check(self) -> KafkaSettings:
        topics = [*self.request_topics, self.control_topic, self.dlq_topic]
        if len(set(topics)) != len(topics):
            raise ValueError(
                "request, control and DLQ topics must be three different topics, none of them "
                "an urgency lane of the request topic"
            )
        if any(len(t) > 249 for t in topics):
            raise ValueError("a request topic's urgency lane name is over 249 characters")
        covered = [
            t for t in (*topics, *KAFKA_INTERNAL_TOPICS) if t.startswith(self.reply_topic_prefix)
        ]
        if self.reply_topic_prefix.startswith("_") or self.reply_topic_prefix in (".", ".."):
            covered.append(self.reply_topic_prefix)
        if covered:
            raise ValueError(
                f"reply_topic_prefix {self.reply_topic_prefix!r} covers {covered}: a request could "
                "then name a worker topic as its reply_to"
            )
        if not self.shared_reply_topic_name.startswith(self.reply_topic_prefix):
            raise ValueError(
                f"shared_reply_topic {self.shared_reply_topic!r} is not under reply_topic_prefix "
                f"{self.reply_topic_prefix!r}: no worker would write to it"
            )
        check_security(
            self.security_protocol, self.sasl_mechanism, self.sasl_username,
            self.sasl_password.get_secret_value() if self.sasl_password else None,
            self.sasl_oauth_token_file,
            has_ssl_files=any(
                p is not None for p in (self.ssl_cafile, self.ssl_certfile, self.ssl_keyfile)
            ),
        )  # fmt: skip
        if self.is_embedded and self.security_protocol != "PLAINTEXT":
            raise ValueError(
                "the embedded broker speaks PLAINTEXT only; set bootstrap_servers for SASL/TLS"
            )
        if self.is_embedded and self.enable_idempotence:
            raise ValueError(
                "enable_idempotence=True does not work against the embedded broker (stock aiokafka "
                "cannot initialise a producer id there); leave it unset or set bootstrap_servers"
            )
        if not self.is_embedded and self.embedded_broker:
            raise ValueError("embedded_broker is set but so is bootstrap_servers: choose one")
        if not self.is_embedded and self.embedded_port is not None:
            raise ValueError(
                "embedded_port is set but bootstrap_servers points at an external broker"
            )
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ValueError("heartbeat_interval_ms must be at most a third of session_timeout_ms")
        if self.max_poll_interval_ms < self.session_timeout_ms:
            raise ValueError(
                "max_poll_interval_ms must be at least session_timeout_ms: a shorter one throws the "
                "worker out of its group between two polls"
            )
        if self.request_timeout_ms <= self.session_timeout_ms:
            raise ValueError("request_timeout_ms must be greater than session_timeout_ms")
        return self

    @property
    def use_idempotence(self) -> bool:
        return (
            (not self.is_embedded) if self.enable_idempotence is None else self.enable_idempotence
        )

    def client_options(self) -> dict:
        """Connection and security options shared by every aiokafka client the worker makes."""
        secret = lambda value: value.get_secret_value() if value is not None else None  # noqa: E731
        return aiokafka_security_options(
            self.security_protocol, self.sasl_mechanism, self.sasl_username,
            secret(self.sasl_password), self.sasl_oauth_token_file,
            self.ssl_cafile, self.ssl_certfile, self.ssl_keyfile, secret(self.ssl_password),
        )  # fmt: skip


class BatcherSettings(_Group):
    """How long a request may wait for company before it is released, by urgency. Critical
    requests never wait; the windows are short enough to be invisible next to a forward pass."""

    critical_window_ms: float = Field(default=0.0, ge=0)
    high_window_ms: float = Field(default=2.0, ge=0)
    normal_window_ms: float = Field(default=10.0, ge=0)
    low_window_ms: float = Field(default=50.0, ge=0)
    max_batch_tokens: int = Field(
        default=2048, ge=1, description="prompt tokens released per flush"
    )

    def window_ms(self, urgency: Urgency) -> float:
        return getattr(self, f"{urgency.value}_window_ms")


class LimitSettings(_Group):
    """Size limits and the consumption bound.

    The worker reads ahead of what its engine can run (up to `max_num_inflight` requests and
    `max_inflight_bytes` of estimated memory: record bytes plus tokenized prompts) and lets the
    batcher admit by urgency, so a `critical` request behind a backlog of `low` ones is read and
    reaches the engine within about one step. Only past either bound are partitions paused,
    the base topic's first and the urgency lanes' last (`num_urgent_reserve`); on the base topic,
    as on any Kafka log, a request then waits behind those before it in its partition.
    """

    max_message_bytes: int = Field(
        default=DEFAULT_MAX_MESSAGE_BYTES, ge=1024, description="request and reply size cap"
    )
    max_prompt_chars: int = Field(default=DEFAULT_MAX_PROMPT_CHARS, ge=1)
    max_num_inflight: int = Field(default=1024, ge=1, description="consumed, not yet answered")
    max_inflight_bytes: int = Field(
        default=256 << 20, ge=1 << 16, description="their estimated memory, before pausing"
    )
    # Urgency lanes pause last: the critical lane reads this many requests past both bounds
    # (the bytes one by as many of the largest request), the high lane half as many, the base
    # topic none. So a full worker still reads a critical request at once.
    num_urgent_reserve: int = Field(default=64, ge=0, description="past the bounds, for lanes")
    # Engine steps that may fail in a row before the worker gives up (exits non-zero, answering
    # nothing more). Isolating one bad request among k costs about log2(k) + 1 of them.
    max_consecutive_step_failures: int = Field(default=8, ge=1)


class PublisherSettings(_Group):
    # 1: one message per engine text delta. N: the first message with the first text (the first
    # token is never held back), then a message every N tokens. Either way boundaries depend
    # only on the tokens, so two attempts that agree publish identical messages.
    tokens_per_message: int = Field(default=1, ge=1)
    # 0: a step's deltas reach the publisher in one event-loop callback, so they share produce
    # batches anyway; lingering only delayed every token (W2 through Kafka: 24 -> 18 ms p50
    # from the worker's first token to the client's, no throughput change).
    linger_ms: int = Field(default=0, ge=0)
    compression_type: Literal["gzip", "snappy", "lz4", "zstd"] | None = None
    num_final_retries: int = Field(default=3, ge=0)
    # From publish to the broker's ack; past it a message is undeliverable (a final is
    # dead-lettered as final_undeliverable, its offset committed). An idempotent producer
    # retries a topic that refuses writes forever; this is what bounds it.
    delivery_timeout_s: float = Field(default=30.0, gt=0)
    # Unsent messages one reply topic may hold in the worker (a stuck topic's tokens pile up).
    max_num_lane_messages: int = Field(default=10_000, ge=1)
    # Producers of their own for per-client reply topics (spread over them by name), apart
    # from the one for the shared reply topic and the DLQ: aiokafka sends one request at a
    # time per broker and producer, and backs off while a refused batch waits for its retry,
    # so a refused per-client topic slowed every other topic of its producer (others' token
    # gap p99 3x). 0: one producer for everything.
    num_private_producers: int = Field(default=2, ge=0)


class ObservabilitySettings(_Group):
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"  # auto: console in a TTY, else JSON
    trace_exporter: Literal["none", "console", "otlp"] = "none"
    metric_exporter: Literal["none", "console", "otlp"] = "none"
    metric_export_interval_s: float = Field(default=60.0, gt=0)
    # OTLP/HTTP collector base URL (http://collector:4318); None: the exporter's OTEL_* env.
    otlp_endpoint: str | None = None
    prometheus: bool = Field(default=True, description="serve GET /metrics on the health port")
    health_port: int | None = Field(
        default=None, ge=0, le=65535, description="HTTP /healthz, /readyz, /metrics; 0 = any"
    )
    ready_file: Path | None = Field(
        default=None,
        description="written when ready (JSON: worker id, model, group, the bound health port), "
        "removed at exit",
    )
    # Liveness fails when the engine has had work but finished no step for this long (a stuck
    # kernel or a deadlock), or when the event loop does not answer (the probe times out).
    engine_stall_s: float = Field(default=120.0, gt=0)
    # Readiness fails when no poll of the request topic succeeded for this long.
    broker_stale_s: float = Field(default=30.0, gt=0)
    kafka_sample_interval_s: float = Field(default=5.0, gt=0, description="lag/paused gauges")


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MINI_INFER_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    model: str = Field(
        default="smollm2-135m", min_length=1, description="alias, HF dir, hub id org/name or .gguf"
    )
    revision: str | None = Field(
        default=None, min_length=1, description="of a hub id: branch, tag or commit (None: main)"
    )
    # The name requests' `model` field and the health/metrics labels use; None: `model`.
    served_model_name: str | None = Field(default=None, min_length=1, max_length=256)
    # "auto" (both): a GGUF runs in its own quantization, computing in bf16 where it runs fast
    # here (natively, or on the engine's C++ kernels for AVX2 / AVX-512); see
    # engine/precision.py. float32 and "none" give the HF-exact path.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: str | None = "auto"
    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(**_STEP_DEFAULTS))
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    batcher: BatcherSettings = Field(default_factory=BatcherSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    publisher: PublisherSettings = Field(default_factory=PublisherSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)
    # The event loop's thread runs at this nice value once the engine has started (Linux; the
    # engine's threads keep the process's). On a machine whose cores the engine's threads fill,
    # each time the loop preempted one of them, the other waited at the step's next barrier:
    # W2 through Kafka on 2 cores ran at 0.54x the direct engine with 0, 0.79x with 10 and 0.85x
    # with 19 (loadtest/JOURNAL.md). 0 leaves it as it is.
    event_loop_nice: int = Field(
        default=19, ge=0, le=19, description="the loop thread's nice value"
    )
    # And its Linux scheduling policy from then on: "idle" (SCHED_IDLE) runs it on a core the
    # engine's threads leave (between steps, a barrier's sleep), and an engine thread that
    # wakes takes the core back at once; at nice 19 alone, the loop could keep the core for
    # its time slice while the engine's other thread waited at the next barrier. One stream
    # through Kafka on 2 cores: inter-token latency 1.16x the direct engine's with "idle",
    # 1.35x with "normal" (medians of 11 alternating rounds, loadtest/JOURNAL.md). Threads the
    # loop starts later inherit it. Neither is applied where the worker may use one CPU only
    # (affinity or cgroup quota, engine/cpus.py): there the engine's thread leaves the
    # loop no room, and a lowered loop streamed each request's tokens in one burst at its end.
    event_loop_policy: Literal["idle", "normal"] = Field(
        default="idle", description="the loop thread's scheduling policy (Linux)"
    )
    shutdown_grace_s: float = Field(default=30.0, ge=0, description="to finish in-flight work")
    # The whole stop (drain, commit, flush, leave the group, close) ends within this; keep it
    # below the pod's terminationGracePeriodSeconds (45 s in deploy/k8s) minus a margin. The
    # drain gets what the other steps leave of it.
    stop_budget_s: float = Field(default=40.0, gt=0, description="bound on the whole shutdown")
    worker_id: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9._-]{1,64}$", description="None: generated"
    )

    @field_validator("engine", mode="before")
    @classmethod
    def _size_steps_by_urgency(cls, value):
        """The worker sizes steps by urgency, and bounds the others, unless told otherwise (the
        engine's default is off: there, priority 0 is every request's)."""
        if isinstance(value, dict):
            return {**_STEP_DEFAULTS, **value}
        return value

    @property
    def model_name(self) -> str:
        """What this worker calls its model in replies' routing, health and metrics."""
        return self.served_model_name or self.model

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        engine = self.engine
        is_unchunked = not engine.enable_chunked_prefill
        max_len = engine.max_model_len
        if is_unchunked and max_len is not None and engine.max_num_batched_tokens < max_len:
            raise ValueError(
                "engine.enable_chunked_prefill=False needs max_num_batched_tokens >= max_model_len "
                f"({engine.max_num_batched_tokens} < {max_len}): a longer prompt would never be "
                "scheduled"
            )
        return self


def _bool_flag(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return lowered in ("true", "1", "yes", "on")


# --- the same settings as `mini-infer serve` flags ------------------------------------------

_BYTE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
               "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}  # fmt: skip


def parse_byte_size(text: str) -> int:
    """'536870912', '512MiB', '2GiB', '1.5G' (SI) -> bytes. ArgumentTypeError otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size like 512MiB or 2GiB: {text!r}")
    number, unit = match.groups()
    size = int(float(number) * _BYTE_UNITS[(unit or "").lower()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"a size must be at least one byte: {text!r}")
    return size


# flag -> (settings path, type, help). Unset flags leave env/defaults alone.
CLI_FLAGS: dict[str, tuple[str, type, str]] = {
    "--bootstrap-servers": (
        "kafka.bootstrap_servers",
        str,
        "Kafka host:port list (required unless --embedded-broker)",
    ),
    "--embedded-broker": (
        "kafka.embedded_broker",
        bool,
        "start an in-memory broker for development (never in production)",
    ),
    "--port": ("kafka.embedded_port", int, "port of the embedded broker (default: a free one)"),
    "--model": (
        "model",
        str,
        "smollm2-135m, a Hugging Face checkpoint dir, a hub id org/name or a .gguf file",
    ),
    "--revision": ("revision", str, "branch, tag or commit of a hub id (default: main)"),
    "--served-model-name": (
        "served_model_name",
        str,
        "the name requests use for the model (default: --model)",
    ),
    "--dtype": ("dtype", str, "auto | float32 | bfloat16 | float16"),
    "--attention-backend": ("engine.attention_backend", str, "auto | cpu | torch | triton"),
    "--quantization": (
        "quantization",
        str,
        "auto (a GGUF's own) | none | int8 | int4 (group 32) | int4-g64 | int4-g128 | w8a8",
    ),
    "--kv-cache-dtype": ("engine.kv_cache_dtype", str, "auto | int8"),
    "--linear-kernel": ("engine.linear_kernel", str, "auto | plain | packed | gemv"),
    "--compile": ("engine.compile", str, "torch.compile the forward: auto | on | off"),
    "--device": ("engine.device", str, "auto | cpu | cuda (Triton kernels, CUDA graphs)"),
    "--max-model-len": ("engine.max_model_len", int, "longest prompt + output, in tokens"),
    "--max-num-seqs": ("engine.max_num_seqs", int, "sequences the engine runs at once"),
    "--kv-cache-memory": (
        "engine.kv_cache_memory_bytes",
        parse_byte_size,
        "KV-cache pool size: bytes, or with a unit (512MiB, 2GiB, 1.5G)",
    ),
    "--group-id": ("kafka.group_id", str, "consumer group of the worker pool"),
    "--group-instance-id": (
        "kafka.group_instance_id",
        str,
        "static group membership: a stable id per pod (restarts skip the rebalance)",
    ),
    "--request-topic": ("kafka.request_topic", str, "topic to consume requests from"),
    "--urgency-lanes": (
        "kafka.urgency_lanes",
        _bool_flag,
        "true | false: also consume <request-topic>.critical and .high (default true)",
    ),
    "--partitions": ("kafka.num_partitions", int, "partitions of the topics the worker creates"),
    "--max-inflight": (
        "limits.max_num_inflight",
        int,
        "consumed but unanswered requests before pausing",
    ),
    "--tokens-per-message": (
        "publisher.tokens_per_message",
        int,
        "tokens per streamed reply message",
    ),
    "--grace-s": ("shutdown_grace_s", float, "seconds to finish in-flight work on SIGTERM"),
    "--health-port": ("observability.health_port", int, "serve GET /healthz on this port"),
    "--ready-file": ("observability.ready_file", str, "touch this file when ready"),
    "--log-level": ("observability.log_level", str, "debug | info | warning | error"),
    "--log-format": ("observability.log_format", str, "auto | json | console"),
    "--worker-id": ("worker_id", str, "names this worker's attempts (default: host-pid-random)"),
}


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, (_, type_, help_text) in CLI_FLAGS.items():
        if type_ is bool:  # a switch: present sets True, absent leaves env/defaults alone
            parser.add_argument(
                flag, action="store_const", const=True, default=None, help=help_text
            )
        else:
            parser.add_argument(flag, type=type_, default=None, help=help_text)


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    """Env and defaults, overridden by the flags that were given. Raises ValidationError."""
    overrides: dict = {}
    for flag, (path, _, _) in CLI_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is None:
            continue
        *groups, leaf = path.split(".")
        target = overrides
        for group in groups:
            target = target.setdefault(group, {})
        target[leaf] = value
    return WorkerSettings(**overrides)
