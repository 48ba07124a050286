"""One emulated region in one process: a simulated inference server and the router before it.

``python -m benchmarks.scenarios._region_runner --host IP --region NAME --certfile C --keyfile K``
starts a sim (``--profile``, on 127.0.0.1 inside the host, so only the router can reach it) and
a router on ``IP`` (TLS with HTTP/1.1, HTTP/2 and HTTP/3 with 0-RTT on one port), then prints
one JSON line on stdout::

    {"region": "us-east-1", "url": "https://198.51.100.10:40123", "h3_port": 40123, "pid": 7}

and serves until SIGTERM or SIGINT, or until its parent is gone. One process per region keeps
the start-up of a world to one Python import per region. Used by :mod:`benchmarks.world`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

import msgspec

from benchmarks.scenarios._parent import exit_with_parent
from router.cluster import SimHandle
from router.config import parse_config
from router.serve import running_router
from router.sim.server import SimConfig

__all__ = ["main", "serve_region"]


async def serve_region(args: argparse.Namespace) -> None:
    """Start the sim and the router, announce them, serve until a signal."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sim = SimHandle(msgspec.convert({"profile": args.profile}, SimConfig))
    await sim.start()
    try:
        config = parse_config(
            {
                "region": args.region,
                "listen": {
                    "host": args.host,
                    "port": args.port,
                    "certfile": args.certfile,
                    "keyfile": args.keyfile,
                },
                "upstreams": [{"url": sim.url, "name": f"{args.region}-sim"}],
                # An emulated world inside this machine's namespaces: no keys to hand out.
                "auth": {"allow_anonymous": True},
            },
            f"<region {args.region}>",
        )
        async with running_router(config) as endpoints:
            line = {
                "region": args.region,
                "url": endpoints.base_url,
                "h3_port": endpoints.h3_port,
                "pid": os.getpid(),
            }
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
            await stop.wait()
    finally:
        await sim.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scenarios._region_runner")
    parser.add_argument("--host", required=True, help="address the router listens on")
    parser.add_argument("--port", type=int, default=0, help="TCP and UDP port (0: any)")
    parser.add_argument("--region", required=True, help="region name (x-firstbyte-region)")
    parser.add_argument("--certfile", required=True)
    parser.add_argument("--keyfile", required=True)
    parser.add_argument("--profile", default="instant", help="the sim's cost profile")
    args = parser.parse_args(argv)
    # Nobody is left to talk to once the parent is gone: no graceful shutdown (it would wait
    # for connections), the process just ends.
    exit_with_parent(code=0)
    asyncio.run(serve_region(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
