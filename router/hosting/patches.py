"""Every patch of a third-party library's internals, in one list, applied in one order.

hypercorn, h2, h11, aioquic, uvicorn, httpx and httpcore lack defences and fixes the router
needs (:mod:`.hardening`, :mod:`.quic_hardening`, :mod:`.head_guards`, :mod:`.early_answers`,
:mod:`.accept`, :mod:`.http1_split`, :mod:`.graceful_cut`, :mod:`.h1_body`, :mod:`.goaway`,
:mod:`.quic`, :mod:`.servers`, :mod:`.send_timeout`, :mod:`.uvicorn_limits`, :mod:`.http10`,
:mod:`.uvicorn_send`, :mod:`firstbyte.router.aionet`), and each reaches into a library's
private classes.
:data:`PATCHES` lists them all: for each, the library, what it fixes, the shape of the library
it expects (attributes, parameters, text of a method's source that shows an instance attribute
it uses) and the function that applies it.

:func:`apply_all` checks every shape first and then applies the patches in the list's order
(the order matters: a later patch wraps what an earlier one installed, see each entry); a
library whose shape is not the expected one raises :class:`PatchShapeError` before anything
is patched, with one line naming the library, its installed version and the patch, and the
router refuses to start (``firstbyte router`` prints it and exits 2). Nothing else in the
router patches a library. docs/libraries.md says, per patch, the library bug it works around
as an upstream report would, so a patch can go when its library fixes the bug.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PATCHES",
    "Patch",
    "PatchShapeError",
    "Shape",
    "applied_except",
    "apply_all",
    "check",
]


class PatchShapeError(RuntimeError):
    """A library is not the shape one of :data:`PATCHES` expects (its message is one line)."""


@dataclass(frozen=True, slots=True)
class Shape:
    """What a patch expects of one class or module of a library."""

    owner: str
    """``"package.module:Class"`` (a class) or ``"package.module"`` (a module)."""
    names: tuple[str, ...] = ()
    """Attributes ``owner`` must have (methods, class attributes, module globals)."""
    params: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """``(method, names)``: the method's parameters must begin with ``names``."""
    source: tuple[tuple[str, str], ...] = ()
    """``(method, text)``: the method's source must contain ``text`` (an instance attribute
    the patch reads, which no ``hasattr`` on the class can see), or one of the alternatives
    ``"a | b"`` (an attribute a version renamed); ``""``: ``owner``'s."""

    @property
    def library(self) -> str:
        """The distribution that ships ``owner`` (its top-level package's name)."""
        return self.owner.partition(".")[0].partition(":")[0]


@dataclass(frozen=True, slots=True)
class Patch:
    """One patch of a library's internals."""

    name: str
    library: str
    """The distribution patched (the one whose bug or gap it is)."""
    fixes: str
    """What goes wrong without it, in a line (docs/libraries.md has the report)."""
    shapes: tuple[Shape, ...]
    replaces: tuple[tuple[str, str], ...]
    """``(owner, attribute)`` it sets: what :func:`applied_except` puts back."""
    apply: Callable[[], None]
    """Applies the patch; called once per process, after every shape was checked."""
    test: str
    """The test that fails without it (``tests/...::name``)."""


def _apply(module: str, function: str, *args: str) -> Callable[[], None]:
    """A patch function imported when applied (this module imports no library itself);
    ``args`` are modules passed to it."""

    def apply() -> None:
        target = getattr(importlib.import_module(f"{__package__}.{module}"), function)
        target(*(importlib.import_module(arg) for arg in args))

    return apply


def _nothing() -> None:
    """A check-only entry: the code that depends on the shape builds subclasses or sets an
    instance's attribute as it runs; only the shape is checked at start."""


_H11 = "hypercorn.protocol.h11:H11Protocol"
_H2 = "hypercorn.protocol.h2:H2Protocol"
_H3 = "hypercorn.protocol.h3:H3Protocol"
_QUIC = "hypercorn.protocol.quic:QuicProtocol"
_STREAM = "hypercorn.protocol.http_stream:HTTPStream"
_RUN = "hypercorn.asyncio.run"
_TCP = "hypercorn.asyncio.tcp_server:TCPServer"

