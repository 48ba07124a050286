"""The router's logs as an operator sees them: JSON lines on stdout, one access line per
request, upstream state changes once each, no library chatter, a start-up line that says
what is served where."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any

import httpx
import msgspec
import pytest

from firstbyte.benchmarks.ports import free_port
from firstbyte.protocol.formats import MESSAGES
from firstbyte.router.observability import logs
from firstbyte.router.observability.access import (
    MAX_FIELD_CHARS,
    bounded,
    stream_ending,
    stream_usage,
)
from firstbyte.router.observability.logs import (
    QUIET_LIBRARIES,
    JsonFormatter,
    LogFormat,
    StateChanges,
    TextFormatter,
    configure,
    key_id,
    write_direct,
)
from firstbyte.router.sim.server import sim_server
from tests.cli import FIRSTBYTE
from tests.router.conftest import API_KEY, OTHER_KEY, RouterFactory, auth, client_tls
from tests.router.upstream import running_upstream

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"


def _closed_port() -> int:
    """A TCP port nothing listens on (yet)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Lines:
    """Reads a process's stdout as JSON lines in the background."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.raw: list[bytes] = []
        self.lines: list[dict[str, Any]] = []
        self._changed = asyncio.Event()
        self._task = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            self.raw.append(raw)
            self.lines.append(json.loads(raw))  # every line is JSON, or the test fails here
            self._changed.set()

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 20):
        async with asyncio.timeout(timeout_s):
            while True:
                found = [line for line in self.lines if predicate(line)]
                if found:
                    return found[0]
                self._changed.clear()
                await self._changed.wait()

    async def finish(self) -> None:
        await asyncio.wait_for(self._task, 20)


async def test_router_process_logs_json_lines_on_stdout(
    tmp_path: Path, tls_files: dict[str, str]
) -> None:
    async with sim_server("instant", served_model_names=["m"]) as sim:
        port, dead_port = free_port(udp=True), _closed_port()
        config = tmp_path / "router.toml"
        config.write_text(
            f'region = "logs-1"\n'
            f'[[upstreams]]\nurl = "{sim.url}"\nname = "sim"\n'
            f'[[upstreams]]\nurl = "http://127.0.0.1:{dead_port}"\nname = "late"\n'
            f'[listen]\nport = {port}\ncertfile = "{tls_files["certfile"]}"\n'
            f'keyfile = "{tls_files["keyfile"]}"\n'
            f'[auth]\napi_keys = ["{API_KEY}"]\n'
        )
        process = await asyncio.create_subprocess_exec(
            *FIRSTBYTE, "router", "--config", str(config),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert process.stdout is not None
        lines = Lines(process.stdout)
        late: asyncio.subprocess.Process | None = None
        try:
            started = await lines.wait_for(lambda line: "serving" in line["msg"])
            down = await lines.wait_for(lambda line: line["level"] == "warning")
            base = f"https://127.0.0.1:{port}"
            body = {"model": "m", "messages": [{"role": "user", "content": "log me"}],
                    "max_tokens": 5}  # fmt: skip
            async with httpx.AsyncClient(verify=client_tls(tls_files), http2=True) as client:
                streamed = await client.post(
                    base + "/v1/chat/completions",
                    json={**body, "stream": True},
                    headers={**auth(), "traceparent": f"00-{TRACE_ID}-{CALLER}-01"},
                )
                assert streamed.status_code == 200
                whole = await client.post(base + "/v1/chat/completions", json=body, headers=auth())
                assert whole.status_code == 200
                refused = await client.post(
                    base + "/v1/chat/completions", json=body, headers=auth(OTHER_KEY)
                )
                assert refused.status_code == 401
            # The dead upstream comes up: one line saying so.
            late = await asyncio.create_subprocess_exec(
                *FIRSTBYTE, "sim", "--port", str(dead_port), "--profile", "instant",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            up = await lines.wait_for(lambda line: "up again" in line["msg"])
            await asyncio.sleep(2.5)  # more scrapes of both upstreams: no more lines
        finally:
            # The router first: a scrape between the late upstream's end and the router's
            # would log it down once more (seen under CI's load).
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 20)
            finally:
                if late is not None:
                    late.send_signal(signal.SIGTERM)
                    await late.wait()
            await lines.finish()
            assert process.stderr is not None
            stderr = await process.stderr.read()
    assert process.returncode == 0
    assert b"Traceback" not in stderr
    output = b"".join(lines.raw) + stderr
    assert API_KEY.encode() not in output
    assert OTHER_KEY.encode() not in output

    assert started["msg"] == (
        f"firstbyte router (logs-1) serving https://127.0.0.1:{port} (HTTP/1.1, HTTP/2)"
        f" and HTTP/3 on UDP {port}; 2 upstreams"
    )
    assert down["msg"].startswith(f"upstream late (http://127.0.0.1:{dead_port}) is down: Connect")
    assert down["event"] == "upstream_down"
    assert up["msg"] == f"upstream late (http://127.0.0.1:{dead_port}) is up again"
    changes = [line for line in lines.lines if line.get("event", "").startswith("upstream_")]
    assert changes == [down, up]  # once per change, though scraped every second
    # No library chatter at the default level (the scrapes alone would be 2 lines/s).
    assert {line["logger"] for line in lines.lines} == {"firstbyte.router", "firstbyte.access"}

    access = [line for line in lines.lines if line["logger"] == "firstbyte.access"]
    assert [(a["transport"], a["status"], a["outcome"]) for a in access] == [
        ("sse", 200, "ok"),
        ("json", 200, "ok"),
        ("json", 401, "unauthorized"),
    ]
    sse, json_reply, rejected = access
    assert sse["http_version"] == "2"
    assert sse["trace_id"] == TRACE_ID
    assert streamed.headers["traceparent"] == f"00-{TRACE_ID}-{sse['request_id']}-01"
    assert sse["key_id"] == key_id(API_KEY)
    assert len(sse["key_id"]) == 12
    assert (sse["region"], sse["backend"], sse["model"]) == ("logs-1", "sim", "m")
    assert sse["stream"] == streamed.headers["x-firstbyte-stream"]
    assert sse["output_tokens"] == 5
    assert 0 < sse["ttft_ms"] <= sse["duration_ms"]
    assert json_reply["output_tokens"] == whole.json()["usage"]["completion_tokens"]
    assert json_reply["input_tokens"] == whole.json()["usage"]["prompt_tokens"]
    assert json_reply["ttft_ms"] is None
    assert rejected["key_id"] is None
    assert rejected["backend"] is None


async def test_a_detached_stream_is_logged_when_it_ends(
    start_router: RouterFactory, tls_files: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """``POST /v1/streams`` answers at once; its line waits for the stream's end, so it has
    the tokens and the outcome (and the key id, never the key)."""
    caplog.set_level(logging.INFO, logger="firstbyte.access")
    async with sim_server("instant", served_model_names=["m"]) as sim, start_router(
        [sim.url]
    ) as router:
        async with httpx.AsyncClient(verify=client_tls(tls_files)) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 7}
            started = await client.post(router.base_url + "/v1/streams", json=body, headers=auth())
            assert started.status_code == 201
            stream_id = started.json()["stream"]
            read = await client.get(router.base_url + f"/v1/streams/{stream_id}", headers=auth())
            assert read.text.endswith("data: [DONE]\n\n")
            unknown = await client.get(router.base_url + "/v1/streams/NoSuchStream0123/poll",
                                       headers=auth())
            assert unknown.status_code == 404
        for _ in range(100):
            if len(caplog.records) >= 3:
                break
            await asyncio.sleep(0.02)
    fields = [record.fields for record in caplog.records]  # type: ignore[attr-defined]
    by_path = {f["path"]: f for f in fields}
    detached = by_path["/v1/streams"]
    assert (detached["status"], detached["transport"], detached["outcome"]) == (
        201, "longpoll", "ok"
    )
    assert detached["output_tokens"] == 7
    assert detached["ttft_ms"] > 0
    reader = by_path["/v1/streams/{id}"]  # the id is logged as a field, not in the path
    assert reader["stream"] == stream_id == detached["stream"]
    assert reader["transport"] == "sse"
    assert reader["key_id"] == key_id(API_KEY)
    assert API_KEY not in caplog.text
    # An id no stream of the key has is the client's text (a guess, another key's): not kept.
    assert by_path["/v1/streams/{id}/poll"]["status"] == 404
    assert "NoSuchStream0123" not in caplog.text


async def test_an_upstream_failure_is_named_in_the_access_line(
    start_router: RouterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend answering 503 (nowhere else to go): the client gets the backend's answer,
    the access line the failing status in ``upstream_error``, without the backend's own
    error text (it may echo the prompt). A request that met no failure has no such field."""
    caplog.set_level(logging.INFO, logger="firstbyte.access")
    async with running_upstream() as up, start_router([up.url], tls=False) as router:
        async with httpx.AsyncClient(timeout=10) as client:
            url = router.base_url + "/v1/chat/completions"
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 3, "stream": True}
            assert (await client.post(url, json=body, headers=auth())).status_code == 200
            up.fail_status = 503
            failed = await client.post(url, json=body, headers=auth())
        for _ in range(100):
            if len(caplog.records) >= 2:
                break
            await asyncio.sleep(0.02)
    assert failed.status_code == 503
    served, refused = [record.fields for record in caplog.records]  # type: ignore[attr-defined]
    assert "upstream_error" not in served
    # The status alone: the backend's body (passed on to the client) is not in it.
    assert refused["status"] == 503
    assert refused["upstream_error"] == "UpstreamStatusError: HTTP 503"
    assert failed.json()["error"]["message"]


