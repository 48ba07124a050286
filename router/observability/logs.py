"""The router's logs: one JSON (or text) line per record on stdout, libraries kept quiet.

:func:`configure` installs the one handler. At ``info`` (the default) a router prints its
start-up line, one access line per request (:mod:`.access`) and a line per upstream or peer
state change (:class:`StateChanges`); the HTTP libraries under it (httpx, httpcore, h2,
hpack, hypercorn, uvicorn, aioquic) speak only at ``warning`` and above unless the level is
``debug``.

A JSON line is an object with ``time`` (UTC, ISO 8601, milliseconds), ``level``, ``logger``,
``msg`` and, for access lines, the fields of the record passed as ``extra={"fields": {...}}``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TextIO

import msgspec

__all__ = [
    "LEVELS",
    "JsonFormatter",
    "LogFormat",
    "StateChanges",
    "TextFormatter",
    "configure",
    "key_id",
    "set_worker",
    "struct_fields",
    "subject_id",
    "write_direct",
]

LogFormat = Literal["json", "text"]
LEVELS = ("debug", "info", "warning", "error")

QUIET_LIBRARIES = (
    "httpx",  # one line per request: the backend scrapes and peer polls alone are several/s
    "httpcore",
    "h2",
    "hpack",
    "hypercorn",
    "uvicorn",
    "quic",  # aioquic's connection logger
    "aioquic",
    "asyncio",
)
"""Loggers held at ``warning`` unless the level is ``debug``."""

SECRET_LOGGING_LIBRARIES = ("hpack", "h2")
"""Loggers never let down to ``debug``: they log decoded header values there, the API key
among them. (The hosting layer holds them above it on import too; this holds them whatever
was imported before :func:`configure`.)"""

_ENCODER = msgspec.json.Encoder(enc_hook=str)

_LEVEL_NAMES = logging._levelToName
"""The table :func:`logging.getLevelName` reads first (the dict itself: ``addLevelName``
changes it in place)."""

_worker: int | None = None
"""This process's worker slot when it is one of ``listen.workers > 1`` (:func:`set_worker`):
every line then says which process wrote it."""

_FIELDS = "fields"
"""The ``extra`` key carrying a record's structured fields."""


# The digests of the keys and subjects seen last, each worked out once: one application
# sends thousands of streams under one key, often for one user, and a SHA-256 is ~6k
# instructions a request each (the access line of every keyed request names both). Bounded:
# a configured key's set is small, but an anonymous router takes any bearer string as the key
# (up to a header line, 8 KiB) and subjects come from requests and client tokens (up to
# MAX_SUBJECT_CHARS each), as many as clients care to send; past the bound the least recent
# is dropped and worked out again if it comes back. A hit is one call in C (lru_cache's),
# no Python frame.
@functools.lru_cache(maxsize=1024)
def key_id(api_key: str | None) -> str | None:
    """A short, stable digest naming an API key in logs and traces; never the key itself.

    12 hex digits of a domain-separated SHA-256: enough to tell a deployment's keys apart
    and to grep for one (``firstbyte``-side only; the key cannot be recovered from it).
    The last 1024 keys' digests are kept (see above).
    """
    if not api_key:
        return None
    return hashlib.sha256(b"firstbyte-key-id\0" + api_key.encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=4096)  # bounded: see key_id's
def subject_id(subject: str | None) -> str | None:
    """The same kind of digest for a request's subject (an app's end user): usage per
    subject can be summed from the access lines without logging who the user is. The last
    4096 subjects' digests are kept."""
    if not subject:
        return None
    return hashlib.sha256(b"firstbyte-subject-id\0" + subject.encode()).hexdigest()[:12]


def set_worker(index: int) -> None:
    """Called in a forked worker (:mod:`firstbyte.router.workers`) before it serves: its
    lines carry ``worker`` (the slot, 0 to N-1), so the lines of N processes writing to one
    stdout can be told apart; a single process's lines have no such field."""
    global _worker
    _worker = index


Fields = Mapping[str, Any] | msgspec.Struct
"""A line's fields: a mapping, or a struct whose members are the fields in their order, a
member set to ``msgspec.UNSET`` left out (:class:`.access.AccessLine`)."""

_LINE_MEMBERS = frozenset({"time", "level", "logger", "msg", "worker", "exc"})
_DISJOINT: dict[type, bool] = {}
"""Per struct type: are its members' names none of a line's own (:data:`_LINE_MEMBERS`)?"""