PATCHES: tuple[Patch, ...] = (
    # Order: a later patch of the same method wraps the earlier ones (runs first). The head
    # bounds wrap h11 innermost; the body framing and the HTTP/1.1 split come last.
    Patch(
        "h2-reset-unfinished-streams",
        "hypercorn",
        "an HTTP/2 stream whose app failed mid-response is never ended (peer waits forever)",
        (
            Shape(_H2, ("_close_stream", "_flush"), (("_close_stream", ("self", "stream_id")),),
                  (("__init__", "self.stream_buffers"), ("__init__", "self.priority"),
                   ("__init__", "self.has_data"), ("__init__", "self.closed"))),
            Shape("hypercorn.protocol.h2:StreamBuffer", ("complete", "close")),
            Shape("h2.connection:H2Connection", ("reset_stream",)),
        ),
        ((_H2, "_close_stream"),),
        _apply("servers", "_reset_unfinished_h2_streams"),
        "tests/router/sim/test_http2.py::test_drop_over_http2_resets_only_that_stream",
    ),
    Patch(
        "quic-supervise-udp-server",
        "hypercorn",
        "one exception in the QUIC server task ends HTTP/3 for the life of the process",
        (
            Shape(_RUN, ("UDPServer",)),
            Shape("hypercorn.asyncio.udp_server:UDPServer", ("run", "connection_made"),
                  source=(("run", "self.protocol"), ("connection_made", "self.transport"),
                          ("__init__", "self.context"))),
        ),
        ((_RUN, "UDPServer"),),
        _apply("servers", "_supervise_quic_servers"),
        "tests/router/test_http3_restart.py::test_quic_server_end_is_logged_unadvertised_and_restarted",
    ),
    Patch(
        "h11-head-bounds",
        "hypercorn",
        "an HTTP/1.1 request head is buffered whole before any bound applies",
        (
            Shape(_H11, ("handle", "_create_stream"),
                  source=(("__init__", "self.stream"), ("__init__", "self.connection"),
                          ("__init__", "self.task_group"), ("__init__", "self.send"))),
            Shape("h11:Connection", ("trailing_data",)),
        ),
        ((_H11, "handle"), (_H11, "_create_stream")),
        _apply("head_guards", "bound_h11_heads"),
        "tests/router/attacks/test_heads.py::test_http1_head_over_a_bound_is_refused_and_closed[hypercorn]",
    ),
    Patch(
        "h2-h3-decoded-head-bounds",
        "hypercorn",
        "an HTTP/2 or HTTP/3 head over the router's bounds reaches the app",
        (
            Shape(_STREAM, ("handle",), source=(("handle", "self.app_put"),)),
            Shape("hypercorn.protocol.http_stream:ASGIHTTPState", ("CLOSED", "RESPONSE")),
        ),
        ((_STREAM, "handle"),),
        _apply("head_guards", "bound_decoded_heads"),
        "tests/router/attacks/test_heads.py::test_http2_head_over_a_bound_is_refused_on_its_stream",
    ),
    Patch(
        "h2-reset-streams-answered-early",
        "hypercorn",
        "a client whose request was answered before its body's end keeps sending the body",
        (
            Shape(_H2, ("_close_stream", "_flush")),
            Shape("h2.stream:StreamState", ("HALF_CLOSED_LOCAL",)),
        ),
        ((_H2, "_close_stream"),),
        _apply("early_answers", "reset_h2_streams_answered_early"),
        "tests/router/attacks/test_heads.py::test_http2_refused_head_with_a_body_coming_is_reset_after_its_431",
    ),
    Patch(
        "tcp-refused-connections-and-idle-close",
        "hypercorn",
        "a connection refused at accept gets no answer; a closed client holds its socket for"
        " the keep-alive timeout",
        (
            Shape(_RUN, ("TCPServer",)),
            Shape(_TCP, ("run", "_read_data"),
                  source=(("__init__", "self.reader"), ("__init__", "self.writer"),
                          ("__init__", "self.idle_task"))),
        ),
        ((_RUN, "TCPServer"),),
        _apply("hardening", "_guard_connections", _RUN),
        "tests/router/hosting/test_accept.py::test_refused_connection_reads_a_503_answer_to_its_request[hypercorn],"
        " tests/router/hosting/test_patches.py::test_a_closed_client_frees_its_socket_at_once",
    ),
    Patch(
        "h11-head-timeout",
        "hypercorn",
        "a slowloris client holds an HTTP/1.1 connection by sending a head byte by byte",
        (Shape(_H11, ("handle", "_create_stream"),
               source=(("__init__", "self.client"), ("__init__", "self.send"))),),
        ((_H11, "handle"), (_H11, "_create_stream")),
        _apply("hardening", "_time_request_heads"),
        "tests/router/attacks/test_http1.py::test_slowloris_head_is_cut_at_the_header_timeout[hypercorn]",
    ),
    Patch(
        "h2-header-block-timeout",
        "hypercorn",
        "an HTTP/2 header block never finished holds its connection until the keep-alive"
        " timeout (for ever while another stream is open)",
        (
            Shape(_H2, ("handle",), (("handle", ("self", "event")),),
                  (("__init__", "self.connection"), ("__init__", "self.client"),
                   ("__init__", "self.closed"), ("__init__", "self.send"))),
            Shape("h2.connection:H2Connection", ("close_connection",),
                  source=(("__init__", "self.incoming_buffer"),)),
            Shape("h2.frame_buffer:FrameBuffer",
                  source=(("__init__", "self._headers_buffer"),
                          ("__init__", "self._data | self.data"))),
        ),
        ((_H2, "handle"),),
        _apply("hardening", "_time_h2_header_blocks"),
        "tests/router/attacks/test_http2.py::"
        "test_an_unfinished_header_block_is_cut_at_the_header_timeout",
    ),
    Patch(
        "h2-stream-send-timeout",
        "hypercorn",
        "an HTTP/2 stream whose client never opens its flow-control window waits for ever,"
        " holding its app, its upstream request and its key's slot",
        (
            Shape(_H2, ("_send_data", "_flush", "_close_stream"),
                  (("_send_data", ("self", "stream_id")),),
                  (("__init__", "self.stream_buffers"), ("__init__", "self.priority"),
                   ("__init__", "self.has_data"), ("__init__", "self.closed"),
                   ("__init__", "self.connection"), ("__init__", "self.client"),
                   ("__init__", "self.config"),
                   # The chunk a visit takes, which the patch works out before it.
                   ("_send_data", "self.connection.local_flow_control_window(stream_id)"),
                   ("_send_data", "self.connection.max_outbound_frame_size"),
                   ("_send_data", ".pop(chunk_size)"))),
            Shape("hypercorn.protocol.h2:StreamBuffer", ("close", "pop"),
                  source=(("__init__", "self.buffer"),)),
            Shape("h2.connection:H2Connection", ("local_flow_control_window", "reset_stream"),
                  source=(("__init__", "self.max_outbound_frame_size"),)),
        ),
        ((_H2, "_send_data"),),
        _apply("send_timeout", "time_h2_stream_windows"),
        "tests/router/attacks/test_http2.py::"
        "test_a_stream_whose_window_stays_shut_is_reset_and_its_slot_freed",
    ),
    Patch(
        "h11-ambiguous-framing",
        "hypercorn",
        "a request with Content-Length and Transfer-Encoding is served (request smuggling)",
        (Shape(_H11, ("_create_stream", "_send_error_response")),),
        ((_H11, "_create_stream"),),
        _apply("hardening", "_reject_ambiguous_framing"),
        "tests/router/attacks/test_http1.py::test_content_length_with_transfer_encoding_is_refused_and_closed[hypercorn]",
    ),
    Patch(
        "discard-unread-bodies",
        "hypercorn",
        "a body its app answered without reading fills the app queue and stalls the connection",
        (
            Shape(_STREAM, ("handle", "app_send"),
                  source=(("handle", "self.app_put"), ("__init__", "self.config"))),
            Shape("hypercorn.protocol.events:EndBody"),
        ),
        ((_STREAM, "handle"), (_STREAM, "app_send")),
        _apply("hardening", "_discard_unread_bodies"),
        "tests/router/attacks/test_http1.py::test_a_body_sent_after_its_answer_is_dropped_not_run[hypercorn]",
    ),
    Patch(
        "h2-data-after-answer-and-rapid-reset",
        "hypercorn",
        "DATA for an answered HTTP/2 stream raises KeyError; rapid reset is unbounded",
        (
            Shape(_H2, ("_handle_events", "_flush"),
                  (("_handle_events", ("self", "events")),),
                  (("__init__", "self.streams"), ("__init__", "self.connection"))),
            Shape("h2.connection:H2Connection",
                  ("increment_flow_control_window", "reset_stream", "close_connection")),
        ),
        ((_H2, "_handle_events"),),
        _apply("hardening", "_close_finished_h2_streams"),
        "tests/router/attacks/test_http2.py::test_answer_before_the_body_keeps_the_connection,"
        " test_rapid_reset_gets_goaway_and_upstream_work_is_bounded",
    ),
    Patch(
        "h2-refuse-streams-past-the-limit",
        "h2",
        "a stream past SETTINGS_MAX_CONCURRENT_STREAMS takes its whole connection down",
        (
            Shape("h2.connection:H2Connection", ("_receive_headers_frame",),
                  (("_receive_headers_frame", ("self", "frame")),),
                  (("__init__", "self.highest_inbound_stream_id"),
                   ("__init__", "self._closed_streams"), ("__init__", "self.decoder"),
                   ("_receive_headers_frame", "TooManyStreamsError"))),
            Shape("h2.connection", ("_decode_headers",)),
            Shape("h2.stream:StreamClosedBy", ("SEND_RST_STREAM",)),
            Shape("hyperframe.frame:RstStreamFrame"),
        ),
        (("h2.connection:H2Connection", "_receive_headers_frame"),),
        _apply("hardening", "_refuse_streams_past_the_limit"),
        "tests/router/attacks/test_http2.py::"
        "test_a_stream_past_the_limit_is_refused_alone_not_the_connection",
    ),
    Patch(
        "websocket-frame-bounds",
        "hypercorn",
        "an oversized WebSocket message is buffered whole; a closing socket's queue deadlocks",
        (
            Shape("hypercorn.protocol.ws_stream:WSStream", ("handle", "_send_wsproto_event"),
                  source=(("__init__", "self.closed"), ("__init__", "self.task_group"),
                          ("handle", "self.handshake"), ("handle", "self.app_put"))),
            Shape("wsproto.frame_protocol:CloseReason", ("MESSAGE_TOO_BIG",)),
        ),
        (("hypercorn.protocol.ws_stream:WSStream", "handle"),),
        _apply("hardening", "_guard_websocket_frames"),
        "tests/router/attacks/test_websocket.py::test_oversized_frame_closed_at_its_header[hypercorn],"
        " test_client_leaving_with_65_streams_is_let_go[hypercorn]",
    ),
    Patch(
        "h3-late-data",
        "hypercorn",
        "DATA for an answered HTTP/3 stream raises KeyError and ends the QUIC server",
        (
            Shape(_H3, ("handle", "_create_stream"),
                  source=(("handle", "self.connection.handle_event"),
                          ("__init__", "self.streams"))),
            Shape("aioquic.quic.connection:QuicConnection", ("stop_stream",),
                  source=(("__init__", "self._streams"),)),
        ),
        ((_H3, "handle"),),
        _apply("quic_hardening", "drop_late_h3_data"),
        "tests/router/attacks/test_http3.py::test_early_answer_leaves_http3_serving",
    ),
    Patch(
        "quic-connection-guard",
        "hypercorn",
        "QUIC connections are unbounded per address, never idle while PINGed, and never Retried",
        (
            Shape(_QUIC, ("handle", "_handle_events", "send_all"),
                  (("_handle_events", ("self", "connection", "client")),),
                  (("__init__", "self.connections"), ("__init__", "self.quic_config"))),
            Shape("hypercorn.protocol.quic", ("_Connection", "QuicConnection")),
            Shape(_H3, ("stream_send",)),
            Shape("aioquic.quic.retry:QuicRetryTokenHandler", ("create_token", "validate_token")),
            Shape("aioquic.quic.packet", ("encode_quic_retry", "pull_quic_header")),
            Shape("aioquic.quic.packet_builder:QuicPacketBuilder", ("start_packet", "flush")),
        ),
        ((_QUIC, "handle"), (_QUIC, "_handle_events"), (_H3, "stream_send")),
        _apply("quic_hardening", "guard_quic_connections"),
        "tests/router/attacks/test_http3.py::test_connection_that_only_pings_is_closed,"
        " test_connections_from_one_address_are_capped, test_handshake_flood_gets_retry",
    ),
    Patch(
        "count-at-accept",
        "hypercorn",
        "hypercorn's TLS handshake runs before it sees a connection: no count, no early refusal",
        (Shape(_RUN, ("asyncio",), source=(("", "asyncio.start_server("),)),),
        ((_RUN, "asyncio"),),
        _apply("accept", "count_at_accept"),
        "tests/router/hosting/test_accept.py::"
        "test_silent_tcp_sockets_count_from_accept_and_close_at_the_header_timeout[hypercorn]",
    ),
    Patch(
        "h11-direct-chunk-framing",
        "hypercorn",
        "every streamed HTTP/1.1 chunk goes through h11's state machine (twice uvicorn's CPU)",
        (
            Shape(_STREAM, ("app_send",),
                  source=(("__init__", "self.state"), ("__init__", "self.send"))),
            Shape("h11._writers:ChunkedWriter"),
            Shape("h11:Connection", ("our_state",), source=(("__init__", "self._writer"),)),
        ),
        ((_STREAM, "app_send"),),
        _apply("h1_body", "frame_h1_bodies_directly"),
        "tests/router/test_h1_body.py::test_streamed_chunks_are_h11_bytes_without_h11",
    ),
    Patch(
        "http1-split-to-uvicorn",
        "hypercorn",
        "(a feature) HTTP/1.1 connections handed from hypercorn to uvicorn's protocol",
        (
            Shape(_RUN, ("TCPServer",)),
            Shape(_TCP, ("run",), source=(("__init__", "self.state"),
                                          ("__init__", "self.context"))),
            Shape("uvicorn.server:ServerState"),
            Shape("uvicorn.config:Config", ("load",),
                  source=(("load", "self.http_protocol_class"), ("__init__", "self.headers"))),
        ),
        ((_RUN, "TCPServer"),),
        _apply("http1_split", "split_http1"),
        "tests/router/test_http1_split.py",
    ),
    Patch(
        "cut-connections-at-graceful-timeout",
        "hypercorn",
        "a kept-alive TLS client outlives the graceful timeout by 30 s, then serve() raises"
        " InvalidStateError (and Python 3.11.7 logs a traceback per connection); a TLS goodbye"
        " never answered ends a connection's task with a traceback",
        (
            Shape(_RUN, ("TCPServer",)),
            Shape(_TCP, ("run", "_close"), source=(("__init__", "self.writer"),)),
        ),
        ((_RUN, "TCPServer"),),
        _apply("graceful_cut", "cut_at_graceful_timeout"),
        "tests/router/hosting/test_shutdown.py",
    ),
    Patch(
        "goaway-before-shutdown",
        "hypercorn",
        "hypercorn sends HTTP/2 GOAWAY only once shut down, and never an HTTP/3 one",
        (
            Shape(_H2, ("__init__", "stream_send", "_flush"),
                  source=(("__init__", "self.config"), ("__init__", "self.closed"))),
            Shape(_H3, ("__init__",),
                  source=(("__init__", "self.send"), ("__init__", "self.connection"))),
            Shape("aioquic.h3.connection:H3Connection",
                  source=(("__init__", "self._local_control_stream_id"),
                          ("__init__", "self._quic"))),
            Shape("aioquic.quic.connection:QuicConnection",
                  source=(("__init__", "self._close_event"),)),
        ),
        ((_H2, "__init__"), (_H2, "stream_send"), (_H3, "__init__")),
        _apply("goaway", "track_connections"),
        "tests/router/operate/test_drain.py::test_sigterm_refuses_new_work_sends_goaway_and_finishes_the_stream,"
        " test_http3_gets_goaway_at_once_and_its_stream_finishes,"
        " test_connections_their_clients_closed_are_not_told_nor_counted",
    ),
    Patch(
        "h2-goaway-at-idle-close",
        "hypercorn",
        "an HTTP/2 connection closed at the keep-alive timeout gets no GOAWAY: a request that"
        " crossed the close is reset, and its client cannot tell whether it was processed",
        (
            Shape(_RUN, ("TCPServer",)),
            Shape(_TCP, ("_initiate_server_close", "_idle_timeout"),
                  source=(("_idle_timeout", "self._initiate_server_close()"),
                          ("run", "self.protocol"))),
            Shape("hypercorn.protocol:ProtocolWrapper", source=(("__init__", "self.protocol"),)),
            Shape(_H2, ("_flush",), source=(("__init__", "self.connection"),
                                            ("__init__", "self.closed"))),
            Shape("h2.connection:H2Connection", ("close_connection",),
                  (("close_connection", ("self", "error_code")),),
                  (("__init__", "self.state_machine"),
                   ("__init__", "self.highest_inbound_stream_id"))),
            Shape("h2.connection:H2ConnectionStateMachine", source=(("__init__", "self.state"),)),
            Shape("h2.connection:ConnectionState", ("CLOSED",)),
        ),
        ((_RUN, "TCPServer"),),
        _apply("goaway", "goaway_at_idle_close"),
        "tests/router/attacks/test_http2.py::"
        "test_an_idle_connection_gets_goaway_with_its_last_stream_before_the_close",
    ),
    Patch(
        "quic-session-tickets",
        "hypercorn",
        "hypercorn's QUIC connections get no session ticket store: no resumption, no 0-RTT",
        (
            Shape("hypercorn.protocol.quic", ("QuicProtocol", "QuicConnection")),
            Shape(_QUIC, source=(("__init__", "self.quic_config"),)),
            Shape("aioquic.quic.connection:QuicConnection", (),
                  source=(("__init__", "session_ticket_fetcher"),
                          ("__init__", "session_ticket_handler"))),
        ),
        (("hypercorn.protocol.quic", "QuicProtocol"),
         ("hypercorn.protocol.quic", "QuicConnection")),
        _apply("quic", "enable_session_tickets"),
        "tests/router/test_transports.py::test_http3_matches_the_sim_and_resumes_with_0rtt",
    ),
    Patch(
        "uvicorn-guarded-protocols",
        "uvicorn",
        "(subclasses) uvicorn has no per-client cap, head clock or descriptor reserve",
        (
            Shape("uvicorn.protocols.http.httptools_impl:HttpToolsProtocol",
                  ("connection_made", "connection_lost", "data_received", "on_message_begin",
                   "on_headers_complete", "on_message_complete", "on_response_complete",
                   "handle_websocket_upgrade", "shutdown"),
                  source=(("__init__", "self.timeout_keep_alive_task"), ("__init__", "self.cycle"),
                          ("__init__", "self.pipeline"))),
            Shape("uvicorn.protocols.websockets.websockets_sansio_impl:WebSocketsSansIOProtocol",
                  ("connection_lost", "data_received", "send_receive_event_to_app",
                   "handle_parser_exception", "shutdown"),
                  source=(("__init__", "self.queue"), ("__init__", "self.close_sent"),
                          ("__init__", "self.conn"), ("__init__", "self.frames"),
                          ("__init__", "self.close_timer"),
                          ("run_asgi", "if self.close_timer is None"),
                          ("send_receive_event_to_app", "self.curr_msg_data_type"))),
        ),
        (),
        _nothing,
        "tests/router/attacks/ (the uvicorn and auto cases), tests/router/hosting/test_accept.py",
    ),
    Patch(
        "uvicorn-body-writer",
        "uvicorn",
        "(a feature) uvicorn's ASGI send is the only way to write a body part; the"
        " firstbyte.body_writer extension (body_writer.py) writes one from a callback;"
        " the compiled SSE writer (router/_chunkpath.c) reads the same fields",
        (
            Shape("uvicorn.protocols.http.httptools_impl:RequestResponseCycle",
                  source=(("__init__", "self.transport"), ("__init__", "self.flow"),
                          ("__init__", "self.disconnected"),
                          ("__init__", "self.chunked_encoding"),
                          ("__init__", "self.response_complete"))),
            Shape("uvicorn.protocols.http.flow_control:FlowControl",
                  source=(("__init__", "self.write_paused"),)),
        ),
        (),
        _nothing,
        "tests/router/test_direct_relay.py::test_http1_stream_is_written_directly_and_whole",
    ),
    Patch(
        "uvicorn-http10-close-delimited",
        "uvicorn",
        "a streamed answer to an HTTP/1.0 request is sent chunked, which HTTP/1.0 has not;"
        " http10.py gives a 1.0 request's cycle a send that delimits it by the close",
        (
            Shape("uvicorn.protocols.http.httptools_impl:RequestResponseCycle",
                  ("send", "run_asgi"),
                  source=(("run_asgi", "self.send"),
                          ("send", "self.chunked_encoding is None"),
                          ("send", "self.expected_content_length -= num_bytes"),
                          ("send", "if not self.keep_alive"),
                          ("__init__", "self.response_started"),
                          ("__init__", "self.default_headers"))),
        ),
        (),
        _nothing,
        "tests/router/test_http10.py::"
        "test_a_stream_reaches_an_http10_client_as_its_bytes_until_the_close,"
        " tests/router/test_transports.py::test_curl_http10_reads_the_events_unchunked",
    ),
    Patch(
        "uvicorn-h1-send",
        "uvicorn",
        "(CPU) uvicorn's send runs two regular expressions and a lower() per header of every"
        " response head; uvicorn_send.py gives an HTTP/1.1 request's cycle a send that"
        " does what it does in fewer steps, and falls back to it for anything else; it"
        " takes a body's first part with the head, one write (firstbyte.head_body)",
        (
            Shape("uvicorn.protocols.http.httptools_impl",
                  ("HEADER_RE", "HEADER_VALUE_RE", "STATUS_LINE"),
                  # One class of single characters: a value passes it exactly when deleting
                  # the bytes it matches leaves the value whole (uvicorn_send._REFUSED).
                  source=(("", 'HEADER_VALUE_RE = re.compile(b"[\\x00-\\x08\\x0a-\\x1f\\x7f]")'),)),
            Shape("uvicorn.protocols.http.httptools_impl:RequestResponseCycle",
                  ("send", "run_asgi"),
                  source=(("run_asgi", "self.send"),
                          ("__init__", "self.access_log"), ("__init__", "self.keep_alive"),
                          ("__init__", "self.default_headers"),
                          ("__init__", "self.message_event"), ("__init__", "self.on_response"),
                          ("__init__", "self.waiting_for_100_continue"),
                          ("__init__", "self.expected_content_length"),
                          ("send", "if self.flow.write_paused and not self.disconnected"),
                          ("send", "self.response_started = True"),
                          ("send", "self.waiting_for_100_continue = False"),
                          ("send", 'self.default_headers + list(message.get("headers", []))'),
                          ("send", "if self.access_log:"),
                          ("send", "content = [STATUS_LINE[status_code]]"),
                          ("send", "if HEADER_RE.search(name):"),
                          ("send", "if HEADER_VALUE_RE.search(value):"),
                          ("send", "name = name.lower()"),
                          ("send", 'content.extend([name, b": ", value, b"\\r\\n"])'),
                          ("send", 'content.append(b"connection: close\\r\\n")'),
                          ("send", "status_code not in (204, 304)"),
                          ("send", 'content.append(b"transfer-encoding: chunked\\r\\n")'),
                          ("send", 'content = [b"%x\\r\\n" % len(body), body, b"\\r\\n"]'),
                          ("send", 'content.append(b"0\\r\\n\\r\\n")'),
                          ("send", "self.response_complete = True"),
                          ("send", "self.message_event.set()"),
                          ("send", "self.on_response()"))),
        ),
        (),
        _nothing,
        "tests/router/hosting/test_uvicorn_send.py::"
        "test_the_routers_streamed_answer_never_falls_back_to_uvicorns_send",
    ),
    Patch(
        "uvicorn-h1-in-line",
        "uvicorn",
        "(CPU) each request made and cancelled a keep-alive timer (~8k instructions), made"
        " its request cycle with a keyword call (~4k) and ran uvicorn's callbacks one call"
        " below the router's; uvicorn_limits.py's protocol does what uvicorn's data_received,"
        " on_message_begin, on_headers_complete (with _start_asgi_task), on_message_complete"
        " and on_response_complete do, in line, with one keep-alive timer kept across"
        " requests that closes an idle connection at the same time; its cycles' receive"
        " takes a message already here without their event's wait() and clear() (~3k)",
        (
            Shape("uvicorn.protocols.http.httptools_impl:HttpToolsProtocol",
                  ("_unset_keepalive_if_required", "timeout_keep_alive_handler",
                   "send_400_response", "_should_upgrade", "_unsupported_upgrade_warning",
                   "_start_asgi_task", "on_message_begin", "on_headers_complete",
                   "on_message_complete"),
                  source=(("__init__", "self.timeout_keep_alive = config.timeout_keep_alive"),
                          ("__init__", "self.server_state = server_state"),
                          ("__init__", "self.parser = httptools.HttpRequestParser(self)"),
                          ("__init__", "self.asgi_version = config.asgi_version"),
                          ("__init__", "self.root_path = config.root_path"),
                          ("__init__", "self.limit_concurrency = config.limit_concurrency"),
                          ("__init__", "self.app_state = app_state"),
                          ("__init__", "self.app = config.loaded_app"),
                          ("__init__", "self.tasks = server_state.tasks"),
                          ("__init__", "self.connections = server_state.connections"),
                          ("__init__", "self.access_log = "),
                          ("on_message_begin", 'self.url = b""'),
                          ("on_message_begin", "self.expect_100_continue = False"),
                          ("on_message_begin", "self.headers = []"),
                          ("on_message_begin", '"type": "http",'),
                          ("on_message_begin",
                           '"asgi": {"version": self.asgi_version, "spec_version": "2.3"},'),
                          ("on_message_begin", '"http_version": "1.1",'),
                          ("on_message_begin", '"server": self.server,'),
                          ("on_message_begin", '"client": self.client,'),
                          ("on_message_begin", '"scheme": self.scheme,'),
                          ("on_message_begin", '"root_path": self.root_path,'),
                          ("on_message_begin", '"headers": self.headers,'),
                          ("on_message_begin", '"state": self.app_state.copy(),'),
                          ("on_headers_complete", "http_version = self.parser.get_http_version()"),
                          ("on_headers_complete", "method = self.parser.get_method()"),
                          ("on_headers_complete", 'self.scope["method"] = method.decode("ascii")'),
                          ("on_headers_complete", 'if http_version != "1.1":'),
                          ("on_headers_complete", 'self.scope["http_version"] = http_version'),
                          ("on_headers_complete",
                           "if self.parser.should_upgrade() and self._should_upgrade():"),
                          ("on_headers_complete", "parsed_url = httptools.parse_url(self.url)"),
                          ("on_headers_complete", "raw_path = parsed_url.path"),
                          ("on_headers_complete", 'path = raw_path.decode("ascii")'),
                          ("on_headers_complete", "path = urllib.parse.unquote(path)"),
                          ("on_headers_complete", "full_path = self.root_path + path"),
                          ("on_headers_complete",
                           'full_raw_path = self.root_path.encode("ascii") + raw_path'),
                          ("on_headers_complete",
                           'self.scope["query_string"] = parsed_url.query or b""'),
                          ("on_headers_complete",
                           "len(self.connections) >= self.limit_concurrency"),
                          ("on_headers_complete", "len(self.tasks) >= self.limit_concurrency"),
                          ("on_headers_complete", "app = service_unavailable"),
                          ("on_headers_complete", 'message = "Exceeded concurrency limit."'),
                          ("on_headers_complete", "self.cycle = RequestResponseCycle("),
                          ("on_headers_complete", "scope=self.scope,"),
                          ("on_headers_complete", "transport=self.transport,"),
                          ("on_headers_complete", "flow=self.flow,"),
                          ("on_headers_complete", "logger=self.logger,"),
                          ("on_headers_complete", "access_logger=self.access_logger,"),
                          ("on_headers_complete", "access_log=self.access_log,"),
                          ("on_headers_complete",
                           "default_headers=self.server_state.default_headers,"),
                          ("on_headers_complete", "message_event=asyncio.Event(),"),
                          ("on_headers_complete",
                           "expect_100_continue=self.expect_100_continue,"),
                          ("on_headers_complete",
                           'keep_alive=http_version != "1.0" and self.parser.should_keep_alive(),'),
                          ("on_headers_complete", "on_response=self.on_response_complete,"),
                          ("on_headers_complete",
                           "if existing_cycle is None or existing_cycle.response_complete:"),
                          ("on_headers_complete", "self._start_asgi_task(self.cycle, app)"),
                          ("on_headers_complete", "self.flow.pause_reading()"),
                          ("on_headers_complete", "self.pipeline.appendleft((self.cycle, app))"),
                          ("_start_asgi_task", "if self.config.reset_contextvars:"),
                          ("_start_asgi_task", "context=contextvars.Context()"),
                          ("_start_asgi_task", "task = self.loop.create_task(cycle.run_asgi(app))"),
                          ("_start_asgi_task", "task.add_done_callback(self.tasks.discard)"),
                          ("_start_asgi_task", "self.tasks.add(task)"),
                          ("on_message_complete",
                           "if (self.parser.should_upgrade() and self._should_upgrade())"
                           " or self.cycle.response_complete:"),
                          ("on_message_complete", "self.cycle.more_body = False"),
                          ("on_message_complete", "self.cycle.message_event.set()"),
                          ("data_received", "self._unset_keepalive_if_required()"),
                          ("data_received", "self.parser.feed_data(data)"),
                          ("data_received", "except httptools.HttpParserError:"),
                          ("data_received", 'msg = "Invalid HTTP request received."'),
                          ("data_received", "self.logger.warning(msg)"),
                          ("data_received", "self.send_400_response(msg)"),
                          ("data_received", "except httptools.HttpParserUpgrade:"),
                          ("data_received", "if self._should_upgrade():"),
                          ("data_received", "self.handle_websocket_upgrade()"),
                          ("data_received", "self._unsupported_upgrade_warning()"),
                          ("on_response_complete", "self.server_state.total_requests += 1"),
                          ("on_response_complete", "if self.transport.is_closing():"),
                          ("on_response_complete", "self._unset_keepalive_if_required()"),
                          ("on_response_complete", "self.flow.resume_reading()"),
                          ("on_response_complete", "cycle, app = self.pipeline.pop()"),
                          ("on_response_complete", "self._start_asgi_task(cycle, app)"),
                          ("on_response_complete",
                           "self.timeout_keep_alive, self.timeout_keep_alive_handler"),
                          ("_unset_keepalive_if_required", "self.timeout_keep_alive_task.cancel()"),
                          ("timeout_keep_alive_handler", "self.transport.close()"))),
            Shape("uvicorn.protocols.http.httptools_impl:RequestResponseCycle",
                  ("run_asgi", "receive"),
                  (("__init__", ("self", "scope", "transport", "flow", "logger",
                                 "access_logger", "access_log", "default_headers",
                                 "message_event", "expect_100_continue", "keep_alive",
                                 "on_response")),),
                  # ReceivingCycle.receive: uvicorn's where its event's wait() would not wait
                  source=(("__init__", "self.body = bytearray()"),
                          ("__init__", "self.more_body = True"),
                          ("receive", "if self.waiting_for_100_continue"),
                          ("receive",
                           "if not self.disconnected and not self.response_complete:"),
                          ("receive", "self.flow.resume_reading()"),
                          ("receive", "await self.message_event.wait()"),
                          ("receive", "self.message_event.clear()"),
                          ("receive", "if self.disconnected or self.response_complete:"),
                          ("receive", 'return {"type": "http.disconnect"}'),
                          ("receive", '{"type": "http.request", "body": bytes(self.body),'
                                      ' "more_body": self.more_body}'),
                          ("receive", "self.body = bytearray()"))),
            Shape("uvicorn.protocols.http.flow_control:FlowControl", ("resume_reading",),
                  source=(("__init__", "self.read_paused"),
                          ("resume_reading", "if self.read_paused:"))),
            Shape("uvicorn.protocols.http.flow_control", ("service_unavailable",)),
            Shape("httptools", ("HttpParserError", "HttpParserUpgrade", "parse_url")),
        ),
        (),
        _nothing,
        "tests/router/hosting/test_keep_alive.py::"
        "test_one_keep_alive_timer_serves_every_request_of_a_connection,"
        " tests/router/hosting/test_uvicorn_in_line.py",
    ),
    Patch(
        "uvicorn-disconnected",
        "uvicorn",
        "(a feature) an ASGI app learns of a client's disconnect only from receive(), so a"
        " task waits there for every streamed request; the firstbyte.disconnected future"
        " (disconnected.py) is resolved from the protocol's connection_lost instead",
        (
            Shape("uvicorn.protocols.http.httptools_impl:RequestResponseCycle",
                  source=(("__init__", "self.response_complete"),)),
        ),
        (),
        _nothing,
        "tests/router/test_direct_relay.py::test_a_streamed_response_costs_no_task_of_the_router",
    ),
    Patch(
        "httpcore-asyncio-backend",
        "httpx",
        "(a feature) httpx has no public switch for httpcore's network backend",
        (
            Shape("httpx:AsyncClient", source=(("__init__", "self._transport"),)),
            Shape("httpx:AsyncHTTPTransport", source=(("__init__", "self._pool"),)),
            Shape("httpcore:AsyncConnectionPool",
                  source=(("__init__", "self._network_backend"),)),
            Shape("httpcore:AsyncNetworkStream",
                  ("read", "write", "aclose", "start_tls", "get_extra_info")),
        ),
        (),
        _nothing,
        "tests/router/test_aionet.py",
    ),
)

