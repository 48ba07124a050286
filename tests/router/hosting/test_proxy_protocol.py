"""The PROXY protocol parser, byte-exact: v1 and v2, IPv4 and IPv6, UNKNOWN and LOCAL,
every truncation, oversized headers and garbage; and one connection's wait for its header."""

from __future__ import annotations

import ipaddress
import struct
from pathlib import Path
from typing import Any, cast

import pytest

from firstbyte.router.config import ConfigError, load_config
from firstbyte.router.hosting.proxy_protocol import (
    NEED_MORE,
    V1_MAX_BYTES,
    V2_MAX_BYTES,
    V2_SIGNATURE,
    HeaderWait,
    Proxied,
    ProxyError,
    ProxyHeader,
    ProxyProtocol,
    parse,
    starts_like_header,
    with_client,
)
from firstbyte.router.serve import _options

REQUEST = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"


def v2(
    command: int = 1, family: int = 0x11, block: bytes = b"", *, version: int = 2
) -> bytes:
    return V2_SIGNATURE + bytes([version << 4 | command, family]) + struct.pack(
        "!H", len(block)
    ) + block


def v2_inet(source: str, sport: int, destination: str, dport: int, tlvs: bytes = b"") -> bytes:
    src, dst = ipaddress.ip_address(source), ipaddress.ip_address(destination)
    family = 0x11 if src.version == 4 else 0x21
    return v2(1, family, src.packed + dst.packed + struct.pack("!HH", sport, dport) + tlvs)


def test_v1_tcp4_and_what_follows_it() -> None:
    header = b"PROXY TCP4 192.0.2.10 10.0.0.1 56324 443\r\n"
    assert parse(header + REQUEST) == ProxyHeader(
        1, ("192.0.2.10", 56324), ("10.0.0.1", 443), len(header)
    )


def test_v1_tcp6() -> None:
    header = b"PROXY TCP6 2001:db8::1 2001:db8::2 65535 0\r\n"
    assert parse(header) == ProxyHeader(1, ("2001:db8::1", 65535), ("2001:db8::2", 0), len(header))


def test_v1_unknown_keeps_the_connection_address() -> None:
    assert parse(b"PROXY UNKNOWN\r\n") == ProxyHeader(1, None, None, 15)
    line = b"PROXY UNKNOWN ffff:f::1 ffff:f::2 1 2\r\n"
    assert parse(line + REQUEST) == ProxyHeader(1, None, None, len(line))


def test_v1_at_its_longest_is_accepted_and_one_byte_more_is_not() -> None:
    longest = (  # the spec's worst case
        b"PROXY UNKNOWN ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"
        b" ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff 65535 65535\r\n"
    )
    assert len(longest) == V1_MAX_BYTES
    assert isinstance(parse(longest), ProxyHeader)
    unended = b"PROXY UNKNOWN " + b"x" * (V1_MAX_BYTES - 14)
    assert parse(unended) == ProxyError(f"v1 header longer than {V1_MAX_BYTES} bytes")
    assert parse(unended[:-1]) is NEED_MORE


@pytest.mark.parametrize(
    "line",
    [
        b"PROXY TCP4 192.0.2.10 10.0.0.1 56324\r\n",  # a port missing
        b"PROXY TCP4  192.0.2.10 10.0.0.1 1 2\r\n",  # two spaces
        b"PROXY TCP4 2001:db8::1 10.0.0.1 1 2\r\n",  # family mismatch
        b"PROXY TCP6 192.0.2.10 10.0.0.1 1 2\r\n",
        b"PROXY TCP4 192.0.2.010 10.0.0.1 1 2\r\n",  # a leading zero: ambiguous (octal?)
        b"PROXY TCP4 192.0.2.10 10.0.0.1 65536 2\r\n",
        b"PROXY TCP4 192.0.2.10 10.0.0.1 -1 2\r\n",
        b"PROXY TCP4 192.0.2.10 10.0.0.1 01 2\r\n",
        b"PROXY TCP6 fe80::1%eth0 fe80::2 1 2\r\n",
        b"PROXY UDP4 192.0.2.10 10.0.0.1 1 2\r\n",
        b"PROXY TCP4 192.0.2.10 10.0.0.1 1 2\n",  # LF alone
        b"PROXY TCP4 192.0.2.10\r10.0.0.1 1 2\r\n",
        b"PROXY TCP4 \xff.0.2.10 10.0.0.1 1 2\r\n",
    ],
)
def test_v1_malformed_lines_are_errors(line: bytes) -> None:
    assert isinstance(parse(line), ProxyError)


