"""The producer-side SDK: send requests, stream their replies back.

    async with MiniInferClient("127.0.0.1:9092") as client:
        async for delta in client.stream(prompt="Hi", max_tokens=32):
            print(delta.text, end="")

By default every client shares one pre-provisioned reply topic (`mini-infer.replies.shared`,
created by the workers; contract v1.2), so opening a client creates no topic. A client reads one
partition of it, chosen by a hash of its instance id (or `ClientOptions.reply_partition`),
assigned to a plain consumer (no group: a join costs seconds) whose position is fixed at the end
of the partition before anything is sent, so no reply of its own is missed and no one else's
history is read. Each request names that partition (`reply_partition`); records of other
clients' requests are skipped by key (the request id) before decoding, and the nonce (v1.2)
keeps anyone else's reply out. `ClientOptions.private_reply_topic` gives the client its own
topic instead, `<reply_prefix><uuid>` with one partition, read from `earliest` and deleted on
close. One background task reads and routes replies by request id to per-request queues, so many
streams share one client. Which replies to show is decided by the pure `ReplyAssembler` (the
client rule of docs/CONTRACT.md).

Depends on `schemas` and aiokafka only, never on `engine`.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from schemas.codec import DEFAULT_LIMITS, MSGPACK, Limits, check_limits, encode
from schemas.contract import (
    DEFAULT_CONTROL_TOPIC,
    DEFAULT_REPLY_TOPIC_PREFIX,
    DEFAULT_REQUEST_TOPIC,
    DEFAULT_SHARED_REPLY_TOPIC,
    NUM_REPLY_TOPIC_PARTITIONS,
    TOPIC_NAME_PATTERN,
    request_topic_for,
)
from schemas.headers import CONTENT_TYPE, Urgency, request_headers
from schemas.messages import (
    Cancel,
    ChatMessage,
    FinalReply,
    Request,
    Timing,
    TokenLogprob,
    Usage,
)
from worker.client.assembler import Delta, ReplyAssembler
from worker.client.router import Item, ReplyRouter
from worker.topics import create_topics, delete_topic, num_partitions_of

log = structlog.get_logger(__name__)

STOP_TIMEOUT_S = 5.0  # aiokafka's stop() can hang (docs/KAFKA.md); never wait longer
CANCEL_TIMEOUT_S = 5.0
# Apache Kafka answers a fetch as soon as data arrives, but the embedded broker holds it for the
# whole fetch_max_wait_ms (measured: 500 ms, aiokafka's default, put ~250 ms on every reply).
# A short wait costs an idle client ~50 empty fetches/s: on the embedded broker each costs the
# client ~0.6 ms of CPU and the broker ~0.7 ms (`python -m loadtest.bench_fetch_hold`), together
# ~7% of a core beside whatever else runs there.
DEFAULT_REPLY_FETCH_MAX_WAIT_MS = 20
_PROPAGATOR = TraceContextTextMapPropagator()
# Request fields a caller may pass as keyword arguments; the client fills in the rest.
# (`nonce` and `reply_partition` are the client's own: v1.2 reply integrity and routing.)
SAMPLING_FIELDS = frozenset(Request.model_fields) - {
    "id", "reply_to", "prompt", "messages", "nonce", "reply_partition",
}  # fmt: skip


class ClientError(RuntimeError):
    pass


class RequestFailedError(ClientError):
    """The worker answered with `finish_reason: error`."""

    def __init__(self, code: str, message: str, final: FinalReply | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.final = final


class RequestTimeoutError(ClientError, TimeoutError):
    pass


@dataclass(frozen=True)
class GenerateResult:
    text: str
    finish_reason: str
    usage: Usage
    timing: Timing
    attempt: str
    # When the request asked for logprobs: one entry per generated token (of the winning
    # attempt), with its top alternatives; None otherwise, or when some token's were not seen
    # (the final filled in text that no token reply carried).
    logprobs: list[TokenLogprob] | None = None
    token_ids: list[int] | None = None
    # Every choice by index (one for n=1, repeating the fields above; n for a request that
    # asked for n > 1, where the fields above are choice 0's).
    choices: list[ChoiceResult] = field(default_factory=list)


@dataclass(frozen=True)
class ChoiceResult:
    """One sample of a request (contract v1.2 `n`); token ids and logprobs as in GenerateResult."""

    index: int
    text: str
    finish_reason: str
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class ClientOptions:
    """How a client reaches the workers. The defaults are the contract's (schemas.contract)."""

    request_topic: str = DEFAULT_REQUEST_TOPIC
    # Send `critical` and `high` requests to their urgency lane (contract v1.2,
    # `request_topic_for`); False: every request to `request_topic` (workers without lanes).
    urgency_lanes: bool = True
    reply_prefix: str = DEFAULT_REPLY_TOPIC_PREFIX
    # v1.2: the shared reply topic this client reads one partition of; None of these creates it.
    reply_topic: str = DEFAULT_SHARED_REPLY_TOPIC
    reply_partition: int | None = None  # None: a hash of the client's instance id
    # Opt-in: a topic of this client's own (`<reply_prefix><uuid>`), created at start and
    # deleted at close. Costs the cluster a topic per client; for workers older than v1.2.
    private_reply_topic: bool = False
    control_topic: str = DEFAULT_CONTROL_TOPIC
    client_id: str | None = None
    enable_idempotence: bool = False  # the embedded broker cannot do it (docs/KAFKA.md)
    reply_replication_factor: int = 1
    reply_fetch_max_wait_ms: int = DEFAULT_REPLY_FETCH_MAX_WAIT_MS
    # Checked before sending; keep them equal to the workers' (MINI_INFER_LIMITS__*).
    limits: Limits = DEFAULT_LIMITS
    # Passed to every aiokafka client as they are: security_protocol, sasl_mechanism,
    # sasl_plain_username, ssl_context, request_timeout_ms, ...
    kafka: Mapping[str, Any] = field(default_factory=dict)
    # The OpenTelemetry tracer of the producer's `send` spans; None: the global tracer provider
    # (a no-op unless the application configured one). Only the API package is needed.
    tracer: trace.Tracer | None = None


