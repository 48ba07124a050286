"""Starting the sim: its configuration and app, handed to :mod:`firstbyte.router.hosting`.

Three ASGI servers can run the same :class:`~firstbyte.router.sim.app.SimApp` (``--server``):

- ``uvicorn`` (httptools parser; HTTP/1.1 only, TLS optional): the default for plain HTTP, the
  fastest per streamed chunk on this machine (see ``benchmarks/scenarios/sim_cpu.py``);
- ``hypercorn`` (HTTP/1.1, HTTP/2 over TLS with ALPN, h2c prior knowledge): the default when
  ``certfile``/``keyfile`` are given, so clients can negotiate HTTP/2;
- ``granian`` (Rust HTTP stack, HTTP/1.1 and HTTP/2): only as a separate process started by
  ``firstbyte sim --server granian`` (it imports the app by name, configured through the
  ``FIRSTBYTE_SIM_CONFIG`` environment variable).

Tests and benchmarks start a real sim inside their own event loop with :func:`running_sim`::

    async with running_sim(profile="h100-7b", max_num_seqs=2, served_model_names=["m"]) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")

and use :func:`sim_server` when they also want the engine (metrics, cache state).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from firstbyte.router import hosting
from firstbyte.router.hosting import Listeners, ServerOptions
from firstbyte.router.sim.app import DEFAULT_MAX_BODY_BYTES, SimApp, SimOptions, quiet_drop_logs
from firstbyte.router.sim.engine import Engine
from firstbyte.router.sim.faults import FaultPlan, parse_fault
from firstbyte.router.sim.profiles import get_profile

__all__ = [
    "SERVERS",
    "SimConfig",
    "SimServer",
    "build_app",
    "granian_app",
    "options",
    "running_app",
    "running_sim",
    "sim_server",
]

SERVERS = ("uvicorn", "hypercorn", "granian")
"""``--server`` choices: hosting's in-process servers, and granian in its own process."""
CONFIG_ENV = "FIRSTBYTE_SIM_CONFIG"


class SimConfig(msgspec.Struct, kw_only=True):
    """Everything that defines one sim replica (the ``firstbyte sim`` options)."""

    profile: str = "instant"
    max_num_seqs: int | None = None
    """None: the profile's default."""
    prefix_cache_blocks: int | None = None
    """None: the profile's default."""
    queue_limit: int = 1024
    max_num_batched_tokens: int | None = None
    """Tokens one scheduler step processes (vLLM's); None: no budget."""
    faults: list[str] = msgspec.field(default_factory=list)
    """``--fault`` SPECs (see :mod:`firstbyte.router.sim.faults`)."""
    seed: int = 0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    served_model_names: list[str] = msgspec.field(default_factory=list)
    """vLLM's ``--served-model-name``: the model names answered (the first is the one responses
    carry); any other gets vLLM's 404. Empty: the profile's model alone."""
    max_model_len: int | None = None
    """The context length ``/v1/models`` reports (vLLM's ``--max-model-len``); None: the
    profile's."""


def build_app(config: SimConfig) -> SimApp:
    """A ready app for ``config``; ``KeyError``/``ValueError`` with a clear message if invalid."""
    profile = get_profile(config.profile)
    engine = Engine(
        profile,
        max_num_seqs=config.max_num_seqs,
        queue_limit=config.queue_limit,
        prefix_cache_blocks=config.prefix_cache_blocks,
        max_num_batched_tokens=config.max_num_batched_tokens,
        model_name=config.served_model_names[0] if config.served_model_names else None,
    )
    plan = FaultPlan([parse_fault(spec) for spec in config.faults], seed=config.seed)
    options = SimOptions(
        max_body_bytes=config.max_body_bytes,
        seed=config.seed,
        faults=plan,
        served_model_names=tuple(config.served_model_names),
        max_model_len=config.max_model_len,
    )
    return SimApp(engine, options)


def granian_app() -> SimApp:
    """Factory for granian (``firstbyte.router.sim.server:granian_app``), configured from the
    env."""
    quiet_drop_logs()
    return build_app(msgspec.json.decode(os.environ.get(CONFIG_ENV, "{}"), type=SimConfig))


def options(
    server: str,
    certfile: str | None = None,
    keyfile: str | None = None,
    *,
    keep_alive_timeout_s: float = 30.0,
    tune_gc: bool = False,
) -> ServerOptions:
    """How ``server`` (``uvicorn`` or ``hypercorn``) runs a sim: no lifespan (the engine's
    driver is started around it), no WebSockets, short drain. ``tune_gc``: the cyclic GC set
    as a router process has it (:mod:`firstbyte.router.hosting.gc_tuning`), for a sim that
    is a process of its own (``firstbyte sim``); a sim inside someone else's program (a
    test's) leaves it alone."""
    return ServerOptions(
        server=server,
        certfile=certfile,
        keyfile=keyfile,
        keep_alive_timeout_s=keep_alive_timeout_s,
        graceful_timeout_s=1.0,
        lifespan=False,
        tune_gc=tune_gc,
    )


@contextlib.asynccontextmanager
async def running_app(
    app: SimApp, listeners: Listeners, options: ServerOptions
) -> AsyncIterator[None]:
    """Serve ``app`` in the running loop for the duration of the block (its engine's driver
    with it)."""
    quiet_drop_logs()
    app.driver.start()
    try:
        async with hosting.running(app, listeners, options):
            yield
    finally:
        await app.driver.stop()


@dataclass(slots=True)
class SimServer:
    """A sim running in this process: its base URL (no ``/v1``), app and engine."""

    url: str
    app: SimApp
    port: int

    @property
    def engine(self) -> Engine:
        return self.app.engine


@contextlib.asynccontextmanager
async def sim_server(
    profile: str = "instant",
    *,
    host: str = "127.0.0.1",
    server: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    keep_alive_timeout_s: float = 30.0,
    **config: Any,
) -> AsyncIterator[SimServer]:
    """Start a real sim on ``host``:ephemeral port in the running loop; stop it on exit.

    ``keep_alive_timeout_s``: how long an idle client connection stays open (a benchmark
    whose connections wait out other targets' phases sets it past their length).

    ``config`` holds :class:`SimConfig` fields (``max_num_seqs``, ``prefix_cache_blocks``,
    ``queue_limit``, ``max_num_batched_tokens``, ``faults``, ``seed``, ``max_body_bytes``,
    ``served_model_names``, ``max_model_len``).
    With ``certfile`` the server is hypercorn (HTTP/2 via ALPN) unless ``server`` says
    otherwise, and the URL is https.
    """
    app = build_app(SimConfig(profile=profile, **config))
    chosen = server or ("hypercorn" if certfile else "uvicorn")
    listeners = hosting.bind(host, 0)
    serving = options(chosen, certfile, keyfile, keep_alive_timeout_s=keep_alive_timeout_s)
    async with running_app(app, listeners, serving):
        yield SimServer(url=listeners.url(tls=certfile is not None), app=app, port=listeners.port)


@contextlib.asynccontextmanager
async def running_sim(profile: str = "instant", **config: Any) -> AsyncIterator[str]:
    """Start a real sim in the running loop and yield its base URL (see :func:`sim_server`)."""
    async with sim_server(profile, **config) as sim:
        yield sim.url
