"""Config validation names the file and key; the CLI prints it without a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from firstbyte.router.config import ConfigError, load_config
from tests.cli import firstbyte

GOOD = """
region = "eu-west-1"
[auth]
api_keys = ["sk-test-key-0001"]
[[upstreams]]
url = "http://127.0.0.1:8001"
[listen]
insecure_plain_http = true
port = 9000
[streams]
resume_grace_s = 10
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD + "bogus = 1\n", "streams.bogus: unknown key"),
        (GOOD.replace("port = 9000", "port = 70000"), "listen.port: Expected `int` <= 65535"),
        (
            GOOD.replace("port = 9000", "port = 9000\nhttp3_advertised_port = 70000"),
            "listen.http3_advertised_port: Expected `int` <= 65535",
        ),
        (
            GOOD.replace("port = 9000", "port = 9000\nhttp3_advertised_port = 0"),
            "listen.http3_advertised_port: Expected `int` >= 1",
        ),
        (
            GOOD.replace("port = 9000", "port = 9000\nhttp3_advertised_port = 443"),
            "listen.http3_advertised_port: no HTTP/3 to advertise: it needs"
            " listen.certfile/listen.keyfile and listen.http3",
        ),
        (
            GOOD.replace("resume_grace_s = 10", 'resume_grace_s = "x"'),
            "streams.resume_grace_s: Expected `float`",
        ),
        (GOOD.replace("http://127.0.0.1:8001", "ftp://x"), "upstreams[0].url"),
        (
            GOOD.replace("insecure_plain_http = true", ""),
            "listen.certfile/listen.keyfile are required",
        ),
        (
            GOOD.replace('api_keys = ["sk-test-key-0001"]', ""),
            "auth.api_keys: no API key configured",
        ),
        (
            GOOD.replace('api_keys = ["sk-test-key-0001"]', "allow_anonymous = 1"),
            "auth.allow_anonymous: Expected `bool`",
        ),
        (
            GOOD.replace("insecure_plain_http = true", 'certfile = "c.pem"\nkeyfile = "k.pem"')
            + '[routing]\npeer_key = "0123456789abcdef"\n'
            + '[[peers]]\nname = "tokyo"\nurl = "http://10.0.0.9:8443"\n'
            + "latitude = 35.7\nlongitude = 139.7\n",
            "peers[0].url: must be https",
        ),
        (
            GOOD + '[[auth.keys]]\nkey = "sk-test-key-0002"\nweight = 0\n',
            "auth.keys[0].weight: Expected `float` > 0.0",
        ),
        (
            GOOD + '[[auth.keys]]\nkey = "sk-test-key-0002"\nmax_stream = 5\n',
            "auth.keys[0].max_stream: unknown key",
        ),
        (
            GOOD + '[[auth.keys]]\nkey = "sk-test-key-0001"\n',
            "auth.keys[0]: this key is listed twice",
        ),
        (
            GOOD + '[[upstreams]]\nurl = "http://127.0.0.1:8001/v1/"\n',
            "upstreams[1].url: the same backend as upstreams[0] (http://127.0.0.1:8001):"
            " its slots would count twice",
        ),
        (
            GOOD + '[[upstreams]]\nurl = "http://127.0.0.1:8002"\nname = "127.0.0.1:8001"\n',
            "upstreams[1].name: '127.0.0.1:8001' is also upstreams[0]'s name (an unnamed"
            " upstream is named by its URL)",
        ),
        (
            GOOD + '[[upstreams]]\nurl = "http://127.0.0.1:8001"\napi_key = "other"\n',
            "upstreams[1].url: the same backend as upstreams[0]",
        ),
        (GOOD.replace("8001", "8001?x=1"), "upstreams[0].url: no query or fragment"),
        # The resolver takes a port modulo 65536: 73537 would reach port 8001.
        (
            GOOD.replace("8001", "73537"),
            "upstreams[0].url: the port of 'http://127.0.0.1:73537' is not a number from 1 to 65535",
        ),
        (GOOD.replace("8001", "0"), "upstreams[0].url: the port of 'http://127.0.0.1:0' is not"),
        (
            GOOD + '[geo]\npublic_url = "https://edge.example.com:443x"\n',
            "geo.public_url: the port of 'https://edge.example.com:443x' is not",
        ),
        # inf would turn the timeout off: every phase of a connection has one.
        (GOOD + "[limits]\nupstream_connect_timeout_s = inf\n",
         "limits.upstream_connect_timeout_s: Expected `float` <= 10000000.0"),
        ("region = [", "not valid TOML"),
        ('region = "x"\n', "missing required field `upstreams`"),
    ],
)
def test_errors_name_file_and_key(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "router.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ")
    assert expected in str(info.value)


