"""OpenTelemetry metrics and traces for the worker, and W3C trace-context propagation.

Metrics follow the OpenTelemetry semantic conventions where they exist (`gen_ai.server.*` for
the model server, `messaging.*` for Kafka) and use `mini_infer.*` names otherwise. They are read
three ways: Prometheus scrapes `GET /metrics` on the health port (text format, through the
official Prometheus exporter with a registry of this worker's own), OTLP pushes them when
`otlp_endpoint` is set, and `console` prints them. The README maps each to vLLM's metric name.

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

from opentelemetry import trace
from opentelemetry.context import Context
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

# Latency buckets in seconds, from a fast decode step to a long generation (vLLM's ranges).
_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
_TOKEN_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
_REQUEST_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300)
_STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
_STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class Telemetry:
    def __init__(
        self,
        settings: ObservabilitySettings,
        worker_id: str,
        extra_span_processors: list[SpanProcessor] | None = None,
    ) -> None:
        resource = Resource.create(
            {"service.name": "mini-infer-worker", "service.instance.id": worker_id}
        )
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
        self._make_instruments(self.meter_provider.get_meter(_SCOPE))

    def _make_instruments(self, meter) -> None:
        # Requests. Attributes: urgency; finish_reason on finished; reason on dead letters.
        self.requests_received = meter.create_counter(
            "mini_infer.requests.received", unit="{request}", description="requests consumed"
        )
        self.requests_finished = meter.create_counter(
            "mini_infer.requests.finished", unit="{request}", description="finals sent"
        )
        self.dlq_messages = meter.create_counter(
            "mini_infer.dlq.messages", unit="{message}", description="dead letters written"
        )
        self.inflight_requests = meter.create_up_down_counter(
            "mini_infer.requests.inflight", unit="{request}", description="consumed, unanswered"
        )
        # Tokens.
        self.prompt_tokens = meter.create_counter(
            "mini_infer.tokens.prompt", unit="{token}", description="prompt tokens of finals"
        )
        self.generated_tokens = meter.create_counter(
            "mini_infer.tokens.generated", unit="{token}", description="tokens generated"
        )
        # Latency (seconds, as the gen_ai conventions ask).
        self.ttft_s = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s",
            description="from consumption to the first generated token",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS_S,
        )  # fmt: skip
        self.tpot_s = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="decode time per output token after the first, per request",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS_S,
        )  # fmt: skip
        self.itl_s = meter.create_histogram(
            "mini_infer.inter_token_latency", unit="s",
            description="gap between consecutive output tokens",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS_S,
        )  # fmt: skip
        self.e2e_s = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s",
            description="from consumption to the final",
            explicit_bucket_boundaries_advisory=_REQUEST_BUCKETS_S,
        )  # fmt: skip
        # stage = kafka (producer timestamp -> consumed), batcher, engine (added -> scheduled).
        self.queue_s = meter.create_histogram(
            "mini_infer.request.queue_time",
            unit="s",
            description="time queued, by stage",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS_S,
        )
        self.prefill_s = meter.create_histogram(
            "mini_infer.request.prefill_time",
            unit="s",
            description="the first token's step",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS_S,
        )
        self.decode_s = meter.create_histogram(
            "mini_infer.request.decode_time",
            unit="s",
            description="first token to the last",
            explicit_bucket_boundaries_advisory=_REQUEST_BUCKETS_S,
        )
        # Engine state, sampled after every step.
        self.running_requests = meter.create_gauge(
            "mini_infer.engine.requests.running", unit="{request}"
        )
        self.waiting_requests = meter.create_gauge(
            "mini_infer.engine.requests.waiting", unit="{request}"
        )
        self.kv_blocks_used = meter.create_gauge("mini_infer.kv_cache.blocks.used", unit="{block}")
        self.kv_blocks_total = meter.create_gauge(
            "mini_infer.kv_cache.blocks.total", unit="{block}"
        )
        self.kv_usage = meter.create_gauge(
            "mini_infer.kv_cache.usage", unit="1", description="blocks used / total"
        )
        self.prefix_hit_rate = meter.create_gauge(
            "mini_infer.prefix_cache.hit_rate", unit="1", description="since start"
        )
        self.step_tokens = meter.create_histogram(
            "mini_infer.engine.step.tokens",
            unit="{token}",
            description="tokens computed per step",
            explicit_bucket_boundaries_advisory=_STEP_TOKEN_BUCKETS,
        )
        self.preemptions = meter.create_counter("mini_infer.engine.preemptions", unit="{event}")
        # Steps sized by urgency: how long steps take (against step_time_target_ms), and the
        # requests answered `expired` at admission because their deadline could not be met.
        self.step_s = meter.create_histogram(
            "mini_infer.engine.step.duration", unit="s", description="one engine step",
            explicit_bucket_boundaries_advisory=_STEP_BUCKETS_S,
        )  # fmt: skip
        self.expired_at_admission = meter.create_counter(
            "mini_infer.requests.expired_at_admission", unit="{request}",
            description="deadline unreachable given the work ahead and the step cost model",
        )  # fmt: skip
        # Kafka (messaging conventions): lag per partition (a hint: brokers differ), paused.
        self.consumer_lag = meter.create_gauge(
            "messaging.kafka.consumer.lag", unit="{message}",
            description="high watermark minus the next offset to consume (a hint)",
        )  # fmt: skip
        self.paused_partitions = meter.create_gauge(
            "mini_infer.consumer.partitions.paused", unit="{partition}"
        )
        self.assigned_partitions = meter.create_gauge(
            "mini_infer.consumer.partitions.assigned", unit="{partition}"
        )

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
