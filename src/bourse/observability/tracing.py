"""Traces: OpenTelemetry spans exported over OTLP/HTTP, when ``[server] tracing = true``.

OpenTelemetry (the ``otel`` extra) is imported here only, and only when tracing is
on; :func:`missing_extra` says, before ``bourse serve`` writes anything, that it is
not installed. The tracer provider is this app's own (never the process-global one); spans
leave in batches from the SDK's worker thread, so the event loop never waits on
the collector. A run is one ``bourse.run`` span (under the client's
``traceparent`` when it sent one) with a child for the wait in the book, one for
each engine attempt (whose ``traceparent`` goes to an ``openai`` upstream) and one
for the settlement.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from bourse.ports.observer import Attr, Span

FLUSH_S = 3.0
"""At shutdown, how long the pending spans may take to leave."""
EXPORT_TIMEOUT_S = 5.0
"""One export's bound (retries included): a collector that is down delays shutdown by this at most."""

INSTALL = "pip install 'bourse[otel]'"
"""What an operator runs to get the ``otel`` extra."""

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span as OtelSpanType


def missing_extra() -> str | None:
    """Why ``tracing = true`` cannot work in this interpreter (the ``otel`` extra's
    packages cannot be imported), as a config problem naming the install command; None
    when they can. Imports what :func:`otlp_tracer` will: tracing is on."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        return f"server.tracing: true needs the otel extra, which is not installed ({exc}): {INSTALL}"
    return None


class OtelSpan:
    """A :class:`~bourse.ports.observer.Span` over an OpenTelemetry span."""

    __slots__ = ("_ended", "span")

    def __init__(self, span: OtelSpanType) -> None:
        self.span = span
        self._ended = False

    @property
    def traceparent(self) -> str | None:
        ctx = self.span.get_span_context()
        if not ctx.is_valid:
            return None
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def set(self, key: str, value: Attr) -> None:
        self.span.set_attribute(key, value)

    def end(self, error: str | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()


class Tracer:
    """Starts spans on an OpenTelemetry tracer provider of its own."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self._tracer = provider.get_tracer("bourse")
        self._propagator = TraceContextTextMapPropagator()
        self._in_context = set_span_in_context

    def start(self, name: str, parent: Span | str | None, started: float | None) -> OtelSpan:
        context: Any = None
        if isinstance(parent, OtelSpan):
            context = self._in_context(parent.span)
        elif isinstance(parent, str):
            context = self._propagator.extract({"traceparent": parent})
        start_ns = None
        if started is not None:  # a perf_counter() reading: that long before now
            start_ns = time.time_ns() - int((time.perf_counter() - started) * 1e9)
        return OtelSpan(self._tracer.start_span(name, context=context, start_time=start_ns))

    def close(self) -> None:
        """Export what is pending (waiting at most ``FLUSH_S``, then one export's timeout)
        and stop the exporter's thread."""
        self.provider.force_flush(timeout_millis=int(FLUSH_S * 1000))
        self.provider.shutdown()


def otlp_tracer(
    endpoint: str,
    *,
    service: str,
    instance: str,
    exporter: SpanExporter | None = None,
    delay_ms: float = 1000,
) -> Tracer:
    """A tracer exporting to ``endpoint`` (OTLP over HTTP, protobuf) in batches."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
    provider = TracerProvider(
        resource=Resource.create({"service.name": service, "service.instance.id": instance})
    )
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=delay_ms))
    return Tracer(provider)
