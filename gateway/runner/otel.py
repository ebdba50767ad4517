"""Spans of Chat Jobs and turns through the OpenTelemetry SDK, exported over OTLP/HTTP.

Imported only when tracing is on (:meth:`Tracing.start`, called by the supervisor). A session span per Chat Job
(child of the job's ``agentDefinition.traceparent`` when present) and a turn span per chat turn
(child of the session span, or of the turn frame's own ``traceparent`` when the Server sent one,
then linked to the session span), named and attributed after the OpenTelemetry GenAI semantic
conventions. Spans leave through the SDK's batch processor, in its own thread: an export never
waits in a turn, and a collector that cannot be reached costs one warning line until it takes
spans again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.runner.tracing import usage_attributes
from gateway.wire.traceparent import valid_traceparent

log = logging.getLogger("gateway.tracing")

SERVICE_NAME = "alp-gateway"
_EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.http", "opentelemetry.sdk.trace.export")
_propagator = TraceContextTextMapPropagator()


class Tracing:
    """The process's tracer, its exporter and the spans' shape; made by :meth:`start`."""

    def __init__(self, provider: TracerProvider, tracer: Tracer, endpoint: str) -> None:
        self._provider = provider
        self._tracer = tracer
        self.endpoint = endpoint

    @classmethod
    def start(cls, endpoint: str, *, service_version: str = "") -> Tracing:
        """Set up the SDK: resource from ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``
        (service name ``alp-gateway`` when unset), a batch processor, the OTLP/HTTP exporter."""
        attributes: dict[str, str] = {}
        if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        ):
            attributes["service.name"] = SERVICE_NAME
        if service_version:
            attributes["service.version"] = service_version
        provider = TracerProvider(resource=Resource.create(attributes))
        exporter = _OneWarningExporter(OTLPSpanExporter(endpoint=endpoint), endpoint)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        for name in _EXPORTER_LOGGERS:  # their per-batch complaints: ours says it once
            logging.getLogger(name).addFilter(_quiet_exporter_logs)
        tracer = provider.get_tracer("gateway", service_version or None)
        log.info("traces go to %s", endpoint)
        return cls(provider, tracer, endpoint)

    def session(
        self, job_id: str, run_id: str, traceparent: str | None, runner_name: str = ""
    ) -> SessionTrace:
        """The span of one Chat Job, started now."""
        context = _context_from(traceparent)
        attributes: dict[str, Any] = {"alp.job.id": job_id, "alp.run.id": run_id}
        if runner_name:
            attributes["alp.runner.name"] = runner_name
        span = self._tracer.start_span(
            "chat_llm session", context=context, kind=SpanKind.CONSUMER, attributes=attributes
        )
        return SessionTrace(self._tracer, span, job_id, valid_traceparent(traceparent))

    def flush(self, timeout_s: float = 5.0) -> None:
        """Export what is still queued (blocking: call from a thread)."""
        self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flush and stop the exporter (blocking: call from a thread)."""
        self._provider.shutdown()


class SessionTrace:
    """The open span of one Chat Job; makes its turns' spans."""

    def __init__(self, tracer: Tracer, span: Span, job_id: str, parent: str | None = None) -> None:
        self._tracer = tracer
        self.span = span
        self.job_id = job_id
        self.parent = parent  # the job's traceparent: a turn frame that repeats it adds nothing

    def turn(
        self,
        request_id: str,
        model: str | None,
        backend_url: str = "",
        traceparent: str | None = None,
    ) -> TurnTrace:
        """The span of one turn, started now: a child of the session span, or of the frame's
        ``traceparent`` (the client's own trace, as the hub forwards it) with a link to it."""
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "alp.job.id": self.job_id,
            "alp.request.id": request_id,
        }
        if model:
            attributes["gen_ai.request.model"] = model
        attributes.update(_server_attributes(backend_url))
        parent = (
            None if valid_traceparent(traceparent) == self.parent else _context_from(traceparent)
        )
        links: Sequence[Link] = ()
        if parent is None:
            parent = trace.set_span_in_context(self.span)
        else:
            links = (Link(self.span.get_span_context()),)
        span = self._tracer.start_span(
            f"chat {model}" if model else "chat",
            context=parent,
            kind=SpanKind.CLIENT,
            attributes=attributes,
            links=links,
        )
        return TurnTrace(span)

    def end(self, outcome: str, reason: str) -> None:
        self.span.set_attribute("alp.session.outcome", outcome)
        self.span.set_attribute("alp.session.end_reason", reason)
        if outcome != "success":
            self.span.set_status(Status(StatusCode.ERROR, reason))
        self.span.end()


class TurnTrace:
    """The open span of one turn: its ``traceparent`` for the backend, first token, outcome."""

    def __init__(self, span: Span) -> None:
        self.span = span
        context = span.get_span_context()
        flags = int(context.trace_flags)
        self.traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}"

    def routed(self, model: str | None) -> None:
        """The model the backend is asked for, once the turn is routed (names the span)."""
        if model:
            self.span.set_attribute("gen_ai.request.model", model)
            self.span.update_name(f"chat {model}")

    def backend(self, url: str) -> None:
        """The backend the turn went to (``server.address`` / ``server.port``)."""
        self.span.set_attributes(_server_attributes(url))

    def first_token(self) -> None:
        self.span.add_event("gen_ai.first_token")

    def end(self, outcome: str, error: str | None, chunks: int, last_payload: bytes | None) -> None:
        """End the span: ``outcome`` ("done", "error", "cancelled"...), the error text when
        there is one, the chunk count and the GenAI attributes of the stream's last chunk."""
        span = self.span
        span.set_attribute("alp.turn.outcome", outcome)
        span.set_attribute("alp.turn.chunks", chunks)
        for key, value in usage_attributes(last_payload).items():
            span.set_attribute(key, value)
        if error is not None:
            span.set_attribute("error.type", outcome)
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()


def _server_attributes(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    if not parts.hostname:
        return {}
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return {"server.address": parts.hostname, "server.port": port}


def _context_from(traceparent: str | None) -> Any:
    """An OpenTelemetry context whose parent is ``traceparent``, or None (a new trace)."""
    value = valid_traceparent(traceparent)
    if value is None:
        return None
    return _propagator.extract({"traceparent": value})


def _quiet_exporter_logs(record: logging.LogRecord) -> bool:
    """The SDK's exporter logs each failed batch; :class:`_OneWarningExporter` says it once."""
    return record.levelno >= logging.CRITICAL


class _OneWarningExporter(SpanExporter):
    """Wraps the OTLP exporter: one warning when the collector stops taking spans, one info
    line when it takes them again; nothing per batch."""

    def __init__(self, inner: SpanExporter, endpoint: str) -> None:
        self._inner = inner
        self._endpoint = endpoint
        self._failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception as exc:  # the SDK would log it per batch; we say it once, below
            log.debug("trace export raised %s", type(exc).__name__)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            if self._failing:
                self._failing = False
                log.info("traces: the collector at %s takes spans again", self._endpoint)
        elif not self._failing:
            self._failing = True
            log.warning(
                "traces: the collector at %s does not take spans; they are dropped until it does",
                self._endpoint,
            )
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)
