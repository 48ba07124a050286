"""The PROXY protocol (HAProxy's, versions 1 and 2): the client's address as an L4 balancer
(HAProxy ``send-proxy``, AWS NLB, a cloud balancer) states it at the start of the TCP
connection it opens to the router, before any TLS or HTTP byte.

Sans-IO: :func:`parse` takes the bytes a connection has sent so far and answers a
:class:`ProxyHeader`, :data:`NEED_MORE` or a :class:`ProxyError`; :class:`HeaderWait` is one
connection's wait for them, whether it comes from a listed balancer (the header is required)
or from anyone else (a header is refused: never trusted). :class:`ProxyProtocol` is the
policy (which addresses may send it). Nothing here touches a socket or a clock; the accept
layer (:mod:`.accept`, :mod:`.uvicorn_limits`) feeds it and runs the timer.

Spec: https://www.haproxy.org/download/2.9/doc/proxy-protocol.txt. A header is at most
:data:`V1_MAX_BYTES` (v1, the spec's bound) or :data:`V2_MAX_BYTES` (v2: 16 bytes and the
address block, TLVs included; the spec allows 64 KiB, balancers send a few hundred bytes).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "NEED_MORE",
    "V1_MAX_BYTES",
    "V2_MAX_BYTES",
    "V2_SIGNATURE",
    "HeaderWait",
    "NeedMore",
    "Proxied",
    "ProxyError",
    "ProxyHeader",
    "ProxyProtocol",
    "parse",
    "with_client",
]

V1_PREFIX: Final = b"PROXY "
V1_MAX_BYTES: Final = 107
"""The longest v1 line, ``\\r\\n`` included (the spec's bound: ``UNKNOWN`` with two IPv6
addresses and two ports at their longest)."""
V2_SIGNATURE: Final = b"\r\n\r\n\x00\r\nQUIT\n"
V2_MAX_BYTES: Final = 16 + 2048
"""The longest v2 header accepted: its 16 fixed bytes and an address block with TLVs of up
to 2 KiB (AWS NLB's VPC endpoint id, an SNI, a unique id and SSL details fit many times)."""


@dataclass(frozen=True, slots=True)
class ProxyHeader:
    """A complete header: what it says and how many bytes it took."""

    version: int
    """1 (text) or 2 (binary)."""
    source: tuple[str, int] | None
    """The client's address and port; None for a ``LOCAL`` connection (the balancer's own
    health check), ``UNKNOWN`` (v1) or an address family without one (v2 ``UNSPEC``,
    ``UNIX``): the connection's own address stands."""
    destination: tuple[str, int] | None
    length: int


class NeedMore:
    """Not enough bytes yet to tell (the header's end has not arrived)."""

    def __repr__(self) -> str:
        return "NEED_MORE"


NEED_MORE: Final = NeedMore()


@dataclass(frozen=True, slots=True)
class ProxyError:
    """Not a valid header (or too long): the connection is closed."""

    reason: str


def parse(data: bytes) -> ProxyHeader | NeedMore | ProxyError:
    """The PROXY header (v1 or v2) at the start of ``data``, the first bytes of a connection.
    Whatever follows the header is the client's (``data[header.length:]``)."""
    if data[:1] == b"P":
        if not data.startswith(V1_PREFIX):
            return NEED_MORE if V1_PREFIX.startswith(data) else ProxyError("not a PROXY header")
        return _parse_v1(data)
    if data[:1] == b"\r":
        if not data.startswith(V2_SIGNATURE):
            return NEED_MORE if V2_SIGNATURE.startswith(data) else ProxyError("not a PROXY header")
        return _parse_v2(data)
    return NEED_MORE if not data else ProxyError("not a PROXY header")


def starts_like_header(data: bytes) -> bool | None:
    """Whether ``data`` (a connection's first bytes) begins with a PROXY signature; None
    while it is a prefix of one (an HTTP/1.1 request may begin with CRLF, the v2 signature's
    start; the HTTP/2 preface with ``P``)."""
    for signature in (V1_PREFIX, V2_SIGNATURE):
        if data.startswith(signature):
            return True
        if signature.startswith(data):
            return None
    return False


def _parse_v1(data: bytes) -> ProxyHeader | NeedMore | ProxyError:
    end = data.find(b"\r\n", 0, V1_MAX_BYTES)
    if end < 0:
        if len(data) >= V1_MAX_BYTES:
            return ProxyError(f"v1 header longer than {V1_MAX_BYTES} bytes")
        if b"\n" in data or b"\r" in data[:-1]:
            return ProxyError("v1 header not ended by CRLF")
        return NEED_MORE
    line = data[len(V1_PREFIX) : end]
    length = end + 2
    if line.startswith(b"UNKNOWN"):  # the rest of the line is ignored (spec 2.1)
        return ProxyHeader(1, None, None, length)
    parts = line.split(b" ")
    if len(parts) != 5 or parts[0] not in (b"TCP4", b"TCP6"):
        return ProxyError("v1 header is not TCP4/TCP6 with two addresses and two ports")
    family = ipaddress.IPv4Address if parts[0] == b"TCP4" else ipaddress.IPv6Address
    if b"%" in parts[1] or b"%" in parts[2]:  # a scope id names an interface of the balancer's
        return ProxyError(f"v1 header: not {parts[0].decode()} addresses")
    try:
        source = family(parts[1].decode("ascii"))
        destination = family(parts[2].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return ProxyError(f"v1 header: not {parts[0].decode()} addresses")
    ports = [_port(p) for p in parts[3:]]
    if ports[0] is None or ports[1] is None:
        return ProxyError("v1 header: a port is not a number from 0 to 65535")
    return ProxyHeader(1, (str(source), ports[0]), (str(destination), ports[1]), length)


def _port(text: bytes) -> int | None:
    if not text.isdigit() or len(text) > 5 or (len(text) > 1 and text[:1] == b"0"):
        return None
    value = int(text)
    return value if value <= 65535 else None


_INET, _INET6, _UNIX = 0x1, 0x2, 0x3
_STREAM = 0x1


def _parse_v2(data: bytes) -> ProxyHeader | NeedMore | ProxyError:
    if len(data) < 16:
        return NEED_MORE
    version, command = data[12] >> 4, data[12] & 0xF
    if version != 2:
        return ProxyError(f"v2 header: version {version}")
    if command > 1:
        return ProxyError(f"v2 header: command {command} is neither LOCAL nor PROXY")
    block = int.from_bytes(data[14:16], "big")
    length = 16 + block
    if length > V2_MAX_BYTES:
        return ProxyError(f"v2 header of {length} bytes, more than {V2_MAX_BYTES}")
    if len(data) < length:
        return NEED_MORE
    family, transport = data[13] >> 4, data[13] & 0xF
    if family > _UNIX or transport > 2:
        return ProxyError(f"v2 header: unknown address family or protocol 0x{data[13]:02x}")
    if command == 0 or family == 0 or family == _UNIX:
        # LOCAL (the balancer's health check) or no IP address: the connection's stands.
        return ProxyHeader(2, None, None, length)
    if transport != _STREAM:
        return ProxyError("v2 header: not a TCP connection")
    size = 4 if family == _INET else 16
    if block < 2 * size + 4:
        return ProxyError("v2 header: address block too short for its family")
    addresses = data[16 : 16 + 2 * size + 4]
    make = ipaddress.IPv4Address if family == _INET else ipaddress.IPv6Address
    source = make(addresses[:size])
    destination = make(addresses[size : 2 * size])
    sport = int.from_bytes(addresses[2 * size : 2 * size + 2], "big")
    dport = int.from_bytes(addresses[2 * size + 2 :], "big")
    return ProxyHeader(2, (str(source), sport), (str(destination), dport), length)


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class ProxyProtocol:
    """Which peers must start their connections with a PROXY header (``listen.proxy_protocol``
    with ``listen.proxy_protocol_from``): the balancers; anyone else may not send one."""

    def __init__(self, balancers: Iterable[str]) -> None:
        self.balancers: tuple[IPNetwork, ...] = tuple(
            ipaddress.ip_network(b, strict=False) for b in balancers
        )

    def trusts(self, peer: str) -> bool:
        """Whether ``peer`` (a connection's address, as the socket gives it) is a balancer."""
        try:
            address = ipaddress.ip_address(peer.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a dual-stack socket's view of an IPv4 peer
        return any(address in net for net in self.balancers)


@dataclass(frozen=True, slots=True)
class Proxied:
    """A wait's end: the header's client address (None: the connection's own stands) and the
    bytes that followed the header (the client's, to be read next)."""

    source: tuple[str, int] | None
    rest: bytes


class HeaderWait:
    """One connection's first bytes, up to its PROXY header (``trusted``: from a balancer,
    which must send one) or until they show none (anyone else, who may not).

    :meth:`feed` answers :data:`NEED_MORE`, a :class:`ProxyError` (close the connection), or
    :class:`Proxied` once the connection may go on."""

    def __init__(self, trusted: bool) -> None:
        self.trusted = trusted
        self._data = b""

    def feed(self, data: bytes) -> Proxied | NeedMore | ProxyError:
        self._data += data
        if not self.trusted:
            starts = starts_like_header(self._data)
            if starts is None:
                return NEED_MORE
            if starts:
                return ProxyError("PROXY header from an address not in listen.proxy_protocol_from")
            return Proxied(None, self._data)
        header = parse(self._data)
        if isinstance(header, ProxyHeader):
            return Proxied(header.source, self._data[header.length :])
        return header


class _PeerSocket:
    """A socket whose ``getpeername()`` is the client's (what hypercorn and uvicorn read)."""

    def __init__(self, sock: Any, peer: tuple[str, int]) -> None:
        self._sock = sock
        self._peer = peer

    def getpeername(self) -> tuple[str, int]:
        return self._peer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _ClientTransport:
    """A transport whose ``peername`` (and socket's ``getpeername()``) is the client's
    address from its PROXY header; everything else is the real transport's."""

    def __init__(self, transport: Any, peer: tuple[str, int]) -> None:
        self._transport = transport
        self._peer = peer
        # Called per streamed chunk: bound here, not looked up through __getattr__ each time.
        self.write = transport.write
        self.is_closing = transport.is_closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return self._peer
        if name == "socket":
            sock = self._transport.get_extra_info("socket")
            return None if sock is None else _PeerSocket(sock, self._peer)
        return self._transport.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def with_client(transport: Any, source: tuple[str, int] | None) -> Any:
    """``transport`` as the servers should see it: with ``source`` (a PROXY header's) as its
    peer's address, or unchanged for None."""
    if source is None:
        return transport
    return _ClientTransport(transport, source)

