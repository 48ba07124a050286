"""Generate ``client_sdk/browser/protocol.js`` from :mod:`firstbyte.protocol`.

The browser client speaks the same wire protocol as the Python SDK; its constants (paths,
header names, error codes, WebSocket message tags and close codes, the token carriers) are not
written by hand but generated from the one Python definition, and a test checks that the
committed file is what this produces. A wire change is one edit in ``protocol/`` and::

    python -m firstbyte.client_sdk.browser_protocol --write
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from firstbyte.protocol import (
    content_coding,
    error_codes,
    events,
    headers,
    paths,
    sse,
    timings,
    tokens,
    ws,
)

__all__ = ["TARGET", "render"]

TARGET = Path(__file__).resolve().parent / "browser" / "protocol.js"


def _constants(module: object, names: list[str]) -> dict[str, object]:
    return {name: getattr(module, name) for name in names}


def _ws_types() -> dict[str, str]:
    kinds = (ws.Request, ws.Resume, ws.Start, ws.Event, ws.Done, ws.Error)
    return {kind.__name__.upper(): str(kind.__struct_config__.tag) for kind in kinds}


def _formats() -> dict[str, object]:
    """The streamed formats besides chat: path, terminal event types, what marks output."""
    kinds = (events.COMPLETION_EVENTS, events.RESPONSE_EVENTS, events.MESSAGE_EVENTS)
    out: dict[str, object] = {
        kind.name.upper(): {"NAME": kind.name, "PATH": kind.path,
                            "TERMINAL": sorted(kind.terminal)}
        for kind in kinds
    }
    out["RESPONSE_CONTENT"] = sorted(events.RESPONSE_CONTENT)
    out["MESSAGE_CONTENT_DELTAS"] = sorted(events.MESSAGE_CONTENT_DELTAS)
    return out


def render() -> str:
    """The module's text: one frozen object per protocol module."""
    groups: dict[str, dict[str, object]] = {
        "PATHS": _constants(paths, [n for n in paths.__all__ if n.isupper()]),
        "HEADERS": {n.removesuffix("_HEADER"): getattr(headers, n) for n in headers.__all__},
        "ERROR_CODES": _constants(error_codes, list(error_codes.__all__)),
        "WS": {**_ws_types(), **_constants(ws, [
            "SUBPROTOCOL", "TOKEN_SUBPROTOCOL_PREFIX", "CLOSE_INVALID_PAYLOAD", "CLOSE_POLICY"])},
        "SSE": {"DONE": sse.DONE},
        "TOKENS": _constants(tokens, ["TOKEN_PREFIX", "QUERY_PARAM"]),
        # What POST /v1/edge/timings accepts: the client sends these fields and nothing else.
        "TIMINGS": {"FIELDS": list(timings.TimingsRecord.__struct_fields__),
                    **_constants(timings, ["TRANSPORTS", "HTTP_VERSIONS", "MAX_MS",
                                           "ORDER_SLACK_MS"])},
        "FORMATS": _formats(),
        # Request-body compression: what a router takes, the simple start's parameter, and
        # the size below which a client sends a body as it is.
        "CONTENT_CODING": _constants(content_coding, [
            "ACCEPT_ENCODING", "QUERY_PARAM", "COMPRESS_MIN_BYTES"]),
    }
    out = [
        "// Generated from firstbyte.protocol by `python -m firstbyte.client_sdk.browser_protocol"
        " --write`.",
        "// Do not edit: change protocol/ and regenerate (tests/client_sdk/test_browser_protocol"
        ".py checks).",
        "",
    ]
    for name, values in groups.items():
        out.append(f"export const {name} = Object.freeze({json.dumps(values, indent=2)});")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m firstbyte.client_sdk.browser_protocol",
        description="Print (or --write, or --check) the browser client's protocol.js.")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"write {TARGET}")
    group.add_argument("--check", action="store_true",
                       help="exit 1 if the committed protocol.js is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        TARGET.write_text(text)
    elif args.check:
        if not TARGET.is_file() or TARGET.read_text() != text:
            print(f"{TARGET} is out of date: run with --write", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