async def test_a_refusal_names_its_code_in_the_access_line(
    start_router: RouterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A 429's line names the limit (only the metric did): an operator can tell a key over
    its rate from one over its concurrency. A request served has no such field."""
    caplog.set_level(logging.INFO, logger="firstbyte.access")
    async with running_upstream() as up, start_router(
        [up.url], tls=False,
        limits={"requests_per_s_per_key": 0.01, "request_burst_per_key": 1},
    ) as router:
        async with httpx.AsyncClient(timeout=10) as client:
            url = router.base_url + "/v1/chat/completions"
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 3, "stream": True}
            assert (await client.post(url, json=body, headers=auth())).status_code == 200
            refused = await client.post(url, json=body, headers=auth())
        for _ in range(100):
            if len(caplog.records) >= 2:
                break
            await asyncio.sleep(0.02)
    assert refused.status_code == 429
    served, limited = [record.fields for record in caplog.records]  # type: ignore[attr-defined]
    assert "error_code" not in served
    assert (limited["status"], limited["outcome"]) == (429, "rejected")
    assert limited["error_code"] == refused.json()["error"]["code"] == "key_rate_limited"


async def test_client_supplied_fields_are_bounded_in_access_lines(
    start_router: RouterFactory, tls_files: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A 900 KB model name and an 8 KB path are logged as their first 256 characters and a
    marker: an access line stays a few KB, where it was as long as what the client sent."""
    caplog.set_level(logging.INFO, logger="firstbyte.access")
    model = "m" * 900_000
    async with sim_server("instant") as sim, start_router([sim.url]) as router:
        async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=30) as client:
            body = {"model": model, "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 3, "stream": True}  # fmt: skip
            chat = await client.post(
                router.base_url + "/v1/chat/completions", json=body, headers=auth()
            )
            lost = await client.get(router.base_url + "/v1/" + "p" * 8000, headers=auth())
        for _ in range(100):
            if len(caplog.records) >= 2:
                break
            await asyncio.sleep(0.02)
    assert chat.status_code < 500
    assert lost.status_code == 404
    fields = [record.fields for record in caplog.records]  # type: ignore[attr-defined]
    assert len(fields) == 2
    by_path = {f["path"]: f for f in fields}
    logged = by_path["/v1/chat/completions"]
    assert logged["model"] == "m" * MAX_FIELD_CHARS + f"...[+{900_000 - MAX_FIELD_CHARS}]"
    long_path = "/v1/" + "p" * 8000
    assert bounded(long_path) in by_path
    lines = [JsonFormatter().format(record) for record in caplog.records]
    assert max(len(line) for line in lines) < 4 * MAX_FIELD_CHARS + 2000


def test_bounded_keeps_short_values_and_marks_long_ones() -> None:
    assert bounded(None) is None
    assert bounded("x" * MAX_FIELD_CHARS) == "x" * MAX_FIELD_CHARS
    assert bounded("abcdef", 4) == "abcd...[+2]"


def test_state_changes_are_logged_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    changes = StateChanges(logging.getLogger("firstbyte.test"), "peer")
    with caplog.at_level(logging.INFO, logger="firstbyte.test"):
        assert not changes.up("tokyo")  # up from the start: nothing to say
        assert changes.down("tokyo", "ConnectError: refused")
        assert not changes.down("tokyo", "ConnectError: refused")
        assert changes.up("tokyo")
        assert not changes.up("tokyo")
    assert [r.getMessage() for r in caplog.records] == [
        "peer tokyo is down: ConnectError: refused",
        "peer tokyo is up again",
    ]
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]


