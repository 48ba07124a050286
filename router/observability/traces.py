"""Traces over OTLP/HTTP: one trace per request, built from its access record at its end.

Spans (all children of the request span, which continues the caller's ``traceparent``):

- ``chat MODEL`` (server): the whole request, with the GenAI semantic-convention attributes
  (``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.response.model``,
  ``gen_ai.request.max_tokens``, ``gen_ai.usage.input_tokens``/``output_tokens``,
  ``server.address``) and firstbyte's (``firstbyte.region``, ``firstbyte.backend``,
  ``firstbyte.transport``, ``firstbyte.ttft_ms``, ``firstbyte.outcome``...);
- ``admit`` (received to admitted), ``route`` (admitted to backend chosen);
- ``upstream`` (client): upstream request sent to the stream's end, with the events
  ``first_token`` and ``stream_end``.

Spans are made after the fact from the recorded times (no span objects live through the
request, nothing runs per chunk) and carry the router's own span id: the request span's id is
the one the router put in the ``traceparent`` it sent upstream and back to the client, so an
upstream that traces too (vLLM) hangs its spans under it.

The official OpenTelemetry SDK does the batching and the OTLP/HTTP protobuf export (the
``otel`` extra); it is imported only when ``[telemetry] otlp_endpoint`` is set.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..pipeline.context import new_span_id
from .access import AccessRecord

if TYPE_CHECKING:
    from ..config import TelemetryConfig

__all__ = ["OtlpTraces", "otel_missing", "traces_url"]

_SCOPE = "firstbyte.router"


def otel_missing() -> str | None:
    """None when the ``otel`` extra is installed, else what to install."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return "needs the otel extra (pip install 'firstbyte[otel]')"
    return None


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: ``endpoint`` as given, or with ``/v1/traces`` if it has no
    path (as ``OTEL_EXPORTER_OTLP_ENDPOINT`` is read)."""
    scheme, _, rest = endpoint.partition("://")
    host, slash, path = rest.partition("/")
    if not slash or not path:
        return f"{scheme}://{host}/v1/traces"
    return endpoint



_OPERATIONS = {"completions": "text_completion", "embeddings": "embeddings"}
"""GenAI ``gen_ai.operation.name`` by endpoint; chat, Responses and Messages are ``chat``."""


def _operation(record: AccessRecord) -> str | None:
    if record.model is None:
        return None
    return _OPERATIONS.get(record.endpoint or "chat", "chat")

class OtlpTraces:
    """Turns access records into spans and exports them in batches from a worker thread."""

    def __init__(self, config: TelemetryConfig, region: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        assert config.otlp_endpoint is not None
        self.url = traces_url(config.otlp_endpoint)
        self._resource = Resource.create(
            {"service.name": config.service_name, "firstbyte.region": region}
        )
        self._scope = InstrumentationScope(_SCOPE)
        exporter = OTLPSpanExporter(endpoint=self.url, headers=dict(config.headers), timeout=10)
        self._processor = BatchSpanProcessor(
            exporter, schedule_delay_millis=config.export_interval_s * 1000
        )

    def export(self, record: AccessRecord) -> None:
        """Queue the record's spans for export (never blocks; a full queue drops them)."""
        for span in self.spans(record):
            self._processor.on_end(span)

    def spans(self, record: AccessRecord) -> list[Any]:
        """The record's spans, request span first (``ReadableSpan`` objects)."""
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        # perf_counter seconds -> Unix nanoseconds, with one offset for the whole request.
        offset_ns = time.time_ns() - time.perf_counter_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset_ns

        trace_id = int(record.trace_id, 16)
        flags = TraceFlags(TraceFlags.SAMPLED)

        def context(span_id: str) -> SpanContext:
            return SpanContext(trace_id, int(span_id, 16), is_remote=False, trace_flags=flags)

        request_ctx = context(record.request_id)
        caller = (
            SpanContext(trace_id, int(record.caller_span_id, 16), is_remote=True,
                        trace_flags=flags)
            if record.caller_span_id else None
        )
        failed = record.outcome not in ("ok", "") or (record.status or 0) >= 500
        status = Status(StatusCode.ERROR, record.outcome) if failed else Status(StatusCode.UNSET)

        def span(
            name: str,
            ctx: SpanContext,
            parent: SpanContext | None,
            start: float,
            end: float,
            kind: SpanKind = SpanKind.INTERNAL,
            attributes: dict[str, Any] | None = None,
            events: tuple[Event, ...] = (),
            span_status: Status | None = None,
        ) -> ReadableSpan:
            return ReadableSpan(
                name=name, context=ctx, parent=parent, resource=self._resource,
                attributes={k: v for k, v in (attributes or {}).items() if v is not None},
                events=events, kind=kind, status=span_status or Status(StatusCode.UNSET),
                start_time=ns(start), end_time=ns(max(start, end)),
                instrumentation_scope=self._scope,
            )  # fmt: skip

        operation = _operation(record)
        name = f"{operation} {record.model}" if record.model else f"{record.method} {record.path}"
        ttft = record.ttft_ms
        out = [
            span(
                name, request_ctx, caller, record.started_at, record.ended_at, SpanKind.SERVER,
                {
                    "gen_ai.operation.name": operation,
                    "gen_ai.request.model": record.model,
                    "gen_ai.response.model": record.usage.response_model,
                    "gen_ai.request.max_tokens": record.max_tokens,
                    "gen_ai.usage.input_tokens": record.usage.input_tokens,
                    "gen_ai.usage.output_tokens": record.usage.output_tokens,
                    "server.address": record.server_address,
                    "http.request.method": record.method,
                    "http.route": record.path,
                    "http.response.status_code": record.status,
                    "network.protocol.version": record.http_version,
                    "firstbyte.region": record.region,
                    "firstbyte.backend": record.backend,
                    "firstbyte.transport": record.transport,
                    "firstbyte.ttft_ms": None if ttft is None else round(ttft, 3),
                    "firstbyte.outcome": record.outcome,
                    "firstbyte.stream": record.stream,
                    "firstbyte.key_id": record.key_id,
                },
                span_status=status,
            )
        ]
        if record.admitted_at is not None:
            out.append(
                span("admit", context(new_span_id()), request_ctx, record.started_at,
                     record.admitted_at)
            )  # fmt: skip
        if record.admitted_at is not None and record.routed_at is not None:
            placed = {"firstbyte.backend": record.backend, "firstbyte.region": record.region}
            out.append(
                span("route", context(new_span_id()), request_ctx, record.admitted_at,
                     record.routed_at, attributes=placed)
            )  # fmt: skip
        if record.upstream_sent_at is not None:
            out.append(self._upstream(record, span, context, request_ctx, ns, status))
        return out

    @staticmethod
    def _upstream(
        record: AccessRecord,
        span: Callable[..., Any],
        context: Callable[[str], Any],
        parent: Any,
        ns: Callable[[float], int],
        status: Any,
    ) -> Any:
        """The ``upstream`` client span with its ``first_token`` and ``stream_end`` events."""
        from opentelemetry.sdk.trace import Event
        from opentelemetry.trace import SpanKind

        assert record.upstream_sent_at is not None
        events = []
        if record.first_token_at is not None:
            ttft = {"firstbyte.ttft_ms": round(record.ttft_ms or 0.0, 3)}
            events.append(Event("first_token", ttft, ns(record.first_token_at)))
        events.append(Event("stream_end", {"firstbyte.outcome": record.outcome},
                            ns(record.ended_at)))  # fmt: skip
        address = (record.backend_url or "").split("://", 1)[-1].split("/", 1)[0]
        host, _, port = address.rpartition(":") if address.count(":") == 1 else (address, "", "")
        attributes = {
            "gen_ai.operation.name": _operation(record),
            "gen_ai.request.model": record.model,
            "server.address": host or None,
            "server.port": int(port) if port.isdigit() else None,
            "firstbyte.backend": record.backend,
            "firstbyte.upstream_error": record.upstream_error,
        }
        return span(
            "upstream", context(new_span_id()), parent, record.upstream_sent_at, record.ended_at,
            SpanKind.CLIENT, attributes, tuple(events), status,
        )  # fmt: skip

    async def aclose(self) -> None:
        """Export what is queued (bounded by the exporter's timeout) and stop the worker."""
        await asyncio.to_thread(self._processor.shutdown)