_MISSING = object()
_lock = threading.Lock()
_applied: tuple[str, ...] | None = None
"""The names applied in this process, in order (None: not yet)."""
_originals: dict[tuple[str, str], Any] = {}
"""What each patched attribute was before the first patch (for :func:`applied_except`)."""
_installed: dict[tuple[str, str], Any] = {}
"""What the patches set each attribute to (a shape is checked on the library's own)."""


def _resolve(owner: str) -> Any:
    module, _, qualname = owner.partition(":")
    target: Any = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        target = getattr(target, part)
    return target


def _library_own(key: tuple[str, str], live: Any) -> Any:
    """``live`` (``key``'s attribute now), or the library's own if a patch installed it."""
    installed = _installed.get(key, _MISSING)
    if installed is not _MISSING and installed is live:
        original = _originals.get(key, _MISSING)
        return None if original is _MISSING else original
    return live


def _resolve_library_own(owner: str) -> Any:
    """:func:`_resolve`, through the library's own objects where a patch replaced one."""
    module, _, qualname = owner.partition(":")
    target: Any = importlib.import_module(module)
    path = module
    for part in qualname.split(".") if qualname else ():
        target = _library_own((path, part), getattr(target, part))
        path = f"{path}.{part}" if ":" in path else f"{path}:{part}"
    return target


