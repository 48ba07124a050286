"""``firstbyte router``: run the regional router (or check a config file).

firstbyte router --config router.toml
firstbyte router --upstream http://127.0.0.1:8001 --port 8443 --certfile C --keyfile K
firstbyte router --upstream URL ... --max-streams-per-key 32 --rate-per-key 10 --max-in-flight 256
firstbyte router --check-config router.toml
firstbyte router --config router.toml --workers 4 --redis-url redis://127.0.0.1:6379/0
firstbyte router reload --config router.toml     (or --pid PID, or --pid-file FILE)

SIGTERM drains (docs/router.md, "Drain"); SIGHUP, or ``firstbyte router reload``, reloads the
config in place (docs/router.md, "Reload").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from firstbyte.cli import CLIError

from .config import ConfigError, RouterConfig, load_config, parse_config
from .config_check import check_files, check_state, key_warnings
from .observability.logs import LEVELS

__all__ = ["LIMIT_FLAGS", "add_arguments", "config_from_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        nargs="?",
        choices=["reload"],
        help="reload: make the running router (--pid, --pid-file, or listen.pid_file of"
        " --config) read its config again; what cannot change in place is refused and logged",
    )
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
        choices=["auto", "hypercorn", "uvicorn"],
        help="auto: HTTP/2 and HTTP/3 on hypercorn, HTTP/1.1 on uvicorn's protocol;"
        " hypercorn: all on hypercorn; uvicorn: HTTP/1.1 only"
        " (default: listen.server from --config, else auto)",
    )
    parser.add_argument("--no-http3", action="store_true", help="do not serve HTTP/3")
    parser.add_argument(
        "--http3-advertised-port",
        type=int,
        metavar="PORT",
        help="the port alt-svc names for HTTP/3, when clients reach the router on another"
        " (-p 443:8443, a balancer on 443; listen.http3_advertised_port; default: --port)",
    )
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
        "--pid-file",
        metavar="FILE",
        help="write the router's pid to FILE while it runs (listen.pid_file); with reload:"
        " the router to signal",
    )
    parser.add_argument("--pid", type=int, help="with reload: the router process to signal")
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


LIMIT_FLAGS: dict[str, tuple[str, type, str]] = {
    "--max-streams-per-key": (
        "limits.max_streams_per_key", int, "cap on completions in flight per API key; default none"
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
    """The config from ``--config`` (flags override its settings) or from flags alone, with
    its files checked (:func:`~firstbyte.router.config_check.check_files`).

    An error about a value the user gave as a flag names the flag (``--port: ...``), not the
    config key it became; with no config file every key that has a flag is named as one.
    """
    if args.config and args.upstream:
        raise CLIError("give either --config FILE or --upstream URL, not both")
    listen: dict[str, Any] = {}
    for flag in ("host", "port", "certfile", "keyfile", "server", "workers", "pid_file",
                 "http3_advertised_port"):
        value = getattr(args, flag)
        if value is not None:
            # A path typed on the command line is relative to the working directory.
            listen[flag] = os.path.abspath(value) if flag.endswith("file") else value
    if args.no_http3:
        listen["http3"] = False
    if args.insecure_plain_http:
        listen["insecure_plain_http"] = True
    api_keys = args.api_key or os.environ.get("FIRSTBYTE_API_KEYS", "").split()
    limits = _limit_overrides(args)
    try:
        if args.config:
            source = args.config
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
                source = f"{args.config} (with command-line flags)"
                config = parse_config(data, source)
        else:
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
            source = "command line"
            config = parse_config(data, source)
        check_files(config, source)
        return config
    except ConfigError as exc:
        raise CLIError(name_flags(_name_the_flag(str(exc), args), args)) from None


# (args attribute, text in a config error, what the user typed instead); longer texts first,
# so "set KEY = true" is rewritten whole before KEY alone.
_FLAG_TEXTS = (
    ("insecure_plain_http", "set listen.insecure_plain_http = true", "give --insecure-plain-http"),
    ("insecure_plain_http", "listen.insecure_plain_http", "--insecure-plain-http"),
    ("allow_anonymous", "set auth.allow_anonymous = true", "give --allow-anonymous"),
    ("allow_anonymous", "auth.allow_anonymous", "--allow-anonymous"),
    ("server", "listen.server = 'auto' or 'hypercorn'", "--server auto or hypercorn"),
    ("server", "listen.server", "--server"),
    ("http3_advertised_port", "listen.http3_advertised_port", "--http3-advertised-port"),
    ("no_http3", "listen.http3", "HTTP/3 (on unless --no-http3)"),
    ("host", "listen.host", "--host"),
    ("port", "listen.port", "--port"),
    ("certfile", "listen.certfile", "--certfile"),
    ("keyfile", "listen.keyfile", "--keyfile"),
    ("api_key", "auth.api_keys", "--api-key"),
    ("region", "region:", "--region:"),
    ("workers", "set listen.workers =", "give --workers"),
    ("workers", "listen.workers =", "--workers"),
    ("workers", "listen.workers", "--workers"),
    ("redis_url", "state.redis_url", "--redis-url"),
    ("pid_file", "listen.pid_file", "--pid-file"),
)


def name_flags(message: str, args: argparse.Namespace) -> str:
    """``message`` with the config keys the user set by flag written as those flags.

    Without ``--config`` every key that has a flag is written as its flag (there is no file
    the user could look for it in); with ``--config`` only the keys a flag overrode. Keys
    from ``FIRSTBYTE_API_KEYS`` are named as that variable.
    """
    everything = not args.config
    env_keys = not args.api_key and bool(os.environ.get("FIRSTBYTE_API_KEYS"))
    limit_texts = [(flag[2:].replace("-", "_"), key, flag)
                   for flag, (key, _, _) in LIMIT_FLAGS.items()]
    for attr, text, flag in (*_FLAG_TEXTS, *limit_texts):
        if attr == "api_key" and env_keys:
            flag = "FIRSTBYTE_API_KEYS"
        elif not (everything or getattr(args, attr, None) not in (None, False)):
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
    if args.action == "reload":
        return _signal_reload(args)
    if args.check_config:
        if args.config and args.config != args.check_config:
            raise CLIError("give the file to check once: --check-config FILE")
        # The config the router would run: the file with the flags given beside it applied
        # (a --port 70000 that would stop the start is an error here too).
        args.config = args.check_config
        checked = config_from_args(args)
        try:
            state_warnings = check_state(checked, args.check_config)
        except ConfigError as exc:
            raise CLIError(name_flags(str(exc), args)) from None
        _check_libraries(checked)
        for warning in [*key_warnings(checked), *state_warnings]:
            print(f"firstbyte router: warning: {args.check_config}: {warning}", file=sys.stderr)
        print("OK")
        return 0
    config = config_from_args(args)
    try:
        state_warnings = check_state(config, args.config or "command line")
    except ConfigError as exc:
        raise CLIError(name_flags(str(exc), args)) from None
    from .observability.logs import configure

    # Logs (the start-up line included) go to stdout; errors before this point to stderr.
    configure("debug" if args.verbose else args.log_level or "info", args.log_format)
    for warning in state_warnings:
        logging.getLogger("firstbyte.router").warning("%s", warning)
    # After configure: importing the hosting layer holds hpack and h2 above DEBUG whatever
    # the level (they log decoded headers, API keys among them).
    _check_libraries(config)
    with _pid_file(config.listen.pid_file):
        if config.listen.workers > 1:
            from .workers import run_workers

            return run_workers(config, lambda c, i: _serve_worker(c, i, args))
        return _serve_worker(config, None, args)


def _check_libraries(config: RouterConfig) -> None:
    """What a start checks after the config, before serving: the router extra is installed
    (a missing module is named, with the extra that brings it, by the ``firstbyte`` command)
    and each library has the shape its patches were tested on. ``--check-config`` runs it
    too, so a config it passes starts here."""
    from .hosting.patches import PatchShapeError, apply_all

    try:
        apply_all()  # a library of a shape the patches were not tested on: refuse to start
    except PatchShapeError as exc:
        raise CLIError(str(exc)) from None
    if config.state.redis_url is not None:
        from .shared.wire import check_shape

        problem = check_shape()  # the redis-py internal the admissions' replies rely on
        if problem is not None:
            raise CLIError(problem)


@contextlib.contextmanager
def _pid_file(path: str | None) -> Any:
    if path is None:
        yield
        return
    running = _running_router(Path(path))
    if running is not None:
        # Taking the file over would lose the running router's pid: this start then fails
        # to bind its port and, leaving, removes the file that `reload` reads.
        raise CLIError(f"listen.pid_file: {path} names pid {running}, a firstbyte router still"
                       " running: stop it first, or give this router another pid file")
    try:
        Path(path).write_text(f"{os.getpid()}\n")
    except OSError as exc:
        raise CLIError(f"listen.pid_file: cannot write {path}: {exc.strerror or exc}") from None
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if Path(path).read_text().strip() == str(os.getpid()):
                Path(path).unlink()


def _running_router(path: Path) -> int | None:
    """The pid ``path`` holds when it is a running firstbyte router's other than this
    process's; None for no file, no pid, or a stale one (the process gone, or another)."""
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    if pid <= 0 or pid == os.getpid():  # a restarted container: the same pid, this one
        return None
    try:
        os.kill(pid, 0)  # signal 0: only asks whether it runs (without procfs, too)
    except ProcessLookupError:
        return None
    except OSError:  # another user's process: it runs
        pass
    try:
        _check_router_pid(pid, None)
    except CLIError:  # gone meanwhile, or the pid reused by another program
        return None
    return pid


