"""The ``firstbyte`` command: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; it is imported only when chosen, so ``firstbyte probe`` works with the
SDK alone and the router's and benchmarks' dependencies load only when they are used.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Sequence
from typing import Protocol

# name -> (module, one-line help). Only subcommands that work are listed.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sim": ("firstbyte.router.sim.cli", "run the simulated OpenAI-compatible inference server"),
    "probe": (
        "firstbyte.client_sdk.probe",
        "time one streamed request phase by phase, like curl -w",
    ),
    "router": ("firstbyte.router.cli", "run the regional router (TLS, HTTP/1.1, HTTP/2, HTTP/3)"),
    "bench": (
        "firstbyte.benchmarks.cli",
        "run a benchmark scenario and write its report, or compare two",
    ),
    "wan": (
        "firstbyte.benchmarks.wan.cli",
        "packet-level WAN emulator: up, down, exec, cleanup, precision",
    ),
    "demo": (
        "firstbyte.benchmarks.demo",
        "run the demo: an emulated multi-region world on this machine",
    ),
}


class _Subcommand(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


class CLIError(Exception):
    """A user error: printed as ``firstbyte: error: ...`` with exit code 2, never a traceback."""


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, _Subcommand]]:
    parser = argparse.ArgumentParser(
        prog="firstbyte",
        description="Take the network out of an LLM application's latency budget.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules: dict[str, _Subcommand] = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        # Not str.capitalize(): it lowercases the rest ("TLS", "OpenAI", "HTTP/2").
        description = help_text[0].upper() + help_text[1:] + "."
        sub = subparsers.add_parser(name, help=help_text, description=description)
        try:
            module: _Subcommand = importlib.import_module(module_name)
        except ImportError as exc:
            missing = exc.name or str(exc)

            def _missing(args: argparse.Namespace, missing: str = missing) -> int:
                raise CLIError(
                    f"this command needs an optional dependency that is not installed ({missing});"
                    " install it with: pip install 'firstbyte[all]'"
                )

            sub.set_defaults(_run=_missing)
            continue
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
        modules[name] = module
    return parser, modules


def main(argv: Sequence[str] | None = None) -> int:
    parser, _ = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    # SIGTERM ends a command as Ctrl-C does, so its context managers remove what it started
    # (a benchmark's namespaces and helper processes); servers install their own handlers.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        code: int = run(args)
    except CLIError as exc:
        print(f"firstbyte {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    # As ``python -m firstbyte.client_sdk.cli`` this file is ``__main__``; subcommands raise the
    # ``firstbyte.client_sdk.cli.CLIError`` of the imported module, so dispatch through that one.
    from firstbyte.client_sdk.cli import main as _main

    sys.exit(_main())