def _version(library: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(library)
    except PackageNotFoundError:
        return "(not installed)"


def _declared(library: str) -> str:
    """The range pyproject.toml declares for ``library`` (from the installed metadata)."""
    import re
    from importlib.metadata import PackageNotFoundError, requires

    try:
        requirements = requires("firstbyte") or []
    except PackageNotFoundError:
        return ""
    for requirement in requirements:
        name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]
        if name.lower() == library.lower():
            return requirement.partition(";")[0].strip()
    return ""


def _mismatch(shape: Shape) -> str | None:
    """What of ``shape`` the installed library lacks, or None if it has it all."""
    try:
        owner = _resolve_library_own(shape.owner)
    except ModuleNotFoundError:
        # The library itself not installed is an extra missing, which the command line reports
        # as such (firstbyte/cli.py), not a library of another shape: importing it raises so.
        importlib.import_module(shape.library)
        return f"{shape.owner.replace(':', '.')} does not exist"
    except (ImportError, AttributeError):
        return f"{shape.owner.replace(':', '.')} does not exist"
    where = shape.owner.replace(":", ".")
    missing = [name for name in shape.names if not hasattr(owner, name)]
    if missing:
        return f"{where} has no {', '.join(missing)}"

    def own(name: str) -> Any:
        # Once applied, a patched method is checked as the library has it, not our wrapper.
        return _library_own((shape.owner, name), getattr(owner, name))

    for method, expected in shape.params:
        try:
            params = tuple(inspect.signature(own(method)).parameters)
        except (TypeError, ValueError, AttributeError):
            params = ()
        if params[: len(expected)] != expected:
            return f"{where}.{method} takes ({', '.join(params)}), not ({', '.join(expected)}, ...)"
    for attribute, text in shape.source:
        try:
            code = inspect.getsource(own(attribute) if attribute else owner)
        except (AttributeError, OSError, TypeError):
            code = ""
        if not any(one in code for one in text.split(" | ")):
            place = f"{where}.{attribute}" if attribute else where
            return f"{place} no longer has {text!r}"
    return None


