"""One emulated region in one process: a simulated inference server and the router before it.

``python -m firstbyte.benchmarks.scenarios._region_runner --host IP --region NAME --certfile C
--keyfile K``
starts a sim (``--profile``, on 127.0.0.1 inside the host, so only the router can reach it;
it serves the model ``default``; each ``--extra-sim PROFILE`` is one more, serving its
profile's model, and the router routes each request to the sim of its model) and
a router on ``IP`` (TLS with HTTP/1.1, HTTP/2 and HTTP/3 with 0-RTT on one port), then prints
one JSON line on stdout::

    {"region": "us-east-1", "url": "https://198.51.100.10:40123", "h3_port": 40123, "pid": 7}

and serves until SIGTERM or SIGINT, or until its parent is gone. One process per region keeps
the start-up of a world to one Python import per region. Used by :mod:`firstbyte.benchmarks.world`.

Peered (one deployment of several regions, README "Routing across regions"): each
``--peer NAME URL LAT LON`` (repeatable) is another region's router; the peer key comes from
the environment variable ``FIRSTBYTE_PEER_KEY`` (not the command line: it would show in the
process list); ``--latitude``/``--longitude`` place this region, ``--geoip-db`` is a GeoIP2
City ``.mmdb`` locating clients, ``--upstream-ca`` the CA trusted for TLS to peers. With peers,
``--port`` must be given (the peers' configuration names it) and the line is printed only once
every peer's ``/v1/edge/status`` has arrived (at most ``--peers-timeout`` seconds, else the
process exits with an error), with ``"peers": [names]`` added, so that the first request
already finds its peers as candidates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import ssl
import sys
import time
from typing import Any

import msgspec

from firstbyte.benchmarks._parent import exit_with_parent
from firstbyte.benchmarks.cluster import SimHandle, until_peers_fresh
from firstbyte.benchmarks.scenarios._browser_page import serve_page
from firstbyte.benchmarks.world import PEER_KEY_ENV
from firstbyte.protocol import paths
from firstbyte.router.config import parse_config
from firstbyte.router.serve import running_router
from firstbyte.router.sim.profiles import get_profile
from firstbyte.router.sim.server import SimConfig
from firstbyte.router.state import RouterState
from firstbyte.router.streams import owner_of

__all__ = ["main", "serve_region"]

def _peering(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration sections that make this router one of a deployment (none without
    ``--peer``)."""
    if not args.peer:
        return {}
    return {
        "geo": {
            "latitude": args.latitude,
            "longitude": args.longitude,
            "public_url": f"https://{args.host}:{args.port}",
            **({"database": args.geoip_db} if args.geoip_db else {}),
        },
        "routing": {"peer_key": os.environ[PEER_KEY_ENV]},
        "peers": [
            {"name": name, "url": url, "latitude": float(lat), "longitude": float(lon)}
            for name, url, lat, lon in args.peer
        ],
        **({"upstream_ca_file": args.upstream_ca} if args.upstream_ca else {}),
    }