def test_json_lines_carry_the_fields() -> None:
    record = logging.LogRecord("firstbyte.access", logging.INFO, __file__, 1, "POST %s", ("/x",),
                               None)  # fmt: skip
    record.fields = {"status": 200, "msg": "not overwritten"}
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "POST /x"
    assert line["status"] == 200
    assert line["level"] == "info"
    assert line["time"].endswith("Z")


def _chunk(content: str | None = None, **more: Any) -> bytes:
    delta = {} if content is None else {"content": content}
    return json.dumps(
        {"model": "served-m", "choices": [{"index": 0, "delta": delta}], **more},
        separators=(",", ":"),
    ).encode()


def test_stream_usage_prefers_the_upstreams_usage_chunk() -> None:
    events = [_chunk(""), _chunk("a"), _chunk("b"), _chunk("c"), b"[DONE]"]
    assert stream_usage(events).output_tokens == 3  # counted: no usage chunk
    assert stream_usage(events).response_model == "served-m"
    usage = {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}
    with_usage = [*events[:-1], _chunk(usage=usage), b"[DONE]"]
    counted = stream_usage(with_usage)
    assert (counted.input_tokens, counted.output_tokens, counted.outcome) == (11, 4, "ok")
    failed = [_chunk("a"), b'{"error":{"message":"x","code":"upstream_eof"}}', b"[DONE]"]
    assert stream_usage(failed).outcome == "upstream_eof"


