"""``firstbyte router``: run the regional router (or check a config file).

firstbyte router --config router.toml
firstbyte router --upstream http://127.0.0.1:8001 --port 8443 --certfile C --keyfile K
firstbyte router --check-config router.toml
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from typing import Any

from firstbyte.cli import CLIError

from .config import ConfigError, RouterConfig, load_config, parse_config
from .config_check import check_files
from .observability.logs import LEVELS

__all__ = ["add_arguments", "config_from_args", "run"]


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
        "--insecure-plain-http",
        action="store_true",
        help="serve plain HTTP without TLS (local use only)",
    )
    parser.add_argument(
        "--log-level",
        choices=LEVELS,
        help="info (the default): the start-up line, one access line per request and upstream"
        " or peer state changes; debug adds the HTTP libraries' own lines",
    )
    parser.add_argument(
        "--log-format",
        choices=["json", "text"],
        default="json",
        help="json (the default): one JSON object per line on stdout; text: for a terminal",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="the same as --log-level debug"
    )


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The config from ``--config`` (flags override its settings) or from flags alone, with
    its files checked (:func:`~firstbyte.router.config_check.check_files`).

    An error about a value the user gave as a flag names the flag (``--port: ...``), not the
    config key it became; with no config file every key that has a flag is named as one.
    """
    if args.config and args.upstream:
        raise CLIError("give either --config FILE or --upstream URL, not both")
    listen: dict[str, Any] = {}
    for flag in ("host", "port", "certfile", "keyfile", "server"):
        value = getattr(args, flag)
        if value is not None:
            # A path typed on the command line is relative to the working directory.
            listen[flag] = os.path.abspath(value) if flag.endswith("file") else value
    if args.no_http3:
        listen["http3"] = False
    if args.insecure_plain_http:
        listen["insecure_plain_http"] = True
    api_keys = args.api_key or os.environ.get("FIRSTBYTE_API_KEYS", "").split()
    try:
        if args.config:
            source = args.config
            config = load_config(args.config)
            if listen or api_keys or args.region or args.allow_anonymous:
                data = _to_builtins(config)
                data["listen"].update(listen)
                if api_keys:
                    data["auth"]["api_keys"] = api_keys
                if args.allow_anonymous:
                    data["auth"]["allow_anonymous"] = True
                if args.region:
                    data["region"] = args.region
                source = f"{args.config} (with command-line flags)"
                config = parse_config(data, source)
        else:
            if not args.upstream:
                raise CLIError("give --config FILE or at least one --upstream URL")
            data = {
                "upstreams": [{"url": url} for url in args.upstream],
                "listen": listen,
                "auth": {"api_keys": api_keys, "allow_anonymous": args.allow_anonymous},
            }
            if args.region:
                data["region"] = args.region
            source = "command line"
            config = parse_config(data, source)
        check_files(config, source)
        return config
    except ConfigError as exc:
        raise CLIError(name_flags(str(exc), args)) from None


# (args attribute, text in a config error, what the user typed instead); longer texts first,
# so "set KEY = true" is rewritten whole before KEY alone.
_FLAG_TEXTS = (
    ("insecure_plain_http", "set listen.insecure_plain_http = true", "give --insecure-plain-http"),
    ("insecure_plain_http", "listen.insecure_plain_http", "--insecure-plain-http"),
    ("allow_anonymous", "set auth.allow_anonymous = true", "give --allow-anonymous"),
    ("allow_anonymous", "auth.allow_anonymous", "--allow-anonymous"),
    ("server", "listen.server = 'hypercorn'", "--server hypercorn"),
    ("server", "listen.server", "--server"),
    ("no_http3", "listen.http3", "HTTP/3 (on unless --no-http3)"),
    ("host", "listen.host", "--host"),
    ("port", "listen.port", "--port"),
    ("certfile", "listen.certfile", "--certfile"),
    ("keyfile", "listen.keyfile", "--keyfile"),
    ("api_key", "auth.api_keys", "--api-key"),
    ("region", "region:", "--region:"),
)


def name_flags(message: str, args: argparse.Namespace) -> str:
    """``message`` with the config keys the user set by flag written as those flags.

    Without ``--config`` every key that has a flag is written as its flag (there is no file
    the user could look for it in); with ``--config`` only the keys a flag overrode. Keys
    from ``FIRSTBYTE_API_KEYS`` are named as that variable.
    """
    everything = not args.config
    env_keys = not args.api_key and bool(os.environ.get("FIRSTBYTE_API_KEYS"))
    for attr, text, flag in _FLAG_TEXTS:
        if attr == "api_key" and env_keys:
            flag = "FIRSTBYTE_API_KEYS"
        elif not (everything or getattr(args, attr)):
            continue
        pattern = r"(?<![\w.\[])" + re.escape(text) + r"(?:\[\d+\])?(?![\w])"
        message = re.sub(pattern, flag, message)
    for i, url in enumerate(args.upstream or ()):
        message = message.replace(f"upstreams[{i}].url", f"--upstream {url}")
    return message


def _to_builtins(config: RouterConfig) -> dict[str, Any]:
    import msgspec

    data: dict[str, Any] = msgspec.to_builtins(config)
    return data


def run(args: argparse.Namespace) -> int:
    if args.check_config:
        try:
            check_files(load_config(args.check_config), args.check_config)
        except ConfigError as exc:
            raise CLIError(str(exc)) from None
        print("OK")
        return 0
    config = config_from_args(args)
    from .observability.logs import configure

    # Logs (the start-up line included) go to stdout; errors before this point to stderr.
    configure("debug" if args.verbose else args.log_level or "info", args.log_format)
    from .hosting import loop_factory
    from .serve import serve

    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(serve(config))
    except OSError as exc:
        raise CLIError(
            f"cannot listen on {config.listen.host}:{config.listen.port}: {exc}"
        ) from None
    except KeyboardInterrupt:
        return 0
    return 0