def check(patches: tuple[Patch, ...] = PATCHES) -> None:
    """Raise :class:`PatchShapeError` (one line) for the first patch whose library is not the
    shape it expects; the library itself is not changed."""
    for patch in patches:
        for shape in patch.shapes:
            problem = _mismatch(shape)
            if problem is not None:
                declared = _declared(shape.library)
                raise PatchShapeError(
                    f"{shape.library} {_version(shape.library)} is not what patch"
                    f" {patch.name!r} expects: {problem}"
                    f"{f' (the router supports {declared})' if declared else ''};"
                    " see router/hosting/patches.py and docs/libraries.md"
                )


def apply_all() -> None:
    """Check every patch's shape, then apply them all in order, once per process
    (:class:`PatchShapeError` before anything is applied if a shape is wrong)."""
    with _lock:
        if _applied is None:
            _apply_in_order(PATCHES)


def _apply_in_order(patches: tuple[Patch, ...]) -> None:
    global _applied
    check(patches)
    if not _originals:
        for patch in PATCHES:
            for owner, attribute in patch.replaces:
                _originals.setdefault(
                    (owner, attribute), vars(_resolve(owner)).get(attribute, _MISSING)
                )
    for patch in patches:
        patch.apply()
        for owner, attribute in patch.replaces:
            _installed[(owner, attribute)] = vars(_resolve(owner)).get(attribute, _MISSING)
    _applied = tuple(patch.name for patch in patches)


def _restore() -> None:
    global _applied
    for (owner, attribute), original in reversed(_originals.items()):
        target = _resolve(owner)
        if original is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(target, attribute)
        else:
            setattr(target, attribute, original)
    _installed.clear()
    _applied = None


@contextlib.contextmanager
def applied_except(*names: str) -> Iterator[None]:
    """For tests: within the block, every patch but ``names`` is applied (the libraries put
    back as they were first); afterwards, all of them again. Servers started within the block
    run without those patches (:func:`apply_all` changes nothing meanwhile)."""
    unknown = set(names) - {patch.name for patch in PATCHES}
    if unknown:
        raise ValueError(f"no such patch: {', '.join(sorted(unknown))}")
    with _lock:
        apply_all_unlocked = _applied is None
        if apply_all_unlocked:
            _apply_in_order(PATCHES)  # records the originals
        _restore()
        _apply_in_order(tuple(patch for patch in PATCHES if patch.name not in names))
    try:
        yield
    finally:
        with _lock:
            _restore()
            _apply_in_order(PATCHES)


def applied() -> tuple[str, ...]:
    """The patches applied in this process, in order (empty before :func:`apply_all`)."""
    return _applied or ()