def struct_fields(fields: msgspec.Struct) -> dict[str, Any]:
    """A struct's fields as the mapping a line is made of (``UNSET`` members left out)."""
    return {
        name: value
        for name, value in zip(fields.__struct_fields__, msgspec.structs.astuple(fields),
                               strict=True)
        if value is not msgspec.UNSET
    }


def _fields(record: logging.LogRecord) -> Mapping[str, Any]:
    fields = getattr(record, _FIELDS, None)
    return fields if isinstance(fields, Mapping) else {}


_MILLIS = tuple(f".{millis:03d}Z" for millis in range(1000))
"""A timestamp's ending for each count of milliseconds (``.250Z``)."""
_MILLIS_JSON = tuple(f'{ending}"'.encode() for ending in _MILLIS)
"""The same endings closing a JSON string (``.250Z"``)."""


class _Timestamps:
    """A time (``time.time()``) as UTC ISO 8601 with milliseconds (``...T12:00:00.250Z``),
    the milliseconds as a LogRecord counts them; the seconds' text is made once a second,
    not once a line."""

    __slots__ = ("second", "text")

    def __init__(self) -> None:
        self.second = -1
        self.text = ""

    def format(self, created: float) -> str:
        """``created`` as UTC ISO 8601 with milliseconds. A method, not ``__call__``: calling
        an instance takes the slower way through its type's ``tp_call`` slot."""
        second = int(created)
        if second != self.second:
            self.second = second
            self.text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        millis = int((created - second) * 1000)
        if 0 <= millis < 1000:  # any time after 1970: the ending made once, not formatted
            return self.text + _MILLIS[millis]
        return f"{self.text}.{millis:03d}Z"


_MIDDLES: dict[tuple[str, str, int | None], tuple[bytes, bytes]] = {}
"""Per level name, logger name and worker: a JSON line's bytes between its time and its
``msg`` (``,"level":...,"logger":...,"msg":``) and after its ``msg`` (``,"worker":N`` or
nothing), as the line's dict encodes them."""


def _middle(level: str, logger: str) -> tuple[bytes, bytes]:
    """:data:`_MIDDLES`'s entry for a line of ``logger`` at ``level`` in this process (made
    and kept: one a logger and level, few; past 256, they are made again)."""
    head = _ENCODER.encode({"level": level.lower(), "logger": logger})
    tail = b"" if _worker is None else b',"worker":' + _ENCODER.encode(_worker)
    middle = (b"," + head[1:-1] + b',"msg":', tail)
    if len(_MIDDLES) >= 256:
        _MIDDLES.clear()
    _MIDDLES[(level, logger, _worker)] = middle
    return middle


class _LineFormatter(logging.Formatter):
    """A formatter whose line can be made from its parts, without a LogRecord
    (:func:`write_direct`)."""

    def __init__(self) -> None:
        super().__init__()
        self._timestamp = _Timestamps()

    def format(self, record: logging.LogRecord) -> str:
        return self.line(
            record.created, record.levelname, record.name, record.getMessage(), _fields(record),
            self.formatException(record.exc_info) if record.exc_info else None,
        )

    def line(
        self, created: float, level: str, logger: str, msg: str, fields: Fields,
        exc: str | None = None,
    ) -> str:
        """The line of a record of ``logger`` at ``level`` (``INFO``...) made at ``created``."""
        raise NotImplementedError