async def serve_region(args: argparse.Namespace) -> None:
    """Start the sim and the router, announce them, serve until a signal."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # "default": the model the world's clients ask for (_client_runner, _browser_runner).
    sim_config = {"profile": args.profile, "served_model_names": ["default"]}
    sim = SimHandle(msgspec.convert(sim_config, SimConfig))
    await sim.start()
    extra = [SimHandle(msgspec.convert({"profile": p}, SimConfig)) for p in args.extra_sim]
    page: asyncio.Server | None = None
    try:
        for handle in extra:
            await handle.start()
        upstreams: list[dict[str, Any]] = [{"url": sim.url, "name": f"{args.region}-sim"}]
        if extra:  # each sim for its model only, from the first request on
            upstreams[0]["models"] = ["default"]
            upstreams += [{"url": h.url, "name": f"{args.region}-sim-{h.config.profile}",
                           "models": [get_profile(h.config.profile).model]} for h in extra]
        browser: dict[str, Any] = {}
        if args.page_port is not None:
            router_url: list[str] = []
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(args.certfile, args.keyfile)
            page = await serve_page(args.host, args.page_port, tls, lambda: router_url[0],
                                    lambda: mint_token(endpoints.app.state))
            page_origin = f"https://{args.host}:{page.sockets[0].getsockname()[1]}"
            browser = {
                "cors": {"allow_origins": [page_origin]},
                # Every page of the bench is one user (the anonymous key's tokens, no
                # subject), and an intent cell warms a prompt per request.
                "limits": {"prompt_warms_per_min_per_subject": 10_000},
            }
        config = parse_config(
            {
                "region": args.region,
                "listen": {
                    "host": args.host,
                    "port": args.port,
                    "certfile": args.certfile,
                    "keyfile": args.keyfile,
                },
                "upstreams": upstreams,
                # An emulated world inside this machine's namespaces: no keys to hand out.
                "auth": {"allow_anonymous": True},
                **_peering(args),
                **browser,
            },
            f"<region {args.region}>",
        )
        # This process is a router (and its sim): GC tuned as `firstbyte router` has it.
        async with running_router(config, tune_gc=True) as endpoints:
            line: dict[str, Any] = {
                "region": args.region,
                "url": endpoints.base_url,
                "h3_port": endpoints.h3_port,
                "pid": os.getpid(),
            }
            if page is not None:
                router_url.append(endpoints.base_url + paths.API_BASE)
                line["page"] = page_origin + "/"
            if args.peer:
                await until_peers_fresh([endpoints.app.state], args.peers_timeout)
                line["peers"] = sorted(endpoints.app.state.routing.peer_table.peers)
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
            await stop.wait()
    finally:
        if page is not None:
            page.close()
        for handle in extra:
            await handle.stop()
        await sim.stop()


def mint_token(state: RouterState) -> str:
    """A client token for the page (the router is anonymous: the token's owner is nobody's
    key), as the application's backend mints one with its key."""
    return state.tokens.mint(owner_of(None), time.time()).token


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m firstbyte.benchmarks.scenarios._region_runner")
    parser.add_argument("--host", required=True, help="address the router listens on")
    parser.add_argument("--port", type=int, default=0, help="TCP and UDP port (0: any)")
    parser.add_argument("--region", required=True, help="region name (x-firstbyte-region)")
    parser.add_argument("--certfile", required=True)
    parser.add_argument("--keyfile", required=True)
    parser.add_argument("--profile", default="instant", help="the sim's cost profile")
    parser.add_argument("--extra-sim", action="append", default=[], metavar="PROFILE",
                        help="one more sim, of this profile, serving its profile's model "
                             "(repeatable)")
    parser.add_argument("--peer", nargs=4, action="append", default=[],
                        metavar=("NAME", "URL", "LAT", "LON"),
                        help="another region's router (repeatable; key in $FIRSTBYTE_PEER_KEY)")
    parser.add_argument("--latitude", type=float, help="this region's location (with peers)")
    parser.add_argument("--longitude", type=float)
    parser.add_argument("--geoip-db", help="a GeoIP2 City .mmdb locating clients")
    parser.add_argument("--upstream-ca", help="CA (PEM) trusted for TLS to peers")
    parser.add_argument("--page-port", type=int,
                        help="also serve the browser benchmark's page on this port (0: any), "
                             "an origin the router's CORS allows")
    parser.add_argument("--peers-timeout", type=float, default=30.0,
                        help="seconds to wait for every peer's status before announcing")
    args = parser.parse_args(argv)
    if args.peer:
        if not os.environ.get(PEER_KEY_ENV):
            parser.error(f"--peer needs the peer key in ${PEER_KEY_ENV}")
        if args.port == 0:
            parser.error("--peer needs a fixed --port (the peers' configuration names it)")
        if args.latitude is None or args.longitude is None:
            parser.error("--peer needs --latitude and --longitude")
        for _, _, lat, lon in args.peer:
            try:
                float(lat), float(lon)
            except ValueError:
                parser.error(f"--peer: LAT and LON must be numbers, not {lat!r} {lon!r}")
    # Nobody is left to talk to once the parent is gone: no graceful shutdown (it would wait
    # for connections), the process just ends.
    exit_with_parent(code=0)
    try:
        asyncio.run(serve_region(args))
    except TimeoutError as exc:  # peers never answered: the world reports this line
        print(f"region {args.region}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
