"""Reload: a new config swapped into a running router without dropping a stream or a connection.

SIGHUP (or ``firstbyte router reload``) makes the router read its config again, check it as
``--check-config`` does, and then either swap it in (:meth:`RouterApp.reconfigure`) or keep the
running one and log one line saying why. What can change in place: API and metrics keys, peers,
warm prefixes, upstreams, routing and warmup settings, the per-key and per-request limits, the
stream store's bounds and the drain timings. What cannot (:data:`RESTART_KEYS`: the sockets, the
TLS files, the workers, the shared state, the upstream connection pools' settings, the
connection limits the server enforces, traces) is refused by name: restart to change it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from .config import ConfigError, RouterConfig

if TYPE_CHECKING:
    from .app import RouterApp

__all__ = [
    "RESTART_KEYS",
    "SHARED_RESTART_KEYS",
    "Reloader",
    "changed_keys",
    "needs_restart",
    "reload_summary",
]

log = logging.getLogger("firstbyte.router")

RESTART_KEYS = (
    "region",
    "listen",
    "state",
    "telemetry",
    "upstream_ca_file",
    "limits.upstream_connect_timeout_s",
    "limits.upstream_read_timeout_s",
    "limits.upstream_keepalive_expiry_s",
    "limits.upstream_max_connections",
    "limits.client_header_timeout_s",
    "limits.client_send_timeout_s",
    "limits.max_connections_per_client",
    "limits.hard_max_connections_per_client",
    "limits.reserved_fds",
    "limits.h2_max_early_resets",
    "limits.h2_early_resets_per_s",
    "limits.max_request_line_bytes",
    "limits.max_header_line_bytes",
    "limits.max_header_bytes",
    "limits.max_headers",
    "limits.quic_retry_above_handshakes_per_s",
    # Built once at start (router/state.py): the timing reports' counters and label tables.
    "client_timings.max_countries",
    "client_timings.max_countries_per_key",
    "client_timings.max_records_per_report",
    "client_timings.reports_per_s_per_key",
    "client_timings.report_burst_per_key",
)
"""Keys (or whole sections) a reload cannot change: the process must restart."""

SHARED_RESTART_KEYS = ("streams.max_age_s", "streams.resume_grace_s", "routing.affinity_ttl_s")
"""Keys a reload cannot change while the state is shared (``state.redis_url``): the shared
state's expiries and reader grace are built from them at start (``router/shared``), so a
reload would change this process's own store and not what it writes to Redis."""

IN_PLACE_LISTEN_KEYS = ("listen.drain_timeout_s", "listen.drain_grace_s")
"""The ``listen`` keys a reload may change (read when a drain starts)."""


def _flat(config: RouterConfig) -> dict[str, Any]:
    """``{"listen.port": 8443, "upstreams": [...], ...}``: tables flattened one level."""
    out: dict[str, Any] = {}
    for key, value in msgspec.to_builtins(config).items():
        if isinstance(value, dict):
            for inner, item in value.items():
                out[f"{key}.{inner}"] = item
        else:
            out[key] = value
    return out


def changed_keys(old: RouterConfig, new: RouterConfig) -> list[str]:
    """The keys whose value differs (a list-valued key such as ``upstreams`` as a whole)."""
    before, after = _flat(old), _flat(new)
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def _by_name(entries: str, old: dict[str, Any], new: dict[str, Any]) -> str:
    """``added c; removed b; a1: weight``: which entries came, went, and which fields of those
    that stayed changed (field names only: an upstream's ``api_key`` is a secret)."""
    parts = [f"added {name}" for name in new if name not in old]
    parts += [f"removed {name}" for name in old if name not in new]
    for name in (n for n in new if n in old):
        fields = sorted(
            k for k in old[name].keys() | new[name].keys() if old[name].get(k) != new[name].get(k)
        )
        if fields:
            parts.append(f"{name}: {', '.join(fields)}")
    return f"{entries} ({'; '.join(parts)})" if parts else entries


def reload_summary(old: RouterConfig, new: RouterConfig) -> str:
    """What a reload changed, for its log line: the changed keys, and for ``upstreams`` and
    ``peers`` which ones were added, removed or changed by name (``upstreams (added c; removed
    b; a1: weight)``), so an operator can tell from the log what the new config did."""

    def upstreams(config: RouterConfig) -> dict[str, Any]:
        return {u.backend_name: msgspec.to_builtins(u) for u in config.upstreams}

    def peers(config: RouterConfig) -> dict[str, Any]:
        return {p.name: msgspec.to_builtins(p) for p in config.peers}

    named = {"upstreams": upstreams, "peers": peers}
    said = [
        _by_name(key, named[key](old), named[key](new)) if key in named else key
        for key in changed_keys(old, new)
    ]
    return ", ".join(said) + " changed" if said else "nothing changed"


def needs_restart(old: RouterConfig, new: RouterConfig) -> list[str]:
    """The changed keys a reload cannot apply (see :data:`RESTART_KEYS`, and
    :data:`SHARED_RESTART_KEYS` with shared state)."""
    restart = RESTART_KEYS + (SHARED_RESTART_KEYS if old.state.redis_url else ())
    return [
        key
        for key in changed_keys(old, new)
        if key not in IN_PLACE_LISTEN_KEYS
        and any(key == r or key.startswith(r + ".") for r in restart)
    ]


class Reloader:
    """Reload ``app`` from ``load()`` (the config file read and checked again, a
    :class:`ConfigError` if it fails), one reload at a time."""

    def __init__(self, app: RouterApp, load: Callable[[], RouterConfig]) -> None:
        self.app = app
        self.load = load
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[bool]] = set()

    def signalled(self) -> None:
        """The SIGHUP handler: start a reload in the running loop."""
        task = asyncio.ensure_future(self.reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reload(self) -> bool:
        """Swap in the new config, or keep the running one and log why; True if swapped."""
        async with self._lock:
            current = self.app.state.config
            try:
                new = self.load()
            except ConfigError as exc:
                log.error("reload refused, the running config stays: %s", exc)
                return False
            fixed = needs_restart(current, new)
            if fixed:
                log.error(
                    "reload refused, the running config stays: %s cannot change on reload;"
                    " restart the router to change %s",
                    ", ".join(fixed),
                    "it" if len(fixed) == 1 else "them",
                )
                return False
            # Names only, never values: auth.api_keys and peer keys are secrets.
            said = reload_summary(current, new)
            await self.app.reconfigure(new)
            log.info("config reloaded: %s", said)
            return True
