"""Several regions on one machine: routers and simulated backends on 127.0.0.1.

For tests, benchmarks and demos of routing across regions::

    specs = [RegionSpec("tokyo", 35.68, 139.69), RegionSpec("frankfurt", 50.11, 8.68)]
    async with running_regions(specs, peer_key="k" * 16) as regions:
        regions["tokyo"].url            # the Tokyo router's base URL
        await regions["tokyo"].sims[0].restart()

Every router lists every other as a peer; router ports are reserved before any router starts
(each router must know its peers' URLs), the sims bind ephemeral ports. A sim can be stopped
and restarted on the same port, as a real backend restart looks to the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from firstbyte.router import hosting
from firstbyte.router.config import parse_config
from firstbyte.router.serve import RouterEndpoints, running_router
from firstbyte.router.sim.app import SimApp
from firstbyte.router.sim.server import SimConfig, build_app, options, running_app
from firstbyte.router.state import RouterState

__all__ = ["MODEL", "RegionHandle", "RegionSpec", "SimHandle", "running_regions",
           "until_peers_fresh", "wait_for_peers"]

MODEL = "sim"
"""The model every sim of the world serves unless its spec's ``served_model_names`` says
otherwise (the sims answer 404 for any other, as vLLM does)."""


class SimHandle:
    """One simulated backend on a fixed port, which can be stopped and started again."""

    def __init__(self, config: SimConfig, host: str = "127.0.0.1") -> None:
        self.config = config
        self.host = host
        self.port = 0
        self.app: SimApp | None = None
        self._running: contextlib.AsyncExitStack | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = build_app(self.config)
        listeners = hosting.bind(self.host, self.port)
        self.port = listeners.port
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(running_app(app, listeners, options("uvicorn")))
            self._running = stack.pop_all()
        self.app = app

    async def stop(self) -> None:
        if self._running is not None:
            running, self._running = self._running, None
            await running.aclose()

    async def restart(self, down_s: float = 0.0) -> None:
        """Stop, stay down ``down_s`` seconds, start a fresh sim (empty cache) on the same port."""
        await self.stop()
        await asyncio.sleep(down_s)
        await self.start()


@dataclass
class RegionSpec:
    name: str
    latitude: float
    longitude: float
    backends: int = 2
    sim: dict[str, Any] = field(default_factory=dict)
    """:class:`firstbyte.router.sim.server.SimConfig` fields (``profile``, ``max_num_seqs``,
    ``faults``, ``served_model_names``: default ``[MODEL]``)."""
    upstream: dict[str, Any] = field(default_factory=dict)
    """Extra fields for every upstream of this region (``max_in_flight``, ``models``)."""
    config: dict[str, Any] = field(default_factory=dict)
    """Router config sections merged over the defaults (``routing``, ``warmup``, ...)."""


@dataclass
class RegionHandle:
    spec: RegionSpec
    endpoints: RouterEndpoints
    sims: list[SimHandle]

    @property
    def url(self) -> str:
        return self.endpoints.base_url

    @property
    def state(self) -> RouterState:
        return self.endpoints.app.state


def _reserve_ports(n: int) -> list[socket.socket]:
    """``n`` distinct loopback ports, each held by a bound socket until its router is about to
    bind it (:func:`running_regions` closes each just before): released at once, a port could
    be taken in between by a sim's listener or any process's outgoing connection (a parallel
    test run failed with EADDRINUSE so)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@contextlib.asynccontextmanager
async def running_regions(
    specs: Sequence[RegionSpec],
    *,
    peer_key: str = "firstbyte-test-peer-key",
    api_keys: Sequence[str] = (),
    warm_prefixes: Sequence[dict[str, Any]] = (),
    geo_database: str | None = None,
    trusted_proxies: Sequence[str] = ("127.0.0.1/32",),
) -> AsyncIterator[dict[str, RegionHandle]]:
    """Start every region's sims and router, warmed (:meth:`RouterState.until_warm`); stop them
    all on exit."""
    reserved = _reserve_ports(len(specs))
    ports = [s.getsockname()[1] for s in reserved]
    urls = {spec.name: f"http://127.0.0.1:{port}" for spec, port in zip(specs, ports, strict=True)}
    async with contextlib.AsyncExitStack() as stack:
        for s in reserved:
            stack.callback(s.close)  # closing twice is harmless: on any way out
        sims: dict[str, list[SimHandle]] = {}
        for spec in specs:
            sims[spec.name] = []
            for _ in range(spec.backends):
                sim_config = {"served_model_names": [MODEL], **spec.sim}
                sim = SimHandle(msgspec.convert(sim_config, SimConfig))
                await sim.start()
                stack.push_async_callback(sim.stop)
                sims[spec.name].append(sim)
        handles: dict[str, RegionHandle] = {}
        for spec, port, held in zip(specs, ports, reserved, strict=True):
            data: dict[str, Any] = {
                "region": spec.name,
                "listen": {"host": "127.0.0.1", "port": port, "insecure_plain_http": True},
                # A loopback test world: without keys, every request is accepted (explicitly).
                "auth": {"api_keys": list(api_keys), "allow_anonymous": not api_keys},
                "upstreams": [
                    {"url": s.url, "name": f"{spec.name}-{i}", **spec.upstream}
                    for i, s in enumerate(sims[spec.name])
                ],
                "geo": {
                    "latitude": spec.latitude,
                    "longitude": spec.longitude,
                    "public_url": urls[spec.name],
                    "trusted_proxies": list(trusted_proxies),
                    **({"database": geo_database} if geo_database else {}),
                },
                "routing": {
                    "peer_key": peer_key,
                    "peer_poll_interval_s": 0.2,
                    "backend_metrics_interval_s": 0.25,
                },
                "peers": [
                    {"name": o.name, "url": urls[o.name], "latitude": o.latitude,
                     "longitude": o.longitude}
                    for o in specs if o.name != spec.name
                ],
                "warm_prefixes": list(warm_prefixes),
                "warmup": {"startup_timeout_s": 20.0},
            }
            config = parse_config(_merge(data, spec.config), f"<region {spec.name}>")
            held.close()  # its router binds the port first thing: nothing runs in between
            endpoints = await stack.enter_async_context(running_router(config))
            handles[spec.name] = RegionHandle(spec, endpoints, sims[spec.name])
        for handle in handles.values():
            await handle.state.until_warm()
        yield handles


async def wait_for_peers(regions: dict[str, RegionHandle], timeout_s: float = 10.0) -> None:
    """Wait until every router has fresh status from every peer (raises TimeoutError)."""
    await until_peers_fresh([h.state for h in regions.values()], timeout_s)


async def until_peers_fresh(states: Sequence[RouterState], timeout_s: float) -> None:
    """Wait until each router in ``states`` has status from every peer it is configured with,
    received after this call (so it says what the peer serves once started: its models);
    TimeoutError naming the routers and peers still missing."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    since = {id(state): state.clock() for state in states}
    while True:
        missing: dict[str, list[str]] = {}
        for state in states:
            table = state.routing.peer_table
            fresh = table.fresh(state.clock())
            absent = sorted(
                name for name, peer in table.peers.items()
                if name not in fresh or (peer.received_at or 0.0) < since[id(state)]
            )
            if absent:
                missing[state.region] = absent
        if not missing:
            return
        if loop.time() > deadline:
            said = "; ".join(f"{r}: {', '.join(p)}" for r, p in sorted(missing.items()))
            raise TimeoutError(f"no status from peer(s) in {timeout_s:g} s ({said})")
        await asyncio.sleep(0.05)
