"""The checks a config needs beyond its schema: the files it names are there and usable.

:func:`check_files` opens every file the router will open at start-up, the way the router
opens it: the certificate and key are loaded as one pair (so a missing file, a swapped pair
or a key of another certificate fails here, naming both keys), the CA bundle is loaded, the
GeoIP database is opened, the warm-prefix files are read, and the ``otel`` extra must be
installed when traces are to be exported, the Redis password file (or variable) is read and
the Redis CA bundle loaded. ``firstbyte router --check-config`` and the router's start-up both
run it, so a config that passes the check starts.

:func:`key_warnings` names the keys still holding a shipped placeholder or too short to resist
guessing; ``--check-config`` prints one line per key, and still passes.

:func:`check_state` connects to ``state.redis_url`` (connect, AUTH, PING, bounded by
``state.timeout_s``): ``--check-config`` and the start-up run it too, so a wrong URL or
password fails there in one line instead of every request failing later. A reload does not
(the shared state cannot change in place, and Redis away must not stop a reload of keys).
It returns a warning for a Redis whose ``maxmemory-policy`` evicts keys once full (anything
but ``noeviction``): the router's streams, leases and per-key counts would go with them.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from .config import ConfigError, RouterConfig
from .hosting.tls_files import file_problem, tls_pair_problem

__all__ = [
    "MIN_KEY_CHARS", "PLACEHOLDER_MARK", "check_files", "check_state", "eviction_warning",
    "key_warnings",
    "tls_pair_problem",
]

MIN_KEY_CHARS = 16
"""Keys shorter than this get a warning from ``--check-config``: a generated key is 40 or more
(``"sk-" + secrets.token_urlsafe(32)``); under 16 characters a key was typed, not drawn."""

PLACEHOLDER_MARK = "replace-with"
"""What the shipped configs' placeholder secrets hold (``sk-replace-with-a-generated-key-0001``
in deploy/router.toml and the Kubernetes Secret): a router started with one accepts a key
that anyone who read the repository knows."""

_GENERATE = """python -c 'import secrets; print("sk-" + secrets.token_urlsafe(32))'"""


def check_files(config: RouterConfig, source: str = "<config>") -> None:
    """Raise :class:`ConfigError` (``SOURCE: KEY: reason``) for the first unusable file."""
    for check in (_tls_pair, _ca_bundle, _geo_database, _warm_prefix_files, _otel_extra,
                  _redis_credentials):
        reason = check(config)
        if reason is not None:
            raise ConfigError(f"{source}: {reason}")


def _tls_pair(config: RouterConfig) -> str | None:
    listen = config.listen
    if listen.certfile is None or listen.keyfile is None:
        return None  # the schema already said whether they are required
    return tls_pair_problem(listen.certfile, listen.keyfile)


def _ca_bundle(config: RouterConfig) -> str | None:
    path = config.upstream_ca_file
    if path is None:
        return None
    missing = file_problem("upstream_ca_file", path)
    if missing is not None:
        return missing
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError as exc:
        return f"upstream_ca_file: not a PEM CA bundle: {path} ({exc.reason or exc})"
    return None


def _geo_database(config: RouterConfig) -> str | None:
    path = config.geo.database
    if path is None:
        return None
    missing = file_problem("geo.database", path)
    if missing is not None:
        return missing
    try:
        from .geo import GeoLocator

        GeoLocator(path).close()
    except ImportError:
        return "geo.database: needs the router extra (pip install 'firstbyte[router]')"
    except (OSError, ValueError, RuntimeError) as exc:  # maxminddb's InvalidDatabaseError
        return f"geo.database: not a MaxMind DB file: {path} ({exc})"
    return None


def _warm_prefix_files(config: RouterConfig) -> str | None:
    for i, prefix in enumerate(config.warm_prefixes):
        if prefix.file is None:
            continue
        key = f"warm_prefixes[{i}].file"
        missing = file_problem(key, prefix.file)
        if missing is not None:
            return missing
        try:
            Path(prefix.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return f"{key}: cannot read {prefix.file} as UTF-8 text ({exc})"
    return None


def _otel_extra(config: RouterConfig) -> str | None:
    if config.telemetry.otlp_endpoint is None:
        return None
    from .observability.traces import otel_missing

    missing = otel_missing()
    if missing is not None:
        return f"telemetry.otlp_endpoint: {missing}"
    return None


def _redis_credentials(config: RouterConfig) -> str | None:
    state = config.state
    if state.redis_url is None:
        return None
    if state.redis_ca_file is not None:
        missing = file_problem("state.redis_ca_file", state.redis_ca_file)
        if missing is not None:
            return missing
        try:
            ssl.create_default_context(cafile=state.redis_ca_file)
        except ssl.SSLError as exc:
            return (f"state.redis_ca_file: not a PEM CA bundle: {state.redis_ca_file}"
                    f" ({exc.reason or exc})")
    from .shared.target import redis_target

    try:
        redis_target(state)
    except ConfigError as exc:
        return str(exc)
    return None


def key_warnings(config: RouterConfig) -> list[str]:
    """One line per secret of ``[auth]`` and ``routing.peer_key`` that is a shipped
    placeholder or shorter than :data:`MIN_KEY_CHARS`, naming its key, never its value.
    Warnings, not errors: a test deployment may want them."""
    auth = config.auth
    named: list[tuple[str, str | None]] = [
        *((f"auth.api_keys[{i}]", key) for i, key in enumerate(auth.api_keys)),
        *((f"auth.keys[{i}].key", entry.key) for i, entry in enumerate(auth.keys)),
        *((f"auth.metrics_keys[{i}]", key) for i, key in enumerate(auth.metrics_keys)),
        ("auth.token_secret", auth.token_secret),
        ("routing.peer_key", config.routing.peer_key),
    ]
    lines = []
    for name, value in named:
        if value is None:
            continue
        if PLACEHOLDER_MARK in value:
            lines.append(f"{name}: the placeholder of the shipped config: anyone who read it"
                         f" knows this key; generate one: {_GENERATE}")
        elif len(value) < MIN_KEY_CHARS:
            lines.append(f"{name}: {len(value)} characters, under {MIN_KEY_CHARS}: easy to"
                         f" guess; generate one: {_GENERATE}")
    return lines


def check_state(config: RouterConfig, source: str = "<config>") -> list[str]:
    """Raise :class:`ConfigError` naming ``state.redis_url`` if the shared state does not
    answer ``PING`` (after AUTH, when a password is given) within ``state.timeout_s``. The
    message never holds the password. Returns the warnings about what answered (see
    :func:`eviction_warning`)."""
    if config.state.redis_url is None:
        return []
    from .shared.target import redacted, redis_target

    try:
        target = redis_target(config.state)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    url = target.url
    try:
        import redis
    except ImportError:
        raise ConfigError(
            f"{source}: state.redis_url: needs redis-py (pip install 'firstbyte[redis]')"
        ) from None
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    timeout_s = config.state.timeout_s
    client = redis.Redis.from_url(  # one try: the bound is timeout_s, not a multiple of it
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0), **target.options(),
    )  # fmt: skip
    try:
        client.ping()
        try:  # INFO, not CONFIG GET: managed services and ACLs often refuse CONFIG
            memory: Any = client.info("memory")
        except redis.RedisError:
            memory = {}
    except redis.AuthenticationError as exc:
        if target.password_source is not None:
            fix = f"check the password in {target.password_source}"
        elif target.has_password():
            fix = "check the password in the URL"
        else:
            fix = ("Redis wants a password: state.redis_password_file, or"
                   " redis://:PASSWORD@HOST:PORT/DB")
        reason = f"authentication failed ({exc}): {fix}"
    except redis.ResponseError as exc:  # NOAUTH: a password is needed and none was given
        reason = f"refused PING ({exc})"
    except (redis.RedisError, OSError) as exc:
        reason = f"no answer within {timeout_s:g} s ({type(exc).__name__}: {exc})"
    else:
        warning = eviction_warning(memory)
        return [] if warning is None else [warning]
    finally:
        client.close()
    raise ConfigError(f"{source}: state.redis_url: cannot use {redacted(url)}: {reason}")


def eviction_warning(memory: dict[str, Any]) -> str | None:
    """A warning for a Redis (its ``INFO memory``) that evicts keys once full: the router's
    keys all have an expiry, so every policy but ``noeviction`` (``allkeys-*`` and
    ``volatile-*`` alike) drops them. Evicted, a stream ends as lost for its readers on
    other processes, a lease makes a live process look dead (its streams declared lost,
    its slots dropped), and a key's count or bucket lets it past its limits. ``None``
    without a ``maxmemory`` (nothing is evicted) or with ``noeviction``."""
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    if not memory.get("maxmemory") or policy == "noeviction":
        return None
    return (f"state.redis_url: maxmemory-policy is {policy}: once full, Redis evicts the"
            " router's streams, leases and per-key counts (resumes end as stream_lost,"
            " live streams may be declared lost, per-key limits stop holding); set"
            " maxmemory-policy noeviction (a full Redis then refuses new requests with"
            " 503 state_unavailable and keeps what it holds)")