def test_stream_ending_says_what_stream_usage_says_from_two_events() -> None:
    """The access line of a stream whose tokens the relay knew reads only its first and last
    events: the model and outcome must be those the whole-stream reading gives."""
    failed = [_chunk(""), _chunk("a"), b'{"error":{"message":"x","code":"upstream_eof"}}']
    ok = [_chunk(""), _chunk("a"), _chunk("b")]
    for events in (failed, ok, ok[:1]):
        whole = stream_usage([*events, b"[DONE]"])
        assert stream_ending(events[0], events[-1]) == (whole.response_model, whole.outcome)
    assert stream_ending(failed[0], failed[-1]) == ("served-m", "upstream_eof")
    assert stream_ending(None, None) == (None, "ok")
    start = b'{"type":"message_start","message":{"model":"claude-x","usage":{"input_tokens":3}}}'
    error = b'{"type":"error","error":{"type":"overloaded_error","message":"busy"}}'
    assert stream_ending(start, error, MESSAGES) == ("claude-x", "overloaded_error")
    assert stream_ending(None, None, MESSAGES) == (None, "ok")


def test_json_lines_encode_any_field_and_stamp_each_line() -> None:
    formatter = JsonFormatter()
    lines = []
    for created, text in ((1_700_000_000.25, "café"), (1_700_000_001.5, object())):
        record = logging.LogRecord("firstbyte.access", logging.INFO, __file__, 1, "m", (), None)
        record.created, record.msecs = created, (created % 1) * 1000
        record.fields = {"text": text, "ttft_ms": 9.52}
        lines.append(json.loads(formatter.format(record)))
    assert [line["time"] for line in lines] == [
        "2023-11-14T22:13:20.250Z", "2023-11-14T22:13:21.500Z"
    ]
    assert lines[0]["text"] == "café"
    assert lines[1]["text"].startswith("<object object at ")
    assert lines[0]["ttft_ms"] == 9.52


def test_a_json_line_is_its_members_then_its_fields_as_one_object() -> None:
    """Whatever the fields (none, a mapping other than a dict, a name of the line's own, a
    value only the standard library encodes, an exception's text after them), the line is
    the JSON of the line's members followed by the fields not named as one of them."""
    formatter = JsonFormatter()
    head = {"time": "2023-11-14T22:13:20.250Z", "level": "info", "logger": "a", "msg": "m"}
    cases: list[tuple[Any, str | None]] = [
        ({}, None),
        ({"status": 200, "ttft_ms": 9.52, "model": None, "obj": object()}, None),
        (MappingProxyType({"status": 200}), None),
        ({"status": 200, "msg": "not overwritten", "level": "no"}, None),
        ({"status": 200, "text": "lone \ud800 surrogate"}, None),
        ({"status": 200}, "Traceback: boom"),
    ]
    for fields, exc in cases:
        merged = {**head, **{k: v for k, v in fields.items() if k not in head}}
        if exc:
            merged["exc"] = exc
        line = formatter.line(1_700_000_000.25, "INFO", "a", "m", fields, exc)
        assert json.loads(line) == json.loads(json.dumps(merged, default=str)), fields
        if "text" not in fields:  # the standard library's own escapes the surrogate
            assert line == msgspec.json.encode(merged, enc_hook=str).decode()


