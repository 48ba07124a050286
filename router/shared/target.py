"""Where the shared state is and how to log in to it: ``[state]`` -> what redis-py connects with.

The password may sit in ``state.redis_url`` (``redis://:PASSWORD@host``), but a URL in a
config file is a secret in a file that also holds everything else; so it may come instead
from ``state.redis_password_file`` (a mounted Kubernetes Secret, a root-only file) or from the
environment variable ``state.redis_password_env``, read once at start. The user name (an ACL
user) stays in the URL: ``redis://firstbyte@host:6379/0``. ``rediss://`` is TLS, verified
against ``state.redis_ca_file`` (a private CA) or the system's bundle.

Nothing here imports redis-py, and the password never reaches a log line or a terminal:
:func:`redacted` is what every message that names the URL prints, and
:class:`RedisTarget`'s ``repr`` and ``str`` are redacted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from ..config import ConfigError, StateConfig

__all__ = ["RedisTarget", "redacted", "redis_target"]

_SECRET_QUERY_KEYS = frozenset({"password", "ssl_password"})
"""Query arguments redis-py also reads a password from (``?password=...``)."""


@dataclass(frozen=True)
class RedisTarget:
    """The URL and the connection options redis-py's ``from_url`` takes besides it."""

    url: str
    password: str | None = field(default=None, repr=False)
    """From the file or the environment; ``None``: the URL's own, or none."""
    password_source: str | None = None
    """Which key the password came from (``state.redis_password_file``), for messages."""
    ca_file: str | None = None

    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``Redis.from_url`` / ``ConnectionPool.from_url``."""
        options: dict[str, Any] = {}
        if self.password is not None:
            options["password"] = self.password
        if self.ca_file is not None:
            options["ssl_ca_certs"] = self.ca_file
        return options

    def has_password(self) -> bool:
        return self.password is not None or _url_password(self.url) is not None

    def __str__(self) -> str:
        return redacted(self.url)

    def __repr__(self) -> str:
        return f"RedisTarget({redacted(self.url)!r})"


def redis_target(state: StateConfig, environ: Mapping[str, str] | None = None) -> RedisTarget:
    """``state``'s URL with the password read from its file or variable; a
    :class:`ConfigError` naming the key when that cannot be read or is empty."""
    if state.redis_url is None:
        raise ValueError("no state.redis_url")
    try:  # redis-py would raise urllib's ValueError, a traceback at start
        parts = urlsplit(state.redis_url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"state.redis_url: {redacted(state.redis_url)}: {exc}") from None
    if port == 0:
        raise ConfigError(f"state.redis_url: {redacted(state.redis_url)}: port 0")
    password: str | None = None
    source: str | None = None
    if state.redis_password_file is not None:
        source = "state.redis_password_file"
        path = state.redis_password_file
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(f"{source}: cannot read {path}: {reason}") from None
        # One trailing newline is the editor's (or `echo`'s), not the password's.
        password = text.removesuffix("\n").removesuffix("\r")
        if not password:
            raise ConfigError(f"{source}: empty file: {path}")
    elif state.redis_password_env is not None:
        source = "state.redis_password_env"
        name = state.redis_password_env
        password = (os.environ if environ is None else environ).get(name)
        if not password:
            raise ConfigError(f"{source}: the environment variable {name} is not set or empty")
    return RedisTarget(state.redis_url, password, source, state.redis_ca_file)


def _url_password(url: str) -> str | None:
    try:
        parts = urlsplit(url)
        in_netloc = parts.password
    except ValueError:
        return None
    if in_netloc is not None:
        return in_netloc
    for key, value in parse_qsl(parts.query):
        if key in _SECRET_QUERY_KEYS:
            return value
    return None


def redacted(url: str) -> str:
    """``url`` with any password in it (``:PASSWORD@``, ``?password=``) written ``***``: what
    a log line or an error message may print."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<a redis URL that cannot be parsed>"
    text = url
    userinfo, at, host = parts.netloc.rpartition("@")  # the last @: a password may hold one
    if at and ":" in userinfo:
        text = text.replace(parts.netloc, f"{userinfo.partition(':')[0]}:***@{host}", 1)
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if any(key in _SECRET_QUERY_KEYS for key, _ in pairs):
            query = urlencode(
                [(k, "***" if k in _SECRET_QUERY_KEYS else v) for k, v in pairs], safe="*/"
            )
            text = text.rpartition("?")[0] + "?" + query
    return text
