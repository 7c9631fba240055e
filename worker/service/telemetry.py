"""OpenTelemetry metrics and traces for the worker, and W3C trace-context propagation.

Metrics follow the OpenTelemetry semantic conventions where they exist (`gen_ai.server.*` for
the model server, `messaging.*` for Kafka) and use `mini_infer.*` names otherwise. They are read
three ways: Prometheus scrapes `GET /metrics` on the health port (text format, through the
official Prometheus exporter with a registry of this worker's own), OTLP pushes them when
`otlp_endpoint` is set, and `console` prints them. The README maps each to vLLM's metric name.
Every measurement carries the served model (`gen_ai.request.model`); gauges are observable
(read from the last-seen state at each collection), so an idle worker still reports them.

Traces: every request attempt gets a `process <topic>` span (kind CONSUMER), a child of the
producer's `traceparent` and linked to it as the messaging conventions ask; its stages are child
spans (batcher wait, engine queue, prefill, decode, publish) built with their measured start and
end times. The span's own context goes onto every reply as `traceparent`.

Providers are per `Telemetry` instance, never the process-global ones: tests run several workers
in one process, and a library must not seize the global providers of the program embedding it.
Spans get real ids even with no exporter, so propagation works everywhere.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry

from worker.service.settings import ObservabilitySettings

_PROPAGATOR = TraceContextTextMapPropagator()
_SCOPE = "mini_infer.worker"
DEFAULT_SERVICE_NAME = "mini-infer-worker"  # OTEL_SERVICE_NAME (or its resource attribute) wins
PROVIDER_NAME = "mini_infer"  # gen_ai.provider.name: the server itself, no upstream provider

# Latency buckets in seconds, from a fast decode step to a long generation (vLLM's ranges).
_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
_TOKEN_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
_REQUEST_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300)
_STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
# Queue time: a request may wait in a Kafka backlog for minutes or hours (an asynchronous
# pipeline is allowed to), so the buckets go on to 4 h instead of piling into +Inf at 80 s.
_QUEUE_BUCKETS_S = (*_TTFT_BUCKETS_S, 160, 300, 600, 1200, 1800, 3600, 7200, 14400)
_STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class _Deferred:
    """Measurements of the histograms recorded once a step or once a token, kept until the
    next collection and handed to the SDK then, in one batch off the token path.

    One OpenTelemetry `record` costs 12-20 us in a tight loop on the 2-core VMs, and more on
    the token path, where a worker's loop comes to it cold between steps; an append costs
    well under a microsecond. Recorded at collection instead, the loop's CPU time per token
    fell to 0.90x at W2's shape and 0.94x at one stream's (loadtest/JOURNAL.md, thirty-eighth
    session, "The per-step metrics recorded at collection"). Every reader's collection runs the
    observable instruments' callbacks before it reads the instruments, and `flush` is one of
    them, so a scrape or an export sees every measurement made before it. Where nothing
    collects (no exporter), the measurements are recorded every `MAX_PENDING`."""

    MAX_PENDING = 4096

    def __init__(self) -> None:
        # A deque: appends on the event loop and pops on a scrape's thread need no lock.
        self._pending: deque = deque()

    def add(self, record, amount: float, count: int, attributes: dict) -> None:
        self._pending.append((record, amount, count, attributes))
        if len(self._pending) > self.MAX_PENDING:
            self.flush()

    def flush(self, _options: CallbackOptions | None = None) -> list[Observation]:
        """Records what is pending (a callback of an observable instrument: it observes
        nothing itself)."""
        pending = self._pending
        while True:
            try:
                record, amount, count, attributes = pending.popleft()
            except IndexError:
                return []
            for _ in range(count):
                record(amount, attributes)


class _Bound:
    """An instrument whose every measurement carries the worker's constant attributes (the
    served model, and so on) besides its own; a histogram given `deferred` hands its
    measurements to the SDK at the next collection."""

    def __init__(self, instrument, attributes: dict[str, str], deferred: _Deferred | None = None):
        self._instrument = instrument
        self._attributes = attributes
        self._deferred = deferred

    def add(self, amount: float, attributes: dict | None = None) -> None:
        self._instrument.add(amount, {**self._attributes, **(attributes or {})})

    def record(self, amount: float, attributes: dict | None = None) -> None:
        self.record_many(amount, 1, attributes)

    def record_many(self, amount: float, count: int, attributes: dict | None = None) -> None:
        """`record(amount, attributes)` `count` times, the attributes merged once."""
        merged = {**self._attributes, **(attributes or {})}
        if self._deferred is not None:
            self._deferred.add(self._instrument.record, amount, count, merged)
            return
        record = self._instrument.record
        for _ in range(count):
            record(amount, merged)


@dataclass
class EngineState:
    """The engine as last seen (at start, then after every step). Observable gauges read it at
    each collection, so an idle worker's scrape still shows them."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks_used: int = 0
    num_blocks_total: int = 0
    # engine.outputs.EngineStats: its counters are cumulative. The first one seen is the
    # start-up baseline (what warm-up did is not traffic); the counters report from it.
    first_stats: Any = None
    last_stats: Any = None


