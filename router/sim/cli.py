"""``firstbyte sim``: run the simulated OpenAI-compatible inference server."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import msgspec

from firstbyte.cli import CLIError
from firstbyte.router import hosting
from firstbyte.router.hosting.tls_files import tls_pair_problem
from firstbyte.router.sim.faults import FaultSpecError, parse_fault
from firstbyte.router.sim.profiles import PROFILES
from firstbyte.router.sim.server import (
    CONFIG_ENV,
    SERVERS,
    SimConfig,
    build_app,
    options,
    running_app,
)

__all__ = ["add_arguments", "run"]

_FAULT_HELP = """\
inject a fault (repeatable). SPEC := KIND[:NAME=VALUE,...]:
  stall:after=N[,ms=M][,rate=R]
                          stop sending after N tokens, keep the connection open
                          (for M ms, then send on; without ms until the client leaves);
  drop:after=N[,rate=R]   close the connection abruptly after N tokens;
  delay:ms=M[,rate=R]     wait M ms before the first byte;
  error503:rate=R         answer 503 to a fraction R of requests.
rate (0..1, default 1) picks requests deterministically from --seed"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawTextHelpFormatter
    profiles = "\n".join(f"  {p.name}: {p.description}" for p in PROFILES.values())
    parser.epilog = "profiles:\n" + profiles
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    parser.add_argument(
        "--port", type=int, default=8001, help="TCP port (default 8001; 0: any free port)"
    )
    parser.add_argument(
        "--profile",
        default="h100-7b",
        choices=sorted(PROFILES),
        help="cost profile (default h100-7b; see below)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        metavar="N",
        help="sequences decoded together (default: the profile's)",
    )
    parser.add_argument(
        "--prefix-cache-blocks",
        type=int,
        default=None,
        metavar="N",
        help="prefix-cache capacity in 16-token blocks (default: the profile's)",
    )
    parser.add_argument(
        "--queue-limit",
        type=int,
        default=1024,
        metavar="N",
        help="requests allowed to wait beyond --max-num-seqs; more get 503 (default 1024)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens one scheduler step processes, as vLLM's: a burst of new requests then"
        " waits a few steps to start (default: no budget, all start at the next step)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model names answered, as vLLM's; the first is the one responses carry; any other"
        " model gets vLLM's 404 (default: the profile's model)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="context length /v1/models reports (default: the profile's)",
    )
    parser.add_argument("--fault", action="append", default=[], metavar="SPEC", help=_FAULT_HELP)
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for outputs and fault selection (default 0)"
    )
    parser.add_argument("--certfile", help="TLS certificate (PEM); enables HTTPS and HTTP/2")
    parser.add_argument("--keyfile", help="TLS private key (PEM)")
    parser.add_argument(
        "--server",
        choices=SERVERS,
        default=None,
        help="ASGI server (default: uvicorn, or hypercorn with TLS for HTTP/2)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 << 20,
        metavar="N",
        help="largest request body accepted; larger gets 413 (default 4 MiB)",
    )


def _config(args: argparse.Namespace) -> SimConfig:
    for name in (
        "max_num_seqs", "prefix_cache_blocks", "queue_limit", "max_body_bytes",
        "max_num_batched_tokens", "max_model_len",
    ):
        value = getattr(args, name)
        minimum = 0 if name in ("prefix_cache_blocks", "queue_limit") else 1
        if value is not None and value < minimum:
            raise CLIError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be 0..65535, got {args.port}")
    if bool(args.certfile) != bool(args.keyfile):
        raise CLIError("--certfile and --keyfile go together")
    if args.certfile:
        # Load the pair here, as the router checks its own: the server would only fail later,
        # with a traceback, or stop to ask an encrypted key's pass phrase on the terminal.
        problem = tls_pair_problem(args.certfile, args.keyfile, ("--certfile", "--keyfile"))
        if problem is not None:
            raise CLIError(problem)
    names = args.served_model_name or []
    if any(not name.strip() for name in names):
        raise CLIError("--served-model-name: a name cannot be empty")
    for spec in args.fault:
        try:
            parse_fault(spec)
        except FaultSpecError as exc:
            raise CLIError(str(exc)) from None
    return SimConfig(
        profile=args.profile,
        max_num_seqs=args.max_num_seqs,
        prefix_cache_blocks=args.prefix_cache_blocks,
        queue_limit=args.queue_limit,
        max_num_batched_tokens=args.max_num_batched_tokens,
        faults=list(args.fault),
        seed=args.seed,
        max_body_bytes=args.max_body_bytes,
        served_model_names=list(names),
        max_model_len=args.max_model_len,
    )


def run(args: argparse.Namespace) -> int:
    config = _config(args)
    server = args.server or ("hypercorn" if args.certfile else "uvicorn")
    if server == "uvicorn" and args.certfile and args.server:
        print("firstbyte sim: note: uvicorn serves HTTP/1.1 only", file=sys.stderr)
    if server == "granian":
        return _run_granian(args, config)
    try:
        listeners = hosting.bind(args.host, args.port)
    except OSError as exc:
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    url = listeners.url(tls=bool(args.certfile))

    async def main() -> None:
        stop = hosting.signal_event()
        app = build_app(config)
        # A GPU does not stop for a garbage collection: with the GC left at CPython's
        # defaults, a sim holding 2,000 streams ran full collections of 75-133 ms two to four
        # times in each ramp of `bench router_workers`, each a stalled engine step.
        serving = options(server, args.certfile, args.keyfile, tune_gc=True)
        async with running_app(app, listeners, serving):
            print(
                f"firstbyte sim: serving {url} "
                f"(profile {config.profile}, models {', '.join(_names(config))}, "
                f"server {server}, pid {os.getpid()})",
                flush=True,
            )
            await stop.wait()

    with asyncio.Runner(loop_factory=hosting.loop_factory()) as runner:
        runner.run(main())
    return 0


def _names(config: SimConfig) -> list[str]:
    return config.served_model_names or [PROFILES[config.profile].model]


def _run_granian(args: argparse.Namespace, config: SimConfig) -> int:
    os.environ[CONFIG_ENV] = msgspec.json.encode(config).decode()
    # granian binds its own socket: bind here first, so a busy port is the one line the
    # other servers give (granian's is a Rust traceback) and port 0 is a port the start-up
    # line can print; closed just before granian binds it again.
    try:
        listeners = hosting.bind(args.host, args.port)
    except OSError as exc:
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    url, port = listeners.url(tls=bool(args.certfile)), listeners.port
    listeners.close()
    print(
        f"firstbyte sim: serving {url} (profile {config.profile}, models"
        f" {', '.join(_names(config))}, server granian, pid {os.getpid()})",
        flush=True,
    )
    hosting.run_granian(
        "firstbyte.router.sim.server:granian_app",
        args.host,
        port,
        certfile=args.certfile,
        keyfile=args.keyfile,
    )
    return 0
