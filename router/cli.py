"""``firstbyte router``: run the regional router (or check a config file).

firstbyte router --config router.toml
firstbyte router --upstream http://127.0.0.1:8001 --port 8443 --certfile C --keyfile K
firstbyte router --upstream URL ... --max-streams-per-key 32 --rate-per-key 10 --max-in-flight 256
firstbyte router --check-config router.toml
firstbyte router --config router.toml --workers 4 --redis-url redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from firstbyte.cli import CLIError

from .config import ConfigError, RouterConfig, load_config, parse_config

__all__ = ["LIMIT_FLAGS", "add_arguments", "config_from_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    parser.add_argument(
        "--check-config", metavar="FILE", help="validate FILE, print OK or the error, and exit"
    )
    parser.add_argument(
        "--upstream",
        action="append",
        metavar="URL",
        help="inference server base URL (repeatable); without --config",
    )
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="TCP port, and UDP port for HTTP/3 (default 8443)")
    parser.add_argument("--certfile", help="TLS certificate chain (PEM)")
    parser.add_argument("--keyfile", help="TLS private key (PEM)")
    parser.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="accepted API key (repeatable; visible to other local users in the process list:"
        " prefer the FIRSTBYTE_API_KEYS environment variable, whitespace-separated, or the"
        " config file)",
    )
    parser.add_argument(
        "--allow-anonymous",
        action="store_true",
        help="with no --api-key, accept any request (local use only; otherwise refused)",
    )
    parser.add_argument("--region", help="this router's region name (default 'local')")
    parser.add_argument(
        "--server",
        choices=["hypercorn", "uvicorn"],
        help="hypercorn: HTTP/1.1, HTTP/2, HTTP/3; uvicorn: HTTP/1.1 only, less CPU"
        " (default: listen.server from --config, else hypercorn)",
    )
    parser.add_argument("--no-http3", action="store_true", help="do not serve HTTP/3")
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="router processes sharing the port (SO_REUSEPORT, HTTP/3 included); more than 1"
        " needs --redis-url or state.redis_url (default: listen.workers, else 1)",
    )
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        help="share streams, QUIC tickets and limits with the region's other router processes"
        " through Redis or Valkey (redis://HOST:PORT/DB; state.redis_url in --config)",
    )
    parser.add_argument(
        "--insecure-plain-http",
        action="store_true",
        help="serve plain HTTP without TLS (local use only)",
    )
    limits = parser.add_argument_group(
        "limits", "the common limits (each overrides its config key; docs/limits.md has them all)"
    )
    for flag, (key, kind, help_text) in LIMIT_FLAGS.items():
        limits.add_argument(flag, type=kind, metavar="N", help=f"{help_text} ({key})")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")


LIMIT_FLAGS: dict[str, tuple[str, type, str]] = {
    "--max-streams-per-key": (
        "limits.max_streams_per_key", int, "completions in flight per API key; default 128"
    ),
    "--rate-per-key": (
        "limits.requests_per_s_per_key",
        float,
        "requests a second per API key (token bucket); default 0: no rate limit",
    ),
    "--burst-per-key": (
        "limits.request_burst_per_key", int, "requests an API key may send at once; default 100"
    ),
    "--store-bytes-per-key": (
        "limits.max_store_bytes_per_key",
        int,
        "an API key's share of the stream store, bytes; default a quarter of the store",
    ),
    "--max-in-flight": (
        "routing.backend_max_in_flight",
        int,
        "cap on requests in flight per backend (its reported capacity rules below it);"
        " default 1024",
    ),
}
"""The limit flags: flag -> (config key, value type, help)."""


def _limit_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The limit flags given, as config sections: ``{"limits": {"max_streams_per_key": 8}}``."""
    sections: dict[str, dict[str, Any]] = {}
    for flag, (key, _, _) in LIMIT_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            section, _, field = key.partition(".")
            sections.setdefault(section, {})[field] = value
    return sections


