"""The ``firstbyte`` command: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``. Only the chosen subcommand's module is imported and only its parser is
built, so ``firstbyte probe`` loads the SDK alone; a subcommand whose optional dependencies are
missing says, in one line, which extra installs them.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, Protocol, TypeVar

__all__ = ["SUBCOMMANDS", "CLIError", "main"]

_P = ParamSpec("_P")
_T = TypeVar("_T")


class CLIError(Exception):
    """A user error: printed as ``firstbyte COMMAND: error: ...`` with exit code 2, never a
    traceback."""


@dataclass(frozen=True)
class Subcommand:
    module: str
    """Module with ``add_arguments(parser)`` and ``run(args) -> int``."""
    help: str
    """One line for ``firstbyte --help``; also the subcommand's description."""
    extra: str | None
    """The ``pip install 'firstbyte[EXTRA]'`` that brings its dependencies (None: the base)."""


# Only subcommands that work are listed.
SUBCOMMANDS: dict[str, Subcommand] = {
    "sim": Subcommand(
        "firstbyte.router.sim.cli",
        "run the simulated OpenAI-compatible inference server",
        "router",
    ),
    "probe": Subcommand(
        "firstbyte.client_sdk.probe",
        "time one streamed request phase by phase, like curl -w",
        None,
    ),
    "router": Subcommand(
        "firstbyte.router.cli",
        "run the regional router (TLS, HTTP/1.1, HTTP/2, HTTP/3)",
        "router",
    ),
    "bench": Subcommand(
        "firstbyte.benchmarks.cli",
        "run a benchmark scenario and write its report, or compare two",
        "bench",
    ),
    "wan": Subcommand(
        "firstbyte.benchmarks.wan.cli",
        "packet-level WAN emulator: up, status, exec, down, cleanup, precision",
        "bench",
    ),
    "demo": Subcommand(
        "firstbyte.benchmarks.demo",
        "run the demo: an emulated multi-region world on this machine",
        "bench",
    ),
}


_NESTED = frozenset({"bench", "wan"})
"""Commands whose first word picks a parser of its own (a scenario, an action)."""


class _Module(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


class _MissingExtra(Exception):
    """The chosen subcommand needs a third-party module that is not installed."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``firstbyte ARGV...`` and return its exit code (2 for a user error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="firstbyte",
        description="Take the network out of an LLM application's latency budget.",
    )
    parser.add_argument("--version", action="version", version=f"firstbyte {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _chosen(argv)
    for name, command in SUBCOMMANDS.items():
        # Not str.capitalize(): it lowercases the rest ("TLS", "OpenAI", "HTTP/2").
        description = command.help[0].upper() + command.help[1:] + "."
        sub = subparsers.add_parser(name, help=command.help, description=description)
        if name == chosen:
            try:
                module: _Module = _needing_extra(name, importlib.import_module, command.module)
            except _MissingExtra as exc:
                print(exc, file=sys.stderr)
                return 2
            module.add_arguments(sub)
            sub.set_defaults(_run=module.run)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse reports a subcommand's stray option with the top-level usage ("firstbyte
        # [-h] [--version] COMMAND"), not the usage of the command that was mistyped.
        at = argv.index(args.command) if args.command in argv else -1
        # The command, and for bench and wan the scenario or action right after it.
        named = argv[at: at + 2] if at >= 0 else []
        if len(named) == 2 and (args.command not in _NESTED or named[1].startswith("-")
                                or named[1] == unknown[0]):
            named = named[:1]
        prog = " ".join(["firstbyte", *named])
        print(f"{prog}: error: unrecognized arguments: {' '.join(unknown)}"
              f" (see {prog} --help)", file=sys.stderr)
        return 2
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    # SIGTERM ends a command as Ctrl-C does, so its context managers remove what it started
    # (a benchmark's namespaces and helper processes); servers install their own handlers.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        code: int = _needing_extra(args.command, run, args)
    except CLIError as exc:
        print(f"firstbyte {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except _MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: the first argument that is not an option (the top-level
    parser has only ``--help`` and ``--version``, which take no value)."""
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg if arg in SUBCOMMANDS else None
    return None


def _needing_extra(name: str, call: Callable[_P, _T], *a: _P.args, **kw: _P.kwargs) -> _T:
    """``call(...)``, turning a missing third-party module into :class:`_MissingExtra`."""
    try:
        return call(*a, **kw)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if not missing or missing == "firstbyte" or missing in sys.stdlib_module_names:
            raise  # not an optional dependency: a bug, shown as one
        extra = SUBCOMMANDS[name].extra or "all"
        raise _MissingExtra(
            f"firstbyte {name}: needs the {extra!r} extra (missing module {missing!r}):"
            f" {_install_hint(extra)}"
        ) from None


def _install_hint(extra: str) -> str:
    """The pip command that installs ``extra`` into this environment."""
    checkout = Path(__file__).resolve().parent.parent
    if not (checkout / "pyproject.toml").is_file():
        return f"pip install 'firstbyte[{extra}]'"
    where = "." if checkout == Path.cwd().resolve() else str(checkout)
    return f"pip install -e '{where}[{extra}]'"


def _version() -> str:
    import firstbyte

    return firstbyte.__version__