class MiniInferClient:
    def __init__(self, bootstrap_servers: str, options: ClientOptions | None = None) -> None:
        options = options or ClientOptions()
        instance_id = uuid.uuid4().hex
        self.bootstrap_servers = bootstrap_servers
        self.options = options
        self.request_topic = options.request_topic
        self.control_topic = options.control_topic
        self.instance_id = instance_id
        private_topic = f"{options.reply_prefix}{instance_id}"
        for option, name in (("reply_prefix", private_topic), ("reply_topic", options.reply_topic)):
            if not re.fullmatch(TOPIC_NAME_PATTERN, name):
                raise ValueError(
                    f"{option} {getattr(options, option)!r} does not make a valid topic name"
                )
        self.reply_topic = private_topic if options.private_reply_topic else options.reply_topic
        # The partition this client reads; set by `start` (None: a private topic, partition 0).
        self.reply_partition: int | None = None
        self._is_topic_created = False
        self.client_id = options.client_id or f"mini-infer-client-{instance_id[:8]}"
        self._kafka_options = {
            "bootstrap_servers": bootstrap_servers,
            "client_id": self.client_id,
            **options.kafka,
        }
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: asyncio.Task | None = None
        self._router = ReplyRouter()
        self._background: set[asyncio.Task] = set()

    async def __aenter__(self) -> MiniInferClient:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        try:
            await self._prepare_reply_topic()
            self._producer = AIOKafkaProducer(
                **self._kafka_options,
                acks="all",
                enable_idempotence=self.options.enable_idempotence,
            )
            await self._producer.start()
            self._consumer = AIOKafkaConsumer(
                **self._kafka_options,
                group_id=None,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                fetch_max_wait_ms=self.options.reply_fetch_max_wait_ms,
            )
            await self._consumer.start()
            await self._assign_reply_partition(self._consumer)
        except BaseException:
            await self.close()
            raise
        self._reader = asyncio.create_task(
            self._router.run(self._consumer, ClientError), name="mini-infer-reply-reader"
        )
        log.info("client.started", reply_topic=self.reply_topic, client_id=self.client_id)

    async def _prepare_reply_topic(self) -> None:
        """Private: create the client's topic. Shared: check that it exists (never creating it)
        and pick this client's partition."""
        admin = AIOKafkaAdminClient(**self._kafka_options)
        await admin.start()
        try:
            if self.options.private_reply_topic:
                await create_topics(
                    admin,
                    {self.reply_topic: NUM_REPLY_TOPIC_PARTITIONS},
                    self.options.reply_replication_factor,
                )
                self._is_topic_created = True
                return
            num_partitions = await num_partitions_of(admin, self.reply_topic)
        finally:
            await admin.close()
        if num_partitions is None:
            raise ClientError(
                f"the shared reply topic {self.reply_topic!r} does not exist: workers create it "
                "at start (MINI_INFER_KAFKA__SHARED_REPLY_TOPIC), or ops provision it"
            )
        self.reply_partition = self.options.reply_partition
        if self.reply_partition is None:
            self.reply_partition = partition_of(self.instance_id, num_partitions)
        if not 0 <= self.reply_partition < num_partitions:
            raise ClientError(
                f"reply_partition {self.reply_partition} is not one of the "
                f"{num_partitions} partitions of {self.reply_topic!r}"
            )

    async def _assign_reply_partition(self, consumer: AIOKafkaConsumer) -> None:
        """A shared partition is read from its end, fixed here, before any request is sent: a
        reply to this client comes later, and the others' history is not ours to read."""
        partition = TopicPartition(self.reply_topic, self.reply_partition or 0)
        consumer.assign([partition])
        if not self.options.private_reply_topic:
            await consumer.seek_to_end(partition)
            await consumer.position(partition)  # resolves the offset now, not at the first fetch
        else:  # its own topic, from the start: the first reply's offset is checked too
            self._router.gaps.expect(partition, await consumer.position(partition))

    async def close(self) -> None:
        """Finish best-effort cancels, stop reading, stop producing; then delete a private reply
        topic (once its consumer is gone: deleting a topic that is being read breaks consumers
        on the embedded broker). The shared topic is never touched."""
        if self._background:
            await asyncio.wait(self._background, timeout=CANCEL_TIMEOUT_S)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        self._router.fail_all(ClientError("the client was closed"))
        for name, part in (("consumer", self._consumer), ("producer", self._producer)):
            if part is None:
                continue
            try:
                await asyncio.wait_for(part.stop(), STOP_TIMEOUT_S)
            except (TimeoutError, KafkaError) as exc:
                log.warning("client.stop_failed", part=name, error=repr(exc))
        self._consumer = self._producer = None
        if self._is_topic_created:
            self._is_topic_created = False
            await self._delete_reply_topic()

    async def _delete_reply_topic(self) -> None:
        admin = AIOKafkaAdminClient(**self._kafka_options)
        try:
            await asyncio.wait_for(admin.start(), STOP_TIMEOUT_S)
            await asyncio.wait_for(delete_topic(admin, self.reply_topic), STOP_TIMEOUT_S)
            log.info("client.reply_topic_deleted", reply_topic=self.reply_topic)
        except (TimeoutError, KafkaError, OSError) as exc:  # a leftover topic, not a failure
            log.warning("client.reply_topic_delete_failed", error=repr(exc))
        finally:
            await admin.close()

    def build_request(
        self,
        prompt: str | None = None,
        messages: Sequence[ChatMessage | Mapping[str, str]] | None = None,
        request_id: str | None = None,
        **sampling: Any,
    ) -> Request:
        """Validate here, so a bad argument fails in the caller, not as an error final."""
        unknown = set(sampling) - SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"unknown request fields: {sorted(unknown)}")
        fields = {k: v for k, v in sampling.items() if v is not None}
        request = Request(
            id=request_id or uuid.uuid4().hex,
            reply_to=self.reply_topic,
            reply_partition=self.reply_partition,  # v1.2; None for a private topic
            # v1.2: only replies echoing this secret are taken (a producer could forge others)
            nonce=secrets.token_urlsafe(16),
            prompt=prompt,
            messages=list(messages) if messages is not None else None,
            **fields,
        )
        check_limits(request, self.options.limits)
        return request

    def topic_for(self, urgency: Urgency | str) -> str:
        """The topic a request of `urgency` goes to: its lane, or the request topic."""
        return request_topic_for(
            Urgency.parse(urgency), self.request_topic, is_laned=self.options.urgency_lanes
        )

    async def send(
        self,
        request: Request,
        urgency: Urgency | str = Urgency.NORMAL,
        traceparent: str | None = None,
    ) -> None:
        """Produce `request` (keyed by its id). Its replies are dropped unless `stream` reads them.

        A `send <topic>` span (kind PRODUCER, messaging conventions) wraps the produce, and its
        context goes out as the `traceparent` header unless the caller passes one: the worker's
        spans and every reply then continue the producer's trace."""
        if self._producer is None:
            raise ClientError("the client is not started")
        tracer = self.options.tracer or trace.get_tracer("mini_infer.client")
        topic = self.topic_for(urgency)
        with tracer.start_as_current_span(
            f"send {topic}",
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "send",
                "messaging.destination.name": topic,
                "messaging.message.id": request.id,
            },
        ):
            if traceparent is None:
                carrier: dict[str, str] = {}
                _PROPAGATOR.inject(carrier)
                traceparent = carrier.get("traceparent")
            await self._producer.send_and_wait(
                topic,
                encode(request, MSGPACK),
                key=request.id.encode(),
                headers=request_headers(MSGPACK, urgency, traceparent),
            )

    async def cancel(self, request_id: str) -> None:
        if self._producer is None:
            raise ClientError("the client is not started")
        await self._producer.send_and_wait(
            self.control_topic,
            encode(Cancel(id=request_id), MSGPACK),
            key=request_id.encode(),
            headers=[(CONTENT_TYPE, MSGPACK.encode())],
        )

    async def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[ChatMessage | Mapping[str, str]] | None = None,
        urgency: Urgency | str = Urgency.NORMAL,
        request_id: str | None = None,
        timeout_s: float = 60.0,
        traceparent: str | None = None,
        **sampling: Any,
    ) -> AsyncIterator[Delta]:
        """Send one request and yield what to show; the last delta carries the `final`.

        Raises `RequestFailedError` on an error final and `RequestTimeoutError` (after sending a
        best-effort cancel) when no final comes within `timeout_s`. Leaving the loop early
        cancels the request too, once the generator is closed: at once under
        `contextlib.aclosing(client.stream(...))`, otherwise when it is garbage-collected.
        """
        request = self.build_request(prompt, messages, request_id, **sampling)
        queue = self._router.register(request.id, request.nonce)
        assembler = ReplyAssembler()
        is_cancel_needed = False
        deadline = None
        try:
            await self.send(request, urgency, traceparent)
            is_cancel_needed = True
            # One timer for the whole stream: at the deadline it queues the timeout behind the
            # replies that came before it. (A timer armed for every awaited reply was about a
            # tenth of a streaming client's CPU at W2.)
            deadline = asyncio.get_running_loop().call_later(
                timeout_s, _time_out, queue, request.id
            )
            while not assembler.is_done:
                try:  # a reply already here is taken without a wait
                    item = queue.get_nowait()
                except asyncio.QueueEmpty:
                    item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                for delta in assembler.feed(item):
                    if delta.final is not None:
                        is_cancel_needed = False
                        _raise_if_error(delta.final)
                    yield delta
        except RequestTimeoutError:
            is_cancel_needed = False
            await self._cancel_quietly(request.id)
            raise
        finally:
            if deadline is not None:
                deadline.cancel()
            self._router.unregister(request.id)
            if is_cancel_needed:  # the caller stopped reading, or the stream failed
                self._spawn(self._cancel_quietly(request.id))

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> GenerateResult:
        """The whole completion at once. Asks for `stream=False` unless told otherwise, so the
        worker need send only the final."""
        wants_logprobs = kwargs.get("top_logprobs") is not None or kwargs.get("logprobs") not in (
            None, False,
        )  # fmt: skip
        # Logprobs travel on token replies only: a request that wants them streams.
        kwargs.setdefault("stream", wants_logprobs)
        final = None
        collected: dict[int, _Collected] = {}
        async for delta in self.stream(prompt, **kwargs):
            final = delta.final or final
            collected.setdefault(delta.index, _Collected()).add(delta)
        if final is None:  # unreachable: stream() ends with a final or raises
            raise ClientError("the reply stream ended without a final")
        return _result(final, collected, wants_logprobs)

    async def _cancel_quietly(self, request_id: str) -> None:
        try:
            await asyncio.wait_for(self.cancel(request_id), CANCEL_TIMEOUT_S)
        except (TimeoutError, KafkaError, ClientError) as exc:
            log.warning("client.cancel_failed", request_id=request_id, error=repr(exc))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def partition_of(instance_id: str, num_partitions: int) -> int:
    """A stable, evenly spread partition for an instance id (Python's hash() is salted)."""
    digest = hashlib.sha256(instance_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % num_partitions


def _result(
    final: FinalReply, collected: dict[int, _Collected], wants_logprobs: bool
) -> GenerateResult:
    reasons = [(c.index, c.text, c.finish_reason) for c in final.choices or ()]
    choices = [
        ChoiceResult(
            index, text, reason, collected.get(index, _Collected()).token_ids,
            collected.get(index, _Collected()).logprobs if wants_logprobs else None,
        )  # fmt: skip
        for index, text, reason in reasons or [(0, final.text, final.finish_reason)]
    ]
    return GenerateResult(
        final.text, final.finish_reason, final.usage, final.timing, final.attempt,
        logprobs=choices[0].logprobs, token_ids=choices[0].token_ids, choices=choices,
    )  # fmt: skip


class _Collected:
    """Token ids and logprobs of a stream of deltas, following restarts; None once a delta
    brought text without them (the final filling a gap)."""

    def __init__(self) -> None:
        self.token_ids: list[int] | None = []
        self.logprobs: list[TokenLogprob] | None = []

    def add(self, delta: Delta) -> None:
        if delta.is_restart:
            self.token_ids = list(delta.token_ids)
            self.logprobs = None if delta.logprobs is None else list(delta.logprobs)
            return
        if delta.text and not delta.token_ids:
            self.token_ids = self.logprobs = None  # text whose tokens this client never saw
        if self.token_ids is not None:
            self.token_ids.extend(delta.token_ids)
        if self.logprobs is not None and delta.token_ids:
            if delta.logprobs is None:
                self.logprobs = None
            else:
                self.logprobs.extend(delta.logprobs)


def _time_out(queue: asyncio.Queue[Item], request_id: str) -> None:
    """A stream's deadline: its reader raises this after the replies queued before it."""
    log.warning("client.request_timeout", request_id=request_id)
    queue.put_nowait(RequestTimeoutError(f"no final reply for request {request_id!r} in time"))


def _raise_if_error(final: FinalReply) -> None:
    if final.finish_reason == "error":
        error = final.error
        code, message = (error.code, error.message) if error else ("unknown", "no error details")
        raise RequestFailedError(code, message, final)