class JsonFormatter(_LineFormatter):
    """One JSON object per line (``time``, ``level``, ``logger``, ``msg``, then the fields).

    Encoded by msgspec (a value it cannot encode is written as its ``str``): there is an
    access line a request, and the standard library's encoder took ~15 times as long for one,
    giving the same bytes."""

    def __init__(self) -> None:
        super().__init__()
        self._second = math.inf
        """The second (a float, whole) whose text :attr:`_head` holds; none yet: inf."""
        self._head = bytearray()
        """``{"time":"`` and the text of the second ``_second`` (the JSON encoding of
        ``_timestamp.text`` without its closing quote): a struct's line starts with a copy
        of it (a bytearray's copy: a third of ``bytearray(bytes)``'s instructions)."""

    def line(
        self, created: float, level: str, logger: str, msg: str, fields: Fields,
        exc: str | None = None,
    ) -> str:
        if not exc and isinstance(fields, msgspec.Struct):
            # A struct's members after the line's, as the dict's below: its names encoded
            # once by msgspec, not each as a dict's key, and no dict made (an access line).
            # The line's own members between time and msg, and worker after it, are the
            # same bytes for each line of a logger at a level: encoded once (_middle), not
            # a dict of 4 made and encoded a line.
            kind = type(fields)
            disjoint = _DISJOINT.get(kind)
            if disjoint is None:
                disjoint = _DISJOINT[kind] = _LINE_MEMBERS.isdisjoint(fields.__struct_fields__)
            if disjoint:
                try:
                    middle = _MIDDLES.get((level, logger, _worker))
                    if middle is None:
                        middle = _middle(level, logger)
                    # The time as _Timestamps.format makes it, its second's part encoded
                    # once a second (_head), its ending from _MILLIS_JSON. Within _head's
                    # second int(created) is that second: one int() a line, not two.
                    second = self._second
                    millis = (int((created - second) * 1000)
                              if second <= created < second + 1.0 else 1000)
                    if millis < 1000:
                        buffer = self._head.copy()
                        buffer += _MILLIS_JSON[millis]
                    else:
                        buffer = bytearray(b'{"time":')
                        _ENCODER.encode_into(self._timestamp.format(created), buffer, 8)
                        # A second before 1970 is not kept: int() does not floor it.
                        whole = self._timestamp.second
                        self._second = float(whole) if whole >= 0 else math.inf
                        self._head = bytearray(
                            b'{"time":' + _ENCODER.encode(self._timestamp.text)[:-1])
                    buffer += middle[0]
                    _ENCODER.encode_into(msg, buffer, len(buffer))
                    buffer += middle[1]
                    brace = len(buffer)
                    _ENCODER.encode_into(fields, buffer, brace)
                    if len(buffer) > brace + 2:  # some member: "{" made the ","
                        buffer[brace] = 44
                        return buffer.decode()
                except (TypeError, ValueError, UnicodeDecodeError):
                    pass  # as the merged object fails: below
            fields = struct_fields(fields)
        line: dict[str, Any] = {
            "time": self._timestamp.format(created),
            "level": level.lower(),
            "logger": logger,
            "msg": msg,
        }
        if _worker is not None:
            line["worker"] = _worker
        if isinstance(fields, msgspec.Struct):
            fields = struct_fields(fields)
        # The fields' keys tested against the line's 4 or 5 members, not each of an access
        # line's ~25 fields looked up in the line: one lookup a member.
        disjoint = fields.keys().isdisjoint(line)
        if disjoint and fields and not exc and type(fields) is dict:
            # The line's members and the fields encoded one after the other into one buffer,
            # the fields' ``{`` made the ``,`` between: the bytes of the merged object's
            # encoding, without merging an access line's ~25 fields into a second dict.
            try:
                buffer = bytearray()
                _ENCODER.encode_into(line, buffer)
                brace = len(buffer) - 1
                _ENCODER.encode_into(fields, buffer, brace)
                buffer[brace] = 44  # ","
                return buffer.decode()
            except (TypeError, ValueError, UnicodeDecodeError):
                pass  # as the merged object fails: below
        if disjoint:
            line.update(fields)
        else:  # a field named as a line's own member is not written over it
            for name, value in fields.items():
                line.setdefault(name, value)
        if exc:
            line["exc"] = exc
        try:
            return _ENCODER.encode(line).decode()
        except (TypeError, ValueError, UnicodeDecodeError):  # lone surrogates, odd keys
            return json.dumps(line, separators=(",", ":"), default=str, ensure_ascii=False)


class TextFormatter(_LineFormatter):
    """``TIME LEVEL LOGGER: MSG key=value ...`` for a terminal."""

    def line(
        self, created: float, level: str, logger: str, msg: str, fields: Fields,
        exc: str | None = None,
    ) -> str:
        text = f"{self._timestamp.format(created)} {level} {logger}: {msg}"
        if isinstance(fields, msgspec.Struct):
            fields = struct_fields(fields)
        if _worker is not None:
            fields = {"worker": _worker, **fields}
        pairs = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        if pairs:
            text += " " + pairs
        if exc:
            text += "\n" + exc
        return text