@dataclass
class KafkaState:
    """The consumer as last sampled (`kafka_sample_interval_s`): partitions and lag."""

    num_assigned: int = 0
    num_paused: int = 0
    lags: dict[tuple[str, int], int] = field(default_factory=dict)  # (topic, partition) -> lag


class Telemetry:
    def __init__(
        self,
        settings: ObservabilitySettings,
        worker_id: str,
        extra_span_processors: list[SpanProcessor] | None = None,
        *,
        model_name: str = "unknown",
        group_id: str | None = None,
    ) -> None:
        resource = Resource.create({"service.instance.id": worker_id})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": DEFAULT_SERVICE_NAME}))
        self.tracer_provider = TracerProvider(resource=resource)
        if settings.trace_exporter == "console":
            self.tracer_provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif settings.trace_exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=_otlp_url(settings.otlp_endpoint, "traces"))
            self.tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
        for processor in extra_span_processors or ():
            self.tracer_provider.add_span_processor(processor)
        self.tracer = self.tracer_provider.get_tracer(_SCOPE)

        # Prometheus: a registry of this worker's own (several workers can share a process).
        self.prometheus_registry = CollectorRegistry(auto_describe=True)
        readers: list[MetricReader] = []
        if settings.prometheus:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader

            readers.append(PrometheusMetricReader(registry=self.prometheus_registry))
        interval_ms = int(settings.metric_export_interval_s * 1000)
        if settings.metric_exporter == "console":
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(), interval_ms))
        elif settings.metric_exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            exporter = OTLPMetricExporter(endpoint=_otlp_url(settings.otlp_endpoint, "metrics"))
            readers.append(PeriodicExportingMetricReader(exporter, interval_ms))
        self.meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        # Every metric names the served model (vLLM's `model_name`), by the gen_ai convention's
        # attribute; request metrics add the rest of the gen_ai attributes, Kafka ones the
        # messaging attributes.
        self.model_attributes = {"gen_ai.request.model": model_name}
        self.request_attributes = {"gen_ai.provider.name": PROVIDER_NAME, **self.model_attributes}
        self.kafka_attributes = {
            "messaging.system": "kafka",
            **({"messaging.consumer.group.name": group_id} if group_id else {}),
            **self.model_attributes,
        }
        self.engine_state = EngineState()
        self.kafka_state = KafkaState()
        self.deferred = _Deferred()  # the per-step and per-token histograms' measurements
        meter = self.meter_provider.get_meter(_SCOPE)
        self._make_request_instruments(meter)
        self._make_engine_instruments(meter)
        self._make_kafka_instruments(meter)

    def _make_request_instruments(self, meter) -> None:
        # Attributes: urgency and gen_ai.operation.name; finish_reason (and error.type) on
        # finished; reason on dead letters.
        req, model = self.request_attributes, self.model_attributes
        self.requests_received = _Bound(meter.create_counter(
            "mini_infer.requests.received", unit="{request}", description="requests consumed"
        ), req)  # fmt: skip
        self.requests_finished = _Bound(meter.create_counter(
            "mini_infer.requests.finished", unit="{request}", description="finals sent"
        ), req)  # fmt: skip
        self.dlq_messages = _Bound(meter.create_counter(
            "mini_infer.dlq.messages", unit="{message}", description="dead letters written"
        ), model)  # fmt: skip
        self.inflight_requests = _Bound(meter.create_up_down_counter(
            "mini_infer.requests.inflight", unit="{request}", description="consumed, unanswered"
        ), model)  # fmt: skip
        self.prompt_tokens = _Bound(meter.create_counter(
            "mini_infer.tokens.prompt", unit="{token}", description="prompt tokens of finals"
        ), model)  # fmt: skip
        self.generated_tokens = _Bound(meter.create_counter(
            "mini_infer.tokens.generated", unit="{token}", description="tokens generated"
        ), model)  # fmt: skip
        # Latency (seconds, as the gen_ai conventions ask).
        self.ttft_s = _Bound(meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s",
            description="from consumption to the first generated token",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS_S,
        ), req)  # fmt: skip
        self.tpot_s = _Bound(meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="decode time per output token after the first, per request",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS_S,
        ), req)  # fmt: skip
        self.e2e_s = _Bound(meter.create_histogram(
            "gen_ai.server.request.duration", unit="s",
            description="from consumption to the final",
            explicit_bucket_boundaries_advisory=_REQUEST_BUCKETS_S,
        ), req)  # fmt: skip
        self.itl_s = _Bound(meter.create_histogram(
            "mini_infer.inter_token_latency", unit="s",
            # As the worker's event loop received them: where it handles several steps' tokens
            # at once (it lags the engine on busy cores), their gaps are near 0 and the next
            # one is long, as its clients see them (loadtest/JOURNAL.md, "tokens arrive in
            # bursts").
            description="gap between consecutive output tokens as the worker handled them",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS_S,
        ), model, self.deferred)  # fmt: skip
        # stage = kafka (producer timestamp -> consumed), batcher, engine (added -> scheduled).
        self.queue_s = _Bound(meter.create_histogram(
            "mini_infer.request.queue_time", unit="s", description="time queued, by stage",
            explicit_bucket_boundaries_advisory=_QUEUE_BUCKETS_S,
        ), model)  # fmt: skip
        self.prefill_s = _Bound(meter.create_histogram(
            "mini_infer.request.prefill_time", unit="s", description="the first token's step",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS_S,
        ), model)  # fmt: skip
        self.decode_s = _Bound(meter.create_histogram(
            "mini_infer.request.decode_time", unit="s", description="first token to the last",
            explicit_bucket_boundaries_advisory=_REQUEST_BUCKETS_S,
        ), model)  # fmt: skip
        self.inflight_requests.add(0)  # present from the first scrape (rate() needs a start)

    def _make_engine_instruments(self, meter) -> None:
        model, state = self.model_attributes, self.engine_state

        def gauge(name: str, unit: str, read, description: str = "", first=None) -> None:
            def observe(_options: CallbackOptions) -> list[Observation]:
                return [Observation(read(), model)]

            callbacks = [observe] if first is None else [first, observe]
            meter.create_observable_gauge(name, callbacks, unit=unit, description=description)

        # The deferred histograms' measurements are recorded by the first gauge's first
        # callback: every collection runs it before it reads the instruments.
        gauge("mini_infer.engine.requests.running", "{request}", lambda: state.num_running,
              first=self.deferred.flush)  # fmt: skip
        gauge("mini_infer.engine.requests.waiting", "{request}", lambda: state.num_waiting)
        gauge("mini_infer.kv_cache.blocks.used", "{block}", lambda: state.num_blocks_used)
        gauge("mini_infer.kv_cache.blocks.total", "{block}", lambda: state.num_blocks_total)
        gauge(
            "mini_infer.kv_cache.usage", "1",
            lambda: state.num_blocks_used / state.num_blocks_total if state.num_blocks_total else 0.0,
            "blocks used / total",
        )  # fmt: skip

        # The engine's cumulative counters, read at each collection like the gauges (nothing
        # is added per step): asynchronous counters, counted from the start-up baseline.
        def counter(name: str, unit: str, reads, description: str = "") -> None:
            def observe(_options: CallbackOptions) -> list[Observation]:
                first, last = state.first_stats, state.last_stats
                return [
                    Observation(0 if first is None else read(last) - read(first),
                                {**model, **attributes})
                    for read, attributes in reads
                ]  # fmt: skip

            meter.create_observable_counter(name, [observe], unit=unit, description=description)

        # Prefix cache as vLLM counts it: prompt tokens looked up, and of those found; the hit
        # rate over any window is rate(hits) / rate(queries).
        counter("mini_infer.prefix_cache.queries", "{token}",
                [(lambda s: s.num_prefix_queries, {})],
                "prompt tokens looked up in the prefix cache")  # fmt: skip
        counter("mini_infer.prefix_cache.hits", "{token}", [(lambda s: s.num_prefix_hits, {})],
                "prompt tokens found in the prefix cache")  # fmt: skip
        counter("mini_infer.engine.preemptions", "{event}", [(lambda s: s.num_preemptions, {})])
        # The fused CPU decode step, by threads: "one" where one thread measured faster than all
        # (other work on the engine's cores: the loop, a co-located broker or clients).
        counter("mini_infer.engine.fused_steps", "{step}", [
            (lambda s: s.num_fused_steps_one_thread, {"threads": "one"}),
            (lambda s: s.num_fused_steps - s.num_fused_steps_one_thread, {"threads": "all"}),
        ], "fused CPU decode steps, by threads (all, or one: the cores were busy)")  # fmt: skip
        # The engine thread's waits for the GIL after its fused steps: the event loop held it.
        counter("mini_infer.engine.gil_wait", "s", [(lambda s: s.fused_step_gil_wait_s, {})],
                "time the engine thread waited for the GIL after its fused steps")  # fmt: skip
        # Speculative decoding: tokens drafted or looked up (the request's own tokens), by
        # whether the verifying step kept them.
        counter("mini_infer.engine.draft_tokens", "{token}", [
            (lambda s: s.num_draft_accepted, {"accepted": "true"}),
            (lambda s: s.num_draft_tokens - s.num_draft_accepted, {"accepted": "false"}),
        ], "tokens a speculative step drafted, by whether its verification kept them")  # fmt: skip
        self.step_tokens = _Bound(meter.create_histogram(
            "mini_infer.engine.step.tokens", unit="{token}",
            description="tokens computed per step",
            explicit_bucket_boundaries_advisory=_STEP_TOKEN_BUCKETS,
        ), model, self.deferred)  # fmt: skip
        # Steps sized by urgency: how long steps take (against step_time_target_ms), and the
        # requests answered `expired` at admission because their deadline could not be met.
        self.step_s = _Bound(meter.create_histogram(
            "mini_infer.engine.step.duration", unit="s", description="one engine step",
            explicit_bucket_boundaries_advisory=_STEP_BUCKETS_S,
        ), model, self.deferred)  # fmt: skip
        self.expired_at_admission = _Bound(meter.create_counter(
            "mini_infer.requests.expired_at_admission", unit="{request}",
            description="deadline unreachable given the work ahead and the step cost model",
        ), model)  # fmt: skip

    def _make_kafka_instruments(self, meter) -> None:
        kafka, state = self.kafka_attributes, self.kafka_state

        def lags(_options: CallbackOptions) -> list[Observation]:
            return [
                Observation(lag, {
                    **kafka, "messaging.destination.name": topic,
                    "messaging.destination.partition.id": str(partition),
                })  # fmt: skip
                for (topic, partition), lag in list(state.lags.items())
            ]

        meter.create_observable_gauge(
            "messaging.kafka.consumer.lag", [lags], unit="{message}",
            description="high watermark minus the next offset to consume (a hint)",
        )  # fmt: skip
        meter.create_observable_gauge(
            "mini_infer.consumer.partitions.paused",
            [lambda _options: [Observation(state.num_paused, kafka)]],
            unit="{partition}",
        )
        meter.create_observable_gauge(
            "mini_infer.consumer.partitions.assigned",
            [lambda _options: [Observation(state.num_assigned, kafka)]],
            unit="{partition}",
            description="partitions of the request topic this worker holds",
        )
        self.records_refetched = _Bound(meter.create_counter(
            "mini_infer.consumer.records.refetched", unit="{record}",
            description="records sought back and fetched again, not lost (reason: untracked, "
            "a partition not yet tracked; offset_gap, a gap in the offsets)",
        ), kafka)  # fmt: skip

    def observe_engine(self, stats) -> None:
        """The engine's `EngineStats` after a step (or at start, the baseline: what warm-up did
        is not counted as traffic). Its cumulative counters are read at collection; a step adds
        only its tokens to the histogram."""
        state, previous = self.engine_state, self.engine_state.last_stats
        state.last_stats = stats
        state.num_running, state.num_waiting = stats.num_running, stats.num_waiting
        state.num_blocks_used = stats.num_blocks_total - stats.num_blocks_free
        state.num_blocks_total = stats.num_blocks_total
        if previous is None:
            state.first_stats = stats
        elif stats.num_tokens_computed > previous.num_tokens_computed:
            self.step_tokens.record(stats.num_tokens_computed - previous.num_tokens_computed)

    def start_request_span(
        self, topic: str, request_id: str, traceparent: str | None, attributes: dict
    ) -> Span:
        """The `process` span of one request attempt: a child of the producer's context (the
        trace continues) and linked to it (the messaging conventions' batch-safe form)."""
        parent = extract_context(traceparent)
        links = []
        if parent is not None:
            producer = trace.get_current_span(parent).get_span_context()
            if producer.is_valid:
                links.append(Link(producer))
        return self.tracer.start_span(
            f"process {topic}",
            context=parent,
            kind=SpanKind.CONSUMER,
            links=links,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "process",
                "messaging.destination.name": topic,
                "messaging.message.id": request_id,
                "mini_infer.request_id": request_id,
                **attributes,
            },
        )

    def record_stage(
        self, parent: Span, name: str, start_s: float | None, end_s: float | None
    ) -> None:
        """A finished child span of `parent` from monotonic `start_s` to `end_s`."""
        if start_s is None or end_s is None or end_s < start_s:
            return
        span = self.tracer.start_span(
            name,
            context=trace.set_span_in_context(parent),
            start_time=_epoch_ns(start_s),
        )
        span.end(end_time=_epoch_ns(end_s))

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def _epoch_ns(monotonic_s: float) -> int:
    """A monotonic timestamp as Unix epoch nanoseconds (what spans carry)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _otlp_url(endpoint: str | None, signal: str) -> str | None:
    """OTLP/HTTP wants one URL per signal; None lets the exporter read OTEL_EXPORTER_* env."""
    if endpoint is None:
        return None
    return f"{endpoint.rstrip('/')}/v1/{signal}"


def extract_context(traceparent: str | None) -> Context | None:
    if traceparent is None:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})


def trace_id_of(span: Span) -> str | None:
    context = span.get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def traceparent_of(span: Span) -> str | None:
    """The W3C header naming `span` as the parent, or None for an invalid (no-op) span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def end_span(span: Span, finish_reason: str, error_message: str | None = None) -> None:
    span.set_attribute("mini_infer.finish_reason", finish_reason)
    if finish_reason == "error":
        span.set_status(Status(StatusCode.ERROR, error_message))
    span.end()