def test_v2_ipv4_with_tlvs_and_what_follows_it() -> None:
    tlvs = b"\x04\x00\x03abc"  # PP2_TYPE_NOOP, skipped with the block
    header = v2_inet("192.0.2.10", 56324, "10.0.0.1", 443, tlvs)
    assert parse(header + REQUEST) == ProxyHeader(
        2, ("192.0.2.10", 56324), ("10.0.0.1", 443), len(header)
    )
    assert len(header) == 16 + 12 + len(tlvs)


def test_v2_ipv6() -> None:
    header = v2_inet("2001:db8::1", 1, "2001:db8::2", 2)
    assert parse(header) == ProxyHeader(2, ("2001:db8::1", 1), ("2001:db8::2", 2), 16 + 36)


def test_v2_local_unspec_and_unix_keep_the_connection_address() -> None:
    # LOCAL (the balancer's health check) whatever its block says.
    local = v2(0, 0x11, bytes(12))
    assert parse(local + REQUEST) == ProxyHeader(2, None, None, len(local))
    assert parse(v2(0, 0x00)) == ProxyHeader(2, None, None, 16)
    assert parse(v2(1, 0x00)) == ProxyHeader(2, None, None, 16)
    unix = v2(1, 0x31, bytes(216))
    assert parse(unix) == ProxyHeader(2, None, None, 16 + 216)


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (v2(version=1), "v2 header: version 1"),
        (v2(2), "v2 header: command 2 is neither LOCAL nor PROXY"),
        (v2(1, 0x41, bytes(12)), "v2 header: unknown address family or protocol 0x41"),
        (v2(1, 0x13, bytes(12)), "v2 header: unknown address family or protocol 0x13"),
        (v2(1, 0x12, bytes(12)), "v2 header: not a TCP connection"),
        (v2(1, 0x11, bytes(11)), "v2 header: address block too short for its family"),
        (v2(1, 0x21, bytes(12)), "v2 header: address block too short for its family"),
    ],
)
def test_v2_malformed_headers_are_errors(header: bytes, reason: str) -> None:
    assert parse(header) == ProxyError(reason)


def test_v2_oversized_is_an_error_from_its_length_field_alone() -> None:
    at_most = v2(1, 0x11, bytes(V2_MAX_BYTES - 16))
    assert isinstance(parse(at_most), ProxyHeader)
    over = v2(1, 0x11, bytes(V2_MAX_BYTES - 15))
    # Refused on its 16 fixed bytes: nothing of the block is waited for.
    assert parse(over[:16]) == ProxyError(
        f"v2 header of {V2_MAX_BYTES + 1} bytes, more than {V2_MAX_BYTES}"
    )


@pytest.mark.parametrize(
    "header",
    [
        b"PROXY TCP4 192.0.2.10 10.0.0.1 56324 443\r\n",
        v2_inet("192.0.2.10", 56324, "10.0.0.1", 443, b"\x04\x00\x01z"),
        v2_inet("2001:db8::1", 1, "2001:db8::2", 2),
        v2(0, 0x00),
    ],
)
def test_every_truncation_needs_more(header: bytes) -> None:
    for end in range(len(header)):
        assert parse(header[:end]) is NEED_MORE, end
    assert isinstance(parse(header), ProxyHeader)


@pytest.mark.parametrize(
    "data",
    [
        REQUEST,
        b"\x16\x03\x01\x02\x00\x01",  # a TLS ClientHello
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"PROXY",  # ... not yet, but:
        b"\r\n\r\n\x00\r\nQUI",
    ],
)
def test_anything_else_is_not_a_header(data: bytes) -> None:
    if data in (b"PROXY", b"\r\n\r\n\x00\r\nQUI"):
        assert parse(data) is NEED_MORE
        assert parse(data + b"!") == ProxyError("not a PROXY header")
    else:
        assert parse(data) == ProxyError("not a PROXY header")


def test_a_balancers_connection_waits_for_its_header_in_any_split() -> None:
    header = v2_inet("192.0.2.10", 56324, "10.0.0.1", 443)
    data = header + REQUEST
    for cut in range(1, len(data)):
        wait = HeaderWait(trusted=True)
        first = wait.feed(data[:cut])
        if cut < len(header):
            assert first is NEED_MORE
            assert wait.feed(data[cut:]) == Proxied(("192.0.2.10", 56324), REQUEST)
        else:
            assert first == Proxied(("192.0.2.10", 56324), data[len(header) : cut])