def _name_the_flag(message: str, args: argparse.Namespace) -> str:
    """``command line: limits.max_streams_per_key: ...`` -> ``--max-streams-per-key: ...``
    when that key came from a flag the user typed."""
    given = _limit_overrides(args)
    for flag, (key, _, _) in LIMIT_FLAGS.items():
        section, _, field = key.partition(".")
        marker = f": {key}: "
        if field in given.get(section, {}) and marker in message:
            return f"{flag}: {message.split(marker, 1)[1]}"
    return message


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The config from ``--config`` (flags override its listen settings) or from flags alone."""
    if args.config and args.upstream:
        raise CLIError("give either --config FILE or --upstream URL, not both")
    listen: dict[str, Any] = {}
    for flag in ("host", "port", "certfile", "keyfile", "server", "workers"):
        value = getattr(args, flag)
        if value is not None:
            listen[flag] = value
    if args.no_http3:
        listen["http3"] = False
    if args.insecure_plain_http:
        listen["insecure_plain_http"] = True
    api_keys = args.api_key or os.environ.get("FIRSTBYTE_API_KEYS", "").split()
    limits = _limit_overrides(args)
    try:
        if args.config:
            config = load_config(args.config)
            if (
                listen or api_keys or args.region or args.allow_anonymous or limits
                or args.redis_url
            ):
                data = _to_builtins(config)
                data["listen"].update(listen)
                for section, values in limits.items():
                    data[section].update(values)
                if args.redis_url:
                    data["state"]["redis_url"] = args.redis_url
                if api_keys:
                    data["auth"]["api_keys"] = api_keys
                if args.allow_anonymous:
                    data["auth"]["allow_anonymous"] = True
                if args.region:
                    data["region"] = args.region
                config = parse_config(data, f"{args.config} (with command-line flags)")
            return config
        if not args.upstream:
            raise CLIError("give --config FILE or at least one --upstream URL")
        data = {
            "upstreams": [{"url": url} for url in args.upstream],
            "listen": listen,
            "auth": {"api_keys": api_keys, "allow_anonymous": args.allow_anonymous},
            **limits,
        }
        if args.redis_url:
            data["state"] = {"redis_url": args.redis_url}
        if args.region:
            data["region"] = args.region
        return parse_config(data, "command line")
    except ConfigError as exc:
        raise CLIError(_name_the_flag(str(exc), args)) from None


def _check_tls_files(config: RouterConfig) -> None:
    """Load the certificate once up front, so a bad path is one clear line, not a traceback."""
    listen = config.listen
    if listen.certfile is None or listen.keyfile is None:
        return
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            listen.certfile, listen.keyfile
        )
    except (OSError, ssl.SSLError) as exc:
        raise CLIError(
            f"cannot load listen.certfile/keyfile ({listen.certfile}, {listen.keyfile}): {exc}"
        ) from None


def _to_builtins(config: RouterConfig) -> dict[str, Any]:
    import msgspec

    data: dict[str, Any] = msgspec.to_builtins(config)
    return data


def run(args: argparse.Namespace) -> int:
    if args.check_config:
        try:
            load_config(args.check_config)
        except ConfigError as exc:
            raise CLIError(str(exc)) from None
        print("OK")
        return 0
    config = config_from_args(args)
    _check_tls_files(config)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if config.listen.workers > 1:
        from .workers import run_workers

        return run_workers(config, _serve_worker)
    return _serve_worker(config, None)


def _serve_worker(config: RouterConfig, index: int | None) -> int:
    """Serve ``config`` in this process: the only one, or worker ``index`` of several."""
    from .hosting import loop_factory
    from .serve import RouterEndpoints, serve

    label = "" if index is None else f" worker {index + 1}/{config.listen.workers}"

    def started(ep: RouterEndpoints) -> None:
        h3 = f", HTTP/3 on UDP {ep.h3_port}" if ep.h3_port else ""
        print(f"firstbyte router ({config.region}){label} on {ep.base_url}{h3}", file=sys.stderr)

    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(serve(config, started=started, reuse_port=index is not None))
    except OSError as exc:
        raise CLIError(
            f"cannot listen on {config.listen.host}:{config.listen.port}: {exc}"
        ) from None
    except KeyboardInterrupt:
        return 0
    return 0