def _check_router_pid(pid: int, pid_file: str | None) -> None:
    """Refuse to SIGHUP anything but a firstbyte router: SIGHUP ends a process that does not
    handle it, and ``kill`` reads 0 and -1 as whole process groups, or every process."""
    stale = f" (a stale {pid_file}?)" if pid_file else ""
    if pid <= 0:
        raise CLIError(f"{pid} is not a process id{stale}: nothing signalled")
    proc = Path("/proc")
    if not (proc / "self").exists():  # no procfs (not Linux): the pid is taken as given
        return
    try:
        command = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        raise CLIError(f"no process {pid} is running{stale}") from None
    if b"firstbyte" not in command:
        shown = command.replace(b"\0", b" ").decode(errors="replace").strip()[:80]
        raise CLIError(f"process {pid} is not a firstbyte router ({shown!r}){stale}:"
                       " nothing signalled")


def _signal_reload(args: argparse.Namespace) -> int:
    """``firstbyte router reload``: check the config here (when given), then SIGHUP the router."""
    pid_file = args.pid_file
    if args.config:
        config = config_from_args(args)  # a broken file is reported here, not only in the log
        pid_file = pid_file or config.listen.pid_file
    pid = args.pid
    if pid is None:
        if pid_file is None:
            raise CLIError("give --pid PID, --pid-file FILE, or --config FILE with listen.pid_file")
        try:
            pid = int(Path(pid_file).read_text().strip())
        except (OSError, ValueError) as exc:
            raise CLIError(f"cannot read a pid from {pid_file}: {exc}") from None
    _check_router_pid(pid, pid_file if args.pid is None else None)
    try:
        os.kill(pid, signal.SIGHUP)
    except OSError as exc:
        raise CLIError(f"cannot signal the router (pid {pid}): {exc.strerror or exc}") from None
    print(f"sent SIGHUP to the router (pid {pid}); its log says whether the config was taken")
    return 0


def _reloaded_config(args: argparse.Namespace, running: RouterConfig) -> RouterConfig:
    """The config read again as at start-up (file and flags), for a reload; a
    :class:`ConfigError` if it fails the check. A file saying ``listen.port = 0`` keeps the
    port this router took."""
    try:
        config = config_from_args(args)
    except CLIError as exc:
        raise ConfigError(str(exc)) from None
    if config.listen.port == 0 and running.listen.port != 0:
        import msgspec

        listen = msgspec.structs.replace(config.listen, port=running.listen.port)
        config = msgspec.structs.replace(config, listen=listen)
    return config


def _serve_worker(config: RouterConfig, index: int | None, args: argparse.Namespace) -> int:
    """Serve ``config`` in this process: the only one, or worker ``index`` of several."""
    from .hosting import loop_factory
    from .serve import serve

    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(
                serve(
                    config,
                    reuse_port=index is not None,
                    reload=lambda: _reloaded_config(args, config),
                )
            )
    except OSError as exc:
        raise CLIError(
            f"cannot listen on {config.listen.host}:{config.listen.port}: {exc}"
        ) from None
    except KeyboardInterrupt:
        return 0
    return 0