class _LineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The one handler :func:`configure` installs (:func:`write_direct` writes to it)."""


def write_direct(logger: logging.Logger, level: int, msg: str, fields: Fields) -> bool:
    """Write a record of ``logger`` at ``level`` (enabled: the caller asked) with ``fields``
    (a mapping, or a struct: :data:`Fields`) as its ``extra`` straight to the handler
    :func:`configure` installed, without making a LogRecord, when that handler is the only
    place it would go: no handler, filter or disabled logger on its way up to the root, whose
    only handler is ours, unfiltered and at ``level`` or below. The line is the one its
    formatter makes of the same record. False (nothing written) otherwise, or if the write
    failed: the caller logs the standard way.

    An access line a request went through ``Logger.handle``: a LogRecord of ~20 fields, the
    logger hierarchy's handlers and the handler's locks, ~0.1M instructions of the ~1.5M a
    request costs the router (``firstbyte.benchmarks.chunk_instructions``)."""
    if logger.filters or logger.disabled:
        return False
    current: Any = logger
    while current.parent is not None:
        if current.handlers or not current.propagate:
            return False
        current = current.parent
    handlers = current.handlers
    if len(handlers) != 1:
        return False
    handler = handlers[0]
    if type(handler) is not _LineHandler or handler.filters or handler.level > level:
        return False
    formatter = handler.formatter
    if not isinstance(formatter, _LineFormatter):
        return False
    try:
        # getLevelName's own first lookup, without its call (the same live table).
        name = _LEVEL_NAMES.get(level) or logging.getLevelName(level)
        line = formatter.line(time.time(), name, logger.name, msg, fields)
        # acquire and release, as logging's Handler.acquire does: a with statement looks up
        # and calls the lock's __enter__ and __exit__, ~1.2k instructions more a line.
        lock = handler.lock
        lock.acquire()  # type: ignore[union-attr]
        try:
            stream = handler.stream
            stream.write(line + handler.terminator)
            stream.flush()
        finally:
            lock.release()  # type: ignore[union-attr]
    except Exception:  # the standard path tries again and reports it as logging does
        return False
    return True


def configure(
    level: str = "info", fmt: LogFormat = "json", stream: TextIO | None = None
) -> logging.Handler:
    """Send every log record to ``stream`` (default stdout) at ``level``, one line each.

    Replaces the root logger's handlers (this is a router process's logging) and holds the
    libraries in :data:`QUIET_LIBRARIES` at ``warning`` unless ``level`` is ``debug``.
    """
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
    handler = _LineHandler(stream or sys.stdout)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # No formatter here prints a record's thread or process: not looked up per record (the
    # logging HOWTO's "Optimization"; a getpid() system call per access line otherwise).
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    library_level = logging.DEBUG if level == "debug" else logging.WARNING
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(library_level)
    for name in SECRET_LOGGING_LIBRARIES:  # never at DEBUG, whatever was imported when
        logging.getLogger(name).setLevel(max(library_level, logging.INFO))
    return handler


class StateChanges:
    """Logs each thing's up/down state once per change, not once per observation.

    Everything starts up. The first ``down`` after an ``up`` is a warning naming the reason;
    the first ``up`` after a ``down`` is an info line; repeats say nothing.
    """

    def __init__(self, log: logging.Logger, kind: str) -> None:
        self.log = log
        self.kind = kind
        """What the things are (``upstream``, ``peer``), the first word of each line."""
        self.down_since: dict[str, str] = {}
        """Things now down, with the reason given when they went down."""

    def carry(self, previous: StateChanges, names: Iterable[str]) -> None:
        """Take over what ``previous`` (a reloaded service's) reported down, for ``names``
        (the things that stay): still down is then no change, and says nothing again."""
        for name in names:
            if name in previous.down_since:
                self.down_since[name] = previous.down_since[name]

    def down(self, name: str, reason: str, *, url: str = "") -> bool:
        """``name`` is down; True (and a warning) if that is a change."""
        if name in self.down_since:
            return False
        self.down_since[name] = reason
        where = f" ({url})" if url else ""
        self.log.warning(
            "%s %s%s is down: %s",
            self.kind,
            name,
            where,
            reason,
            extra={_FIELDS: {"event": f"{self.kind}_down", self.kind: name, "reason": reason}},
        )
        return True

    def up(self, name: str, *, url: str = "") -> bool:
        """``name`` answers; True (and an info line) if it was down."""
        if self.down_since.pop(name, None) is None:
            return False
        where = f" ({url})" if url else ""
        self.log.info(
            "%s %s%s is up again",
            self.kind,
            name,
            where,
            extra={_FIELDS: {"event": f"{self.kind}_up", self.kind: name}},
        )
        return True


def describe_error(exc: BaseException) -> str:
    """``ConnectError: [Errno 111] Connection refused`` (the type alone if no message)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
