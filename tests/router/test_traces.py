"""Traces arrive at an OTLP/HTTP receiver on loopback as the OTLP protobuf schema says.

The receiver is a plain HTTP server on 127.0.0.1 that decodes each POST with the official
``opentelemetry-proto`` classes (``ExportTraceServiceRequest``) and answers as a collector
does: what the router's exporter really sent, decoded with the real schema (the
OpenTelemetry Collector and Jaeger are Go binaries, not on PyPI).
"""

from __future__ import annotations

import contextlib
import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from firstbyte.router.sim.server import sim_server
from tests.router.conftest import RouterFactory, auth, client_tls

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"


class Receiver:
    """OTLP/HTTP trace receiver: ``POST /v1/traces`` with a protobuf body."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        self.content_types: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.requests.append(request)
                receiver.paths.append(self.path)
                receiver.content_types.append(self.headers.get("content-type", ""))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self) -> list[tuple[dict[str, Any], Span]]:
        """Every span received, with its resource's attributes."""
        out = []
        for request in self.requests:
            for resource_spans in request.resource_spans:
                resource = attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    out.extend((resource, span) for span in scope_spans.spans)
        return out


def _value(value: AnyValue) -> Any:
    return getattr(value, value.WhichOneof("value"))


def attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


@contextlib.contextmanager
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    thread = threading.Thread(target=r.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()


async def test_a_streamed_request_is_exported_as_a_genai_trace(
    start_router: RouterFactory, tls_files: dict[str, str]
) -> None:
    with receiver() as otlp:
        async with sim_server("instant", served_model_names=["m"]) as sim:
            telemetry = {"otlp_endpoint": otlp.url, "service_name": "router-under-test"}
            async with start_router([sim.url], telemetry=telemetry) as router:
                body = {"model": "m", "messages": [{"role": "user", "content": "trace me"}],
                        "max_tokens": 6, "stream": True}  # fmt: skip
                async with httpx.AsyncClient(verify=client_tls(tls_files), http2=True) as client:
                    sampled = await client.post(
                        router.base_url + "/v1/chat/completions",
                        json=body,
                        headers={**auth(), "traceparent": f"00-{TRACE_ID}-{CALLER}-01"},
                    )
                    assert sampled.text.endswith("data: [DONE]\n\n")
                    # The caller decided not to sample this one: nothing is exported for it.
                    unsampled = await client.post(
                        router.base_url + "/v1/chat/completions",
                        json=body,
                        headers={**auth(), "traceparent": f"00-{'1' * 32}-{CALLER}-00"},
                    )
                    assert unsampled.status_code == 200
                    # Operational requests (Prometheus' scrapes, peers' status polls, one a
                    # second each) are not traced, as they are logged at debug only.
                    scrape = await client.get(
                        router.base_url + "/metrics",
                        headers={**auth(), "traceparent": f"00-{'2' * 32}-{CALLER}-01"},
                    )
                    assert scrape.status_code == 200
            # Leaving the router flushes the exporter.
    assert set(otlp.paths) == {"/v1/traces"}
    assert set(otlp.content_types) == {"application/x-protobuf"}
    received = otlp.spans()
    assert {span.trace_id.hex() for _, span in received} == {TRACE_ID}
    resource = received[0][0]
    assert resource["service.name"] == "router-under-test"
    assert resource["firstbyte.region"] == "test-1"
    spans = {span.name: span for _, span in received}
    assert set(spans) == {"chat m", "admit", "route", "upstream"}

    request = spans["chat m"]
    router_span_id = sampled.headers["traceparent"].split("-")[2]
    assert request.span_id.hex() == router_span_id  # the id the router sent on and back
    assert request.parent_span_id.hex() == CALLER
    assert request.kind == Span.SPAN_KIND_SERVER
    attrs = attributes(request.attributes)
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.usage.output_tokens"] == 6
    assert attrs["gen_ai.response.model"]
    assert attrs["server.address"] == router.base_url.split("://")[1]
    assert attrs["firstbyte.region"] == "test-1"
    assert attrs["firstbyte.transport"] == "sse"
    assert attrs["firstbyte.backend"] == router.app.state.pool.backends[0].name
    assert attrs["firstbyte.outcome"] == "ok"
    assert attrs["http.response.status_code"] == 200
    assert attrs["firstbyte.ttft_ms"] > 0

    for name in ("admit", "route", "upstream"):
        child = spans[name]
        assert child.parent_span_id == request.span_id
        assert request.start_time_unix_nano <= child.start_time_unix_nano
        assert child.start_time_unix_nano <= child.end_time_unix_nano <= request.end_time_unix_nano
    assert spans["admit"].end_time_unix_nano <= spans["route"].start_time_unix_nano + 1000
    upstream = spans["upstream"]
    assert upstream.kind == Span.SPAN_KIND_CLIENT
    host, port = sim.url.split("://")[1].split(":")
    upstream_attrs = attributes(upstream.attributes)
    assert (upstream_attrs["server.address"], upstream_attrs["server.port"]) == (host, int(port))
    events = {event.name: event for event in upstream.events}
    assert set(events) == {"first_token", "stream_end"}
    first_token = events["first_token"].time_unix_nano
    assert upstream.start_time_unix_nano <= first_token <= events["stream_end"].time_unix_nano
    # The first-token event sits at the TTFT the span reports (to the rounding of the ms).
    ttft_ns = first_token - request.start_time_unix_nano
    assert abs(ttft_ns / 1e6 - attrs["firstbyte.ttft_ms"]) < 0.01
