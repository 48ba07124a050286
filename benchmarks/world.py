"""An emulated world for benchmarks and the demo: regions (router + sim) and client hosts.

```python
async with World(regions=["region-us"], clients=["client-tokyo"], emulator=wan) as world:
    lines = await world.run_client("client-tokyo", "region-us", ["sse/2/cold"], repeat=3)
```

Each region is one process (:mod:`firstbyte.benchmarks.scenarios._region_runner`: a simulated
inference
server and the router before it, TLS with HTTP/1.1, HTTP/2 and HTTP/3 + 0-RTT), started inside
the region's network namespace; the SDK runs in another process inside the client's namespace
(:mod:`firstbyte.benchmarks.scenarios._client_runner`), so every handshake crosses the emulator's
delay line. Certificates come from a CA made for this run (trustme), so TLS is real and verified.

With ``peering=Peering(locations)`` (emulated worlds only) the routers are one deployment, as in
"Routing across regions": each knows the others as peers (a peer key made for this run, the
run's CA trusted for peer TLS through ``upstream_ca_file``), its own location, and a GeoIP2
City ``.mmdb`` written for this run (with ``mmdb-writer``) that maps each client host's address
to its place; so a router can forward a request to the region nearest its client and answer
with ``x-firstbyte-better-region``. Every router listens on :data:`PEERED_PORT` (each is alone
in its namespace, so its URL is known before it starts) and announces itself only once it has
fresh status from every peer. Without ``peering`` the routers know nothing of each other.

Without an emulator (``emulator=None``) everything runs on 127.0.0.1: the *loopback mode*,
which shows CPU costs only (see :data:`LOOPBACK_LIMITS`). :func:`choose_mode` decides: the
emulator when this machine can run it, loopback otherwise, except that under ``CI=true`` a
machine that cannot run the emulator is an error, never a silent fallback.

Teardown kills every process started here and removes the namespaces, also on Ctrl-C and on
errors (the emulator's own atexit hook is the last resort).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import trustme

from firstbyte.benchmarks.errors import BenchError
from firstbyte.benchmarks.wan import Emulator, PrecisionReport, WanUnavailable
from firstbyte.benchmarks.wan.geo import Place
from firstbyte.benchmarks.wan.netns import check_capable, python_env
from firstbyte.protocol import paths

__all__ = [
    "LOOPBACK_LIMITS",
    "PEERED_PORT",
    "Peering",
    "Region",
    "World",
    "WorldError",
    "choose_mode",
    "write_geoip_db",
]

LOOPBACK_LIMITS = (
    "loopback mode: no network namespaces, so every round trip is ~0 ms. It shows each "
    "transport's CPU cost and that every path works, but it cannot show round-trip counts, "
    "cold vs warm costs at a distance, the 0-RTT saving or geography: those need the WAN "
    "emulator (root and /dev/net/tun)."
)
START_TIMEOUT_S = 60.0
PEERED_PORT = 8443
"""The TCP and UDP port of every router of a peered world (peers need each other's URL)."""
PEER_KEY_ENV = "FIRSTBYTE_PEER_KEY"
"""How the region runner gets the peer key (kept out of the process list)."""


class WorldError(BenchError):
    """The world could not be built or a process in it failed (the message says which)."""


def choose_mode(force_loopback: bool = False) -> tuple[str, str | None]:
    """``("emulated", None)`` when the WAN emulator can run, else ``("loopback", why)``.

    Under ``CI=true`` an unusable emulator raises :class:`WorldError` (CI must measure
    through the emulator); ``force_loopback`` (or ``FIRSTBYTE_LOOPBACK=1`` in the
    environment, for ``firstbyte bench``) always chooses loopback.
    """
    if force_loopback or os.environ.get("FIRSTBYTE_LOOPBACK") == "1":
        return "loopback", "loopback mode requested"
    try:
        check_capable()
    except WanUnavailable as exc:
        if os.environ.get("CI") == "true":
            raise WorldError(f"CI=true but the WAN emulator cannot run here: {exc}") from None
        return "loopback", str(exc)
    return "emulated", None


@dataclass(frozen=True)
class Peering:
    """Peer the world's routers (see the module docstring). ``locations`` places every region
    host (the router's own location and its peers') and every client host (the GeoIP
    database); a client left out is unknown to GeoIP and counts as local wherever it enters."""

    locations: Mapping[str, Place]


def write_geoip_db(path: Path, places: Mapping[str, Place]) -> Path:
    """Write a GeoIP2-City-shaped ``.mmdb`` to ``path`` mapping each IPv4 address or network
    of ``places`` (``"192.0.2.10"``, ``"192.0.2.0/25"``) to its city, country and coordinates;
    returns ``path``."""
    # Imported here: only a peered world needs mmdb-writer (the `bench` extra has it).
    from mmdb_writer import MmdbF64, MMDBWriter
    from netaddr import IPSet

    writer = MMDBWriter(
        ip_version=6, ipv4_compatible=True, database_type="GeoIP2-City",
        languages=["en"], description="firstbyte emulated world (this run only)",
    )
    for network, place in places.items():
        writer.insert_network(
            IPSet([network]),
            {
                "city": {"names": {"en": place.name}},
                "country": {"iso_code": place.country, "names": {"en": place.country}},
                "location": {"latitude": MmdbF64(place.lat), "longitude": MmdbF64(place.lon)},
            },
        )
    writer.to_db_file(str(path))
    return path


@dataclass(frozen=True)
class Region:
    """A started region: its host, and the router's base URL (with ``/v1``)."""

    name: str
    host: str
    url: str
    h3_port: int | None
    page_url: str | None = None
    """With ``World(browser_pages=True)``: the browser benchmark's page, another origin."""


class _Proc:
    """A child process whose output is drained in the background (a full pipe would block
    it); the last lines are kept for error messages."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process) -> None:
        self.name = name
        self.proc = proc
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.first_line: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        assert proc.stdout is not None
        assert proc.stderr is not None
        self._tasks = [
            asyncio.ensure_future(self._drain(proc.stdout, first=True)),
            asyncio.ensure_future(self._drain(proc.stderr, first=False)),
        ]

    async def _drain(self, stream: asyncio.StreamReader, *, first: bool) -> None:
        while line := await stream.readline():
            text = line.decode(errors="replace").rstrip()
            if first and not self.first_line.done():
                self.first_line.set_result(text)
            else:
                self.tail.append(text)
        if first and not self.first_line.done():
            self.first_line.set_result("")

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 5.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class World:
    """Regions and clients; emulated when ``emulator`` is given (not yet started), else on
    loopback. Use as an async context manager."""

    def __init__(
        self,
        *,
        regions: Sequence[str],
        clients: Sequence[str],
        emulator: Emulator | None,
        sim_profile: str = "instant",
        log: Callable[[str], None] | None = None,
        peering: Peering | None = None,
        browser_pages: bool = False,
        extra_sims: Sequence[str] = (),
    ) -> None:
        self.region_hosts = list(regions)
        self.client_hosts = list(clients)
        self.emulator = emulator
        self.sim_profile = sim_profile
        self.peering = peering
        self.browser_pages = browser_pages
        self.extra_sims = list(extra_sims)
        """More sims per region, by profile: each serves its profile's model (the first
        sim serves ``default``), and the router routes each request by its model."""
        if peering is not None:
            if emulator is None:
                # On loopback every host is 127.0.0.1: GeoIP cannot tell clients apart.
                raise WorldError("peering needs the WAN emulator (every host its own address)")
            missing = [h for h in self.region_hosts if h not in peering.locations]
            if missing:
                raise WorldError(f"peering: no location for region(s) {', '.join(missing)}")
        self._log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.regions: dict[str, Region] = {}
        self._procs: list[_Proc] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.ca_file = ""
        self.cert_file = ""
        """The routers' certificate (PEM; every region has the same one)."""

    @property
    def mode(self) -> str:
        return "loopback" if self.emulator is None else "emulated"

    def ip(self, host: str) -> str:
        return "127.0.0.1" if self.emulator is None else self.emulator.ip(host)

    def rtt_ms(self, a: str, b: str) -> float:
        """The configured round trip between two hosts (0 on loopback)."""
        return 0.0 if self.emulator is None else self.emulator.configured_rtt_ms(a, b)

    # -- lifecycle ------------------------------------------------------------------------------
    async def __aenter__(self) -> World:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="firstbyte-world-")
        cert, key = self._make_certificates(Path(self._tmp.name))
        if self.emulator is not None:
            self._log(f"world: starting the WAN emulator ({len(self.emulator.hosts)} hosts)")
            await asyncio.to_thread(self.emulator.start)
        peered = self._peering_args(Path(self._tmp.name)) if self.peering else None
        self._log(f"world: starting {len(self.region_hosts)} region(s): router + sim each"
                  + (", peered (GeoIP, forwarding, better-region hints)" if peered else ""))
        started = await asyncio.gather(
            *(self._start_region(host, cert, key, peered) for host in self.region_hosts)
        )
        self.regions = {region.host: region for region in started}

    async def stop(self) -> None:
        """Stop every process and the emulator (idempotent; safe after a failed start)."""
        procs, self._procs = self._procs, []
        try:
            await asyncio.gather(*(proc.stop() for proc in procs), return_exceptions=True)
            if self.emulator is not None:
                await asyncio.to_thread(self.emulator.stop)
        finally:  # a failed or cancelled teardown still takes the certificates' folder
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    def _make_certificates(self, directory: Path) -> tuple[str, str]:
        ca = trustme.CA(organization_name="firstbyte benchmark CA (this run only)")
        names = sorted({self.ip(host) for host in self.region_hosts} | {"127.0.0.1", "localhost"})
        issued = ca.issue_cert(*names)
        paths = {name: str(directory / f"{name}.pem") for name in ("ca", "cert", "key")}
        ca.cert_pem.write_to_path(paths["ca"])
        issued.private_key_and_cert_chain_pem.write_to_path(paths["cert"])
        issued.private_key_pem.write_to_path(paths["key"])
        self.ca_file = paths["ca"]
        self.cert_file = paths["cert"]
        return paths["cert"], paths["key"]

    def _peering_args(self, directory: Path) -> tuple[dict[str, list[str]], str]:
        """Per region host, the region runner's peering flags; and the run's peer key."""
        assert self.peering is not None
        places = self.peering.locations
        database = write_geoip_db(
            directory / "world-city.mmdb",
            {self.ip(host): places[host] for host in self.client_hosts if host in places},
        )
        urls = {host: f"https://{self.ip(host)}:{PEERED_PORT}" for host in self.region_hosts}
        flags: dict[str, list[str]] = {}
        for host in self.region_hosts:
            here = places[host]
            argv = ["--port", str(PEERED_PORT), "--latitude", str(here.lat),
                    "--longitude", str(here.lon), "--geoip-db", str(database),
                    "--upstream-ca", self.ca_file]
            for other in self.region_hosts:
                if other != host:
                    argv += ["--peer", other, urls[other], str(places[other].lat),
                             str(places[other].lon)]
            flags[host] = argv
        return flags, secrets.token_urlsafe(24)

    async def _spawn(
        self, host: str, argv: list[str], env: Mapping[str, str] | None = None
    ) -> asyncio.subprocess.Process:
        pipes: dict[str, Any] = {
            "stdin": subprocess.DEVNULL,
            "stdout": subprocess.PIPE,
            "stderr": subprocess.PIPE,
            "env": {**python_env(), **(env or {})},
            # Own session: a terminal's Ctrl-C reaches only us, and we stop the children in
            # order; they end by themselves if we die (benchmarks._parent).
            "start_new_session": True,
        }
        if self.emulator is not None:
            return await self.emulator.spawn(host, argv, **pipes)
        return await asyncio.create_subprocess_exec(*argv, **pipes)

    async def _start_region(
        self, host: str, cert: str, key: str,
        peered: tuple[dict[str, list[str]], str] | None = None,
    ) -> Region:
        argv = [
            sys.executable, "-m", "firstbyte.benchmarks.scenarios._region_runner",
            "--host", self.ip(host),
            "--region", host, "--certfile", cert, "--keyfile", key, "--profile", self.sim_profile,
        ]
        env: dict[str, str] = {}
        if self.browser_pages:
            argv += ["--page-port", "0"]
        for profile in self.extra_sims:
            argv += ["--extra-sim", profile]
        if peered is not None:
            flags, peer_key = peered
            argv += flags[host]
            env[PEER_KEY_ENV] = peer_key
        proc = _Proc(host, await self._spawn(host, argv, env))
        self._procs.append(proc)
        try:
            line = await asyncio.wait_for(asyncio.shield(proc.first_line), START_TIMEOUT_S)
        except TimeoutError:
            raise WorldError(f"region {host} did not start within {START_TIMEOUT_S:g} s") from None
        try:
            info = json.loads(line)
        except ValueError:
            await proc.stop()
            tail = "\n".join(proc.tail) or line
            raise WorldError(f"region {host} failed to start:\n{tail}") from None
        peers = info.get("peers")
        self._log(f"world: region {host} serving {info['url']} (HTTP/1.1, HTTP/2, HTTP/3)"
                  + (f", peers up: {', '.join(peers)}" if peers else ""))
        return Region(host, host, str(info["url"]) + paths.API_BASE, info.get("h3_port"),
                      info.get("page"))

    # -- clients --------------------------------------------------------------------------------
    async def run_client(
        self,
        client: str,
        region: str | Sequence[str],
        cells: Sequence[str],
        *,
        repeat: int,
        max_tokens: int = 8,
        request_timeout_s: float = 20.0,
        time_limit_s: float = 300.0,
        probe: bool = True,
    ) -> list[dict[str, Any]]:
        """Run the SDK in ``client`` against ``region`` for ``cells``; one dict per request
        (``cell``, ``rep``, and ``timings`` + ``client_cpu_ms`` or ``error``). Several regions:
        the SDK is given all of them and chooses (a prewarmed cell probes their RTTs), or,
        with ``probe=False``, starts at the first and moves only on a better-region hint."""
        names = [region] if isinstance(region, str) else list(region)
        argv = [sys.executable, "-m", "firstbyte.benchmarks.scenarios._client_runner"]
        for name in names:
            argv += ["--url", self.regions[name].url]
        if not probe:
            argv.append("--no-probe")
        argv += [
            "--cacert", self.ca_file,
            "--repeat", str(repeat), "--max-tokens", str(max_tokens),
            "--timeout", f"{request_timeout_s:g}",
        ]
        for cell in cells:
            argv += ["--cell", cell]
        return await self.run_lines(client, argv, "the SDK", time_limit_s)

    async def run_lines(
        self, host: str, argv: list[str], who: str, time_limit_s: float
    ) -> list[dict[str, Any]]:
        """Run ``argv`` in ``host`` (a runner printing one JSON line per request, then
        ``{"done": true}``); its lines but the last. :class:`WorldError` naming ``who`` if it
        fails, ends without ``done`` or outlives ``time_limit_s``."""
        client = host
        proc = await self._spawn(host, argv)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), time_limit_s)
        except TimeoutError:
            raise WorldError(
                f"{who} in {client} did not finish within {time_limit_s:g} s"
            ) from None
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        lines = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines or not lines[-1].get("done"):
            tail = err.decode(errors="replace").strip().splitlines()[-10:]
            raise WorldError(
                f"{who} in {client} failed (exit {proc.returncode}):\n" + "\n".join(tail)
            )
        return lines[:-1]

    async def precision(
        self, pairs: Sequence[tuple[str, str]], count: int = 10
    ) -> PrecisionReport | None:
        """The emulator's measured vs configured RTT for ``pairs`` (None on loopback)."""
        if self.emulator is None:
            return None
        return await self.emulator.aprecision(pairs, count=count, methods=("udp", "tcp"))