def test_good_config_loads(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(GOOD)
    config = load_config(path)
    assert config.region == "eu-west-1"
    assert config.listen.port == 9000
    assert config.streams.resume_grace_s == 10
    assert config.limits.upstream_keepalive_expiry_s > 5  # httpx's 5 s default is too short


def test_upstream_pools_default_to_the_backends_slots(tmp_path: Path) -> None:
    """A region with room never makes a stream wait for an upstream socket: the pools are as
    large as what the backends may be sent, unless the operator says otherwise."""
    path = tmp_path / "router.toml"
    many = "".join(
        f'[[upstreams]]\nurl = "http://127.0.0.1:{9100 + i}"\nmax_in_flight = 1500\n'
        for i in range(2)
    )
    path.write_text(GOOD + many)
    assert load_config(path).upstream_connections() == 1500 * 2 + 1024
    path.write_text(GOOD + "[limits]\nupstream_max_connections = 64\n")
    assert load_config(path).upstream_connections() == 64


def test_the_per_key_table_loads_beside_api_keys(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(
        GOOD.replace("[auth]\n", "[auth]\n")
        + '[[auth.keys]]\nkey = "sk-table-key-1"\nweight = 2.0\nmax_streams = 500\n'
        + "max_streams_per_subject = 20\n"
        + '[[auth.keys]]\nkey = "sk-table-key-2"\n'
    )
    config = load_config(path)
    assert config.auth.all_keys() == ["sk-test-key-0001", "sk-table-key-1", "sk-table-key-2"]
    first, second = config.auth.keys
    assert (first.weight, first.max_streams, first.max_streams_per_subject) == (2.0, 500, 20)
    assert (second.weight, second.max_streams, second.requests_per_s) == (1.0, None, None)
    # No default caps a key: the [limits] per-key caps are opt-in.
    assert config.limits.max_streams_per_key is None
    assert config.limits.max_streams_per_subject is None


def test_check_config_cli(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(GOOD.replace("port = 9000", "port = -1"))
    result = firstbyte("router", "--check-config", str(bad))
    assert result.returncode == 2
    assert f"{bad}: listen.port" in result.stderr
    assert "Traceback" not in result.stderr
    good = tmp_path / "good.toml"
    good.write_text(GOOD)
    result = firstbyte("router", "--check-config", str(good))
    assert (result.returncode, result.stdout.strip()) == (0, "OK")


def test_cli_flag_errors_are_clear() -> None:
    """Errors about values typed as flags name the flags, not the config keys they become."""
    result = firstbyte("router", "--upstream", "not-a-url", "--insecure-plain-http")
    assert result.returncode == 2
    assert "command line: --upstream not-a-url: Expected `str` matching" in result.stderr
    result = firstbyte("router", "--upstream", "http://127.0.0.1:1")
    assert result.returncode == 2
    assert (
        "--certfile/--keyfile are required (or give --insecure-plain-http for local use)"
        in result.stderr
    )
    assert "listen." not in result.stderr
    assert "Traceback" not in result.stderr


def test_a_router_without_keys_is_refused_unless_anonymous_is_asked_for() -> None:
    # No --api-key: refused at start-up, with the way out named (never a silently open router).
    result = firstbyte("router", "--upstream", "http://127.0.0.1:1", "--insecure-plain-http")
    assert result.returncode == 2
    assert (
        "--api-key: no API key configured; give one, or give --allow-anonymous" in result.stderr
    )
    # Asked for explicitly, the same flags make a valid config (checked without starting it).
    import argparse

    from firstbyte.router.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--upstream", "http://127.0.0.1:1", "--insecure-plain-http", "--allow-anonymous"]
    )
    config = config_from_args(args)
    assert config.auth.allow_anonymous
    assert config.auth.api_keys == []


def test_api_keys_from_the_environment() -> None:
    """FIRSTBYTE_API_KEYS keeps keys out of the process list; --api-key still wins."""
    import argparse

    from firstbyte.router.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = ["--upstream", "http://127.0.0.1:1", "--insecure-plain-http"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FIRSTBYTE_API_KEYS", "sk-env-key-0001  sk-env-key-0002\n")
        assert config_from_args(parser.parse_args(flags)).auth.api_keys == [
            "sk-env-key-0001",
            "sk-env-key-0002",
        ]
        chosen = config_from_args(parser.parse_args([*flags, "--api-key", "sk-flag-key-01"]))
        assert chosen.auth.api_keys == ["sk-flag-key-01"]