def test_a_balancers_connection_without_a_header_is_an_error() -> None:
    assert HeaderWait(trusted=True).feed(REQUEST) == ProxyError("not a PROXY header")


def test_anyone_elses_connection_goes_on_unless_it_sends_a_header() -> None:
    wait = HeaderWait(trusted=False)
    assert wait.feed(b"\r\n") is NEED_MORE  # blank lines may precede an HTTP/1.1 request
    assert wait.feed(REQUEST) == Proxied(None, b"\r\n" + REQUEST)
    assert HeaderWait(trusted=False).feed(b"PRI * HTTP/2.0") == Proxied(None, b"PRI * HTTP/2.0")
    for header in (b"PROXY TCP4 192.0.2.10 10.0.0.1 1 2\r\n", v2(0, 0x00)):
        spoofed = HeaderWait(trusted=False)
        assert spoofed.feed(header[:3]) is NEED_MORE
        assert spoofed.feed(header[3:]) == ProxyError(
            "PROXY header from an address not in listen.proxy_protocol_from"
        )
    assert starts_like_header(b"") is None


def test_balancers_are_matched_by_network_and_dual_stack_form() -> None:
    policy = ProxyProtocol(["10.0.0.0/8", "2001:db8::/32", "127.0.0.1"])
    assert policy.trusts("10.1.2.3")
    assert policy.trusts("::ffff:10.1.2.3")  # an IPv4 peer on a dual-stack socket
    assert policy.trusts("2001:db8::5")
    assert policy.trusts("127.0.0.1")
    assert not policy.trusts("127.0.0.2")
    assert not policy.trusts("11.0.0.1")
    assert not policy.trusts("?")


class _Socket:
    family = 2

    def getpeername(self) -> tuple[str, int]:
        return ("127.0.0.1", 40000)

    def fileno(self) -> int:
        return 7


class _Transport:
    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 40000), "socket": _Socket()}.get(name, default)

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.written = data

    def pause_reading(self) -> None:
        self.paused = True


def test_the_servers_see_the_headers_client_and_the_rest_unchanged() -> None:
    transport = _Transport()
    assert with_client(transport, None) is transport
    client = with_client(transport, ("192.0.2.10", 56324))
    assert client.get_extra_info("peername") == ("192.0.2.10", 56324)
    sock = client.get_extra_info("socket")
    assert sock.getpeername() == ("192.0.2.10", 56324)  # hypercorn's and uvicorn's source
    assert (sock.fileno(), sock.family) == (7, 2)
    assert client.get_extra_info("sslcontext", "none") == "none"
    assert client.is_closing() is False
    client.write(b"x")
    client.pause_reading()
    assert (transport.written, transport.paused) == (b"x", True)


# --- the config that turns it on (listen.proxy_protocol, listen.proxy_protocol_from) ---------

_CONFIG = """
[auth]
api_keys = ["sk-test-key-0001"]
[[upstreams]]
url = "http://127.0.0.1:8001"
[listen]
insecure_plain_http = true
"""


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("proxy_protocol = true\n", "listen.proxy_protocol needs listen.proxy_protocol_from"),
        (
            'proxy_protocol = true\nproxy_protocol_from = ["10.0.0.0/8", "10.0.0.300"]\n',
            "listen.proxy_protocol_from[1]: not an address or CIDR: '10.0.0.300'",
        ),
        ("proxy_protocol_from = \"10.0.0.0/8\"\n", "listen.proxy_protocol_from: Expected `array`"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, listen: str, expected: str) -> None:
    path = tmp_path / "router.toml"
    path.write_text(_CONFIG + listen)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: {expected}")


def test_config_turns_it_on_for_the_listed_balancers(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(_CONFIG)
    assert load_config(path).listen.proxy_protocol is False  # off by default
    path.write_text(_CONFIG + 'proxy_protocol = true\nproxy_protocol_from = ["10.0.0.0/8", "::1"]\n')
    config = load_config(path)
    assert config.listen.proxy_protocol_from == ["10.0.0.0/8", "::1"]
    policy = _options(config, False, cast(Any, None)).proxy_protocol
    assert policy is not None
    assert policy.trusts("10.2.3.4")
    assert policy.trusts("::1")
    assert not policy.trusts("127.0.0.1")