def test_a_timestamp_counts_milliseconds_as_a_log_record_does() -> None:
    stamps = logs._Timestamps()
    for created in (1_700_000_000.0, 1_700_000_000.0009, 1_700_000_000.25, 1_700_000_000.999,
                    1_700_000_001.9999999, 0.5, -1.25):
        second = int(created)
        expected = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        assert stamps.format(created) == f"{expected}.{int((created - second) * 1000):03d}Z"


def test_text_lines_carry_the_same_time_and_the_fields() -> None:
    record = logging.LogRecord("firstbyte.access", logging.INFO, __file__, 1, "POST %s", ("/x",),
                               None)  # fmt: skip
    record.created, record.msecs = 1_700_000_000.25, 250.0
    record.fields = {"status": 200, "model": None}
    assert TextFormatter().format(record) == (
        "2023-11-14T22:13:20.250Z INFO firstbyte.access: POST /x status=200"
    )


def test_a_workers_lines_name_it_in_both_formats(monkeypatch: pytest.MonkeyPatch) -> None:
    record = logging.LogRecord("firstbyte.access", logging.INFO, __file__, 1, "m", (), None)
    record.created, record.msecs = 1_700_000_000.25, 250.0
    record.fields = {"status": 200}
    assert "worker" not in json.loads(JsonFormatter().format(record))  # one process: none
    monkeypatch.setattr(logs, "_worker", None)
    logs.set_worker(3)
    assert json.loads(JsonFormatter().format(record))["worker"] == 3
    assert TextFormatter().format(record) == (
        "2023-11-14T22:13:20.250Z INFO firstbyte.access: m worker=3 status=200"
    )


