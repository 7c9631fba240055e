"""OpenTelemetry traces and metrics for the worker, and W3C trace-context propagation.

Every request gets one span, a child of the `traceparent` its producer put on the message, so
the producer's trace continues through the worker; the span's own context goes onto every reply
as `traceparent`, so the client's side joins the same trace.

Providers are per `Telemetry` instance, never the process-global ones: tests run several workers
in one process, and a library must not seize the global providers of the program embedding it.
Exporters default to none (spans still get real ids so propagation works); `console` prints them.
Deployments that ship OTLP plug an exporter into `tracer_provider`/`meter_provider`.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from worker.service.settings import ObservabilitySettings

_PROPAGATOR = TraceContextTextMapPropagator()
_SCOPE = "mini_infer.worker"


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
        for processor in extra_span_processors or ():
            self.tracer_provider.add_span_processor(processor)
        self.tracer = self.tracer_provider.get_tracer(_SCOPE)

        readers = []
        if settings.metric_exporter == "console":
            interval_ms = int(settings.metric_export_interval_s * 1000)
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(), interval_ms))
        self.meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        meter = self.meter_provider.get_meter(_SCOPE)
        # Attributes: urgency on arrivals; finish_reason on finals; reason on DLQ writes.
        self.requests_received = meter.create_counter(
            "mini_infer.requests.received", unit="{request}"
        )
        self.requests_finished = meter.create_counter(
            "mini_infer.requests.finished", unit="{request}"
        )
        self.dlq_messages = meter.create_counter("mini_infer.dlq.messages", unit="{message}")
        self.generated_tokens = meter.create_counter("mini_infer.tokens.generated", unit="{token}")
        self.inflight_requests = meter.create_up_down_counter(
            "mini_infer.requests.inflight", unit="{request}"
        )
        self.queued_ms = meter.create_histogram("mini_infer.request.queued", unit="ms")
        self.ttft_ms = meter.create_histogram("mini_infer.request.ttft", unit="ms")
        self.total_ms = meter.create_histogram("mini_infer.request.total", unit="ms")

    def start_request_span(
        self, request_id: str, traceparent: str | None, attributes: dict
    ) -> Span:
        """A span for one request attempt, continuing the producer's trace when it sent one."""
        parent = extract_context(traceparent)
        return self.tracer.start_span(
            "mini_infer.request",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes={"mini_infer.request_id": request_id, **attributes},
        )

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def extract_context(traceparent: str | None) -> Context | None:
    if traceparent is None:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})


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