def test_a_struct_s_json_line_is_its_mapping_s_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A struct's line (an access line) is made apart from a mapping's, its members between
    time and msg encoded once a logger and level: the same bytes as the mapping's line, with
    and without a worker, at each level, for loggers and messages that need escaping."""

    class Fields(msgspec.Struct):
        status: int
        path: str
        left_out: str | msgspec.UnsetType = msgspec.UNSET

    fields = Fields(200, '/v1/"x"\u00e9')
    formatter = JsonFormatter()
    for worker in (None, 3, 0):
        monkeypatch.setattr(logs, "_worker", worker)
        for level in ("INFO", "DEBUG", "WARNING", "Level 5"):
            for logger in ("firstbyte.access", 'odd "name"\\', "\u00e9"):
                for msg in ("POST /v1/chat/completions 200", 'a "quoted"\n msg', ""):
                    for created in (1_700_000_000.25, 1_700_000_000.5, 1_700_000_001.999,
                                    1_700_000_001.001, 1_700_000_000.25):
                        line = formatter.line(created, level, logger, msg, fields)
                        assert line == formatter.line(
                            created, level, logger, msg, logs.struct_fields(fields))
                        decoded = json.loads(line)
                        assert decoded["level"] == level.lower()
                        assert decoded["logger"] == logger
                        assert decoded["msg"] == msg
                        assert decoded.get("worker") == worker
                        assert list(decoded)[-2:] == ["status", "path"]


def test_a_struct_s_line_time_is_the_mapping_s_in_any_order_of_times() -> None:
    """A struct's line keeps its second's text from line to line: line after line, the
    time is a mapping's line's for times that go back, stay in a second, end it, or come
    before 1970, and for a fraction that rounds up to a thousand milliseconds."""

    class Fields(msgspec.Struct):
        status: int

    by_struct, by_mapping = JsonFormatter(), JsonFormatter()
    times = [1_700_000_000.25, 1_700_000_000.999, 1_700_000_000.9999999, 1_699_999_999.5,
             1_700_000_000.0, 1_700_000_001.0, math.nextafter(1_700_000_001.0, 0), 0.5,
             0.9999999999999999, 0.0, -0.5, -1.5, -0.5, -1.0, 0.25, 1e-300, 1_700_000_000.75]
    for created in times:
        line = by_struct.line(created, "INFO", "firstbyte.access", "m", Fields(200))
        assert line == by_mapping.line(created, "INFO", "firstbyte.access", "m", {"status": 200})


@contextmanager
def configured(
    fmt: LogFormat, level: str = "info"
) -> Iterator[tuple[io.StringIO, logging.Handler]]:
    """:func:`configure` as a router process has it (at ``level``), writing to a StringIO;
    the process's logging (pytest's handlers, levels, flags) as it was afterwards."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.logThreads, logging.logProcesses,
             logging.logMultiprocessing,
             {name: logging.getLogger(name).level for name in QUIET_LIBRARIES})
    out = io.StringIO()
    try:
        yield out, configure(level, fmt, out)
    finally:
        handlers, level, threads, processes, multiprocessing, libraries = saved
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.logThreads, logging.logProcesses = threads, processes
        logging.logMultiprocessing = multiprocessing
        for name, library_level in libraries.items():
            logging.getLogger(name).setLevel(library_level)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_line_written_direct_is_the_line_logging_writes(
    fmt: LogFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The access line without a LogRecord is the same bytes as the standard path's, at the
    same time; it is written direct only where the configured handler alone would get it."""
    log = logging.getLogger("firstbyte.access")
    fields = {"request_id": "r1", "status": 200, "model": "m", "ttft_ms": 9.52, "stream": None}
    with configured(fmt) as (out, handler):
        with monkeypatch.context() as clock:
            clock.setattr(time, "time", lambda: 1_700_000_000.25)
            assert write_direct(log, logging.INFO, "POST /v1/chat/completions 200", fields)
            direct = out.getvalue()
            out.seek(0)
            out.truncate()
            log.handle(log.makeRecord(
                log.name, logging.INFO, __file__, 0, "%s %s %s",
                ("POST", "/v1/chat/completions", 200), None, extra={"fields": fields},
            ))
        assert direct == out.getvalue()
        assert direct.startswith("2023-11-14T22:13:20.250Z" if fmt == "text"
                                 else '{"time":"2023-11-14T22:13:20.250Z"')
        assert direct.count("\n") == 1
        assert direct.endswith("\n")

        # Anywhere else a record could go: the standard path, which gives it there too.
        listener = logging.NullHandler()
        for logger in (log, logging.getLogger("firstbyte"), logging.getLogger()):
            logger.addHandler(listener)
            assert not write_direct(log, logging.INFO, "m", fields), logger.name
            logger.removeHandler(listener)
        handler.addFilter(lambda record: True)
        assert not write_direct(log, logging.INFO, "m", fields)
        handler.filters.clear()
        log.addFilter(lambda record: True)
        assert not write_direct(log, logging.INFO, "m", fields)
        log.filters.clear()
        handler.setLevel(logging.WARNING)
        assert not write_direct(log, logging.INFO, "m", fields)
        handler.setLevel(logging.NOTSET)
        assert write_direct(log, logging.INFO, "m", fields)
    # Not configured here (pytest's handlers at the root): never direct.
    assert not write_direct(log, logging.INFO, "m", fields)


def test_a_debug_run_never_lets_hpack_or_h2_log_header_values() -> None:
    """hpack and h2 log decoded headers (the API key among them) at DEBUG: ``configure`` at
    ``debug`` holds them above it whatever was imported first (a start that imported the
    hosting layer before configuring its logging leaked ``Bearer`` keys under ``-v``)."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level,
             {name: logging.getLogger(name).level for name in (*QUIET_LIBRARIES, "h2")})
    try:
        for name in ("hpack", "h2"):
            logging.getLogger(name).setLevel(logging.NOTSET)
        configure("debug", "json", io.StringIO())
        assert logging.getLogger("hpack").getEffectiveLevel() > logging.DEBUG
        assert logging.getLogger("h2").getEffectiveLevel() > logging.DEBUG
        assert logging.getLogger("httpx").getEffectiveLevel() == logging.DEBUG
    finally:
        handlers, level, libraries = saved
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, library_level in libraries.items():
            logging.getLogger(name).setLevel(library_level)
