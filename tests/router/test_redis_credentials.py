"""The shared state's password from a file or the environment, never printed, and over TLS.

Real ``firstbyte router`` processes (TLS, loopback) and a real ``valkey-server`` with
``requirepass``: the right password from ``state.redis_password_file`` serves (a stream started
on one process resumes on another, through Redis); a wrong one stops ``--check-config`` and the
start in one line that names the file and holds no password. ``rediss://``: Debian's
``redis-server`` (built with TLS; the embedded valkey-server is not) listening with TLS only,
on a trustme certificate, with the same password: ``rediss://`` with ``state.redis_ca_file``
serves, and without the CA the check refuses it in one line.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import trustme

from firstbyte.benchmarks.ports import free_port
from firstbyte.benchmarks.redis_server import RedisServer, RedisTls, running_redis
from firstbyte.router.config import ConfigError, parse_config
from firstbyte.router.config_check import check_files
from firstbyte.router.shared.target import RedisTarget, redacted, redis_target
from firstbyte.router.sim.server import SimServer
from tests.router import redis_fixture
from tests.router.conftest import client_tls
from tests.router.redis_fixture import tls_server_binary
from tests.router.test_shared_state import (
    _config,
    _read_sse,
    _start_sse,
    running_pair,
    sim,  # noqa: F401 (a fixture)
)

PASSWORD = "pw-9f2c1e7b5a3d-correct-horse"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"redis://:{PASSWORD}@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        (f"redis://router:{PASSWORD}@[::1]:6379/0", "redis://router:***@[::1]:6379/0"),
        ("redis://:p@ss@host:1/0", "redis://:***@host:1/0"),  # the last @ ends the password
        (f"rediss://host:6380/0?password={PASSWORD}&db=1", "rediss://host:6380/0?password=***&db=1"),
        (f"unix:///run/valkey.sock?password={PASSWORD}", "unix:///run/valkey.sock?password=***"),
        ("redis://router@host:6379/0", "redis://router@host:6379/0"),
    ],
)
def test_every_url_is_printed_without_its_password(url: str, shown: str) -> None:
    assert redacted(url) == shown
    target = RedisTarget(url, password=PASSWORD)
    assert PASSWORD not in repr(target)
    assert PASSWORD not in str(target)


def _state(**state: str) -> dict[str, object]:
    return {"upstreams": [{"url": "http://127.0.0.1:9"}], "auth": {"allow_anonymous": True},
            "listen": {"insecure_plain_http": True}, "state": state}


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"redis_url": "redis://:a@h/0", "redis_password_file": "/p"},
         "give the Redis password once, not a password in redis_url and redis_password_file"),
        ({"redis_url": "redis://h/0?password=a", "redis_password_env": "P"},
         "give the Redis password once, not a password in redis_url and redis_password_env"),
        ({"redis_password_env": "P"}, "redis_password_env needs redis_url"),
        ({"redis_url": "redis://h/0", "redis_ca_file": "/ca.pem"},
         "redis_ca_file needs a rediss:// (TLS) redis_url"),
    ],
)
def test_the_password_comes_from_one_place(state: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(_state(**state), "router.toml")
    assert str(raised.value) == f"router.toml: state: {message}"


def test_the_password_file_and_variable_are_read_and_checked(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")  # as `echo` or an editor leaves it
    config = parse_config(_state(redis_url="redis://router@h/0",
                                 redis_password_file=str(secret)), "t")
    target = redis_target(config.state)
    assert (target.password, target.password_source) == (PASSWORD, "state.redis_password_file")
    env = parse_config(_state(redis_url="redis://h/0", redis_password_env="VALKEY_PW"), "t")
    assert redis_target(env.state, {"VALKEY_PW": PASSWORD}).options() == {"password": PASSWORD}
    with pytest.raises(ConfigError, match=r"^state.redis_password_env: the environment "
                                          r"variable VALKEY_PW is not set or empty$"):
        redis_target(env.state, {})
    for content, reason in (("", "empty file: "), (None, "cannot read ")):
        if content is None:
            secret.unlink()
        else:
            secret.write_text(content)
        with pytest.raises(ConfigError) as raised:
            check_files(config, "router.toml")
        assert str(raised.value).startswith(f"router.toml: state.redis_password_file: {reason}")


@pytest.fixture
def password_redis() -> Iterator[RedisServer]:
    with running_redis() as server:
        redis.Redis(host=server.host, port=server.port).config_set("requirepass", PASSWORD)
        yield server


def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "firstbyte", "router", *args], capture_output=True, text=True,
        timeout=60, env={**os.environ, **(env or {})}, check=False,
    )  # fmt: skip


def test_a_wrong_password_file_stops_check_and_start_in_one_line(
    password_redis: RedisServer, tls_files: dict[str, str], tmp_path: Path
) -> None:
    secret = tmp_path / "password"
    secret.write_text("not-the-password-4d1f\n")
    path = _config(tmp_path, "wrong", "http://127.0.0.1:9/v1", tls_files, password_redis.url,
                   free_port(), extra=f'redis_password_file = "{secret}"\n')
    for args in (("--check-config", str(path)), ("--config", str(path))):
        done = _run_cli(*args)
        assert done.returncode == 2, done
        assert done.stdout == ""
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith(f"firstbyte router: error: {path}: state.redis_url: cannot use "
                               f"{password_redis.url}: authentication failed (")
        assert line.endswith("): check the password in state.redis_password_file")
        assert "not-the-password" not in line
        assert "Traceback" not in line


def test_the_right_password_from_the_environment_passes_the_check(
    password_redis: RedisServer, tls_files: dict[str, str], tmp_path: Path
) -> None:
    path = _config(tmp_path, "env", "http://127.0.0.1:9/v1", tls_files, password_redis.url,
                   free_port(), extra='redis_password_env = "FIRSTBYTE_TEST_REDIS_PW"\n')
    done = _run_cli("--check-config", str(path), env={"FIRSTBYTE_TEST_REDIS_PW": PASSWORD})
    assert (done.returncode, done.stdout, done.stderr) == (0, "OK\n", "")
    unset = _run_cli("--check-config", str(path), env={"FIRSTBYTE_TEST_REDIS_PW": ""})
    assert unset.returncode == 2
    assert unset.stderr == (f"firstbyte router: error: {path}: state.redis_password_env: the"
                            " environment variable FIRSTBYTE_TEST_REDIS_PW is not set or empty\n")


async def _stream_across(
    tmp_path: Path, tls_files: dict[str, str], url: str, upstream: str, extra: str
) -> list[Path]:
    """Two routers sharing ``url``: a stream started on A resumes whole on B. Their logs."""
    async with (
        running_pair(tmp_path, tls_files, url, upstream, key_prefix="creds:",
                     extra=extra) as (a, b),
        httpx.AsyncClient(verify=client_tls(tls_files), timeout=20) as client,
    ):
        stream_id, first = await _start_sse(client, a.url, 3)
        rest = await _read_sse(client, b.url, stream_id, after=3)
        seqs = [seq for seq, _ in first + rest]
        assert seqs == list(range(1, len(seqs) + 1))
        assert rest[-1][1] == "[DONE]"
        return [a.log, b.log]


async def test_the_right_password_from_a_file_serves_and_is_never_logged(
    sim: SimServer,  # noqa: F811
    password_redis: RedisServer, tls_files: dict[str, str], tmp_path: Path,
) -> None:
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    logs = await _stream_across(tmp_path, tls_files, password_redis.url, sim.url,
                                f'redis_password_file = "{secret}"\n')
    for log in logs:
        assert PASSWORD not in log.read_text()
    # The stream went through Redis (and Redis wants the password).
    client = redis.Redis(host=password_redis.host, port=password_redis.port, password=PASSWORD)
    assert client.keys("creds:*")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=password_redis.host, port=password_redis.port).ping()


@pytest.mark.parametrize(("ci", "outcome"), [("true", pytest.fail.Exception),
                                              ("", pytest.skip.Exception)])
def test_a_missing_tls_server_fails_under_ci_and_skips_elsewhere(
    monkeypatch: pytest.MonkeyPatch, ci: str, outcome: type[BaseException]
) -> None:
    monkeypatch.setattr(redis_fixture, "DEBIAN_REDIS", "/nonexistent/redis-server")
    monkeypatch.setattr(redis_fixture.shutil, "which", lambda *_, **__: None)  # no apt-get
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="redis-server"):
        tls_server_binary()


@pytest.fixture
def tls_password_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """Debian's redis-server with TLS only, on a certificate from a private CA (``tls`` holds
    the files), wanting :data:`PASSWORD`."""
    binary = tls_server_binary()
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    files = RedisTls(str(tmp_path / "redis-cert.pem"), str(tmp_path / "redis-key.pem"),
                     str(tmp_path / "redis-ca.pem"))
    for i, pem in enumerate(leaf.cert_chain_pems):
        pem.write_to_path(files.cert_file, append=i > 0)
    leaf.private_key_pem.write_to_path(files.key_file)
    ca.cert_pem.write_to_path(files.ca_file)
    with running_redis(binary=binary, tls=files) as server:
        client = redis.Redis(host=server.host, port=server.port, ssl=True,
                             ssl_ca_certs=files.ca_file)
        client.config_set("requirepass", PASSWORD)
        client.close()
        yield server


async def test_rediss_with_a_private_ca_serves(
    sim: SimServer,  # noqa: F811
    tls_password_redis: RedisServer, tls_files: dict[str, str], tmp_path: Path,
) -> None:
    server = tls_password_redis
    assert server.tls is not None
    ca_file = server.tls.ca_file
    secret = tmp_path / "password"
    secret.write_text(PASSWORD)
    url = server.url
    assert url == f"rediss://127.0.0.1:{server.port}/0"
    # TLS only: a plain client on its port is not answered.
    plain_client = redis.Redis(host=server.host, port=server.port, password=PASSWORD,
                               socket_timeout=2, socket_connect_timeout=2)
    with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
        plain_client.ping()
    plain_client.close()
    extra = f'redis_password_file = "{secret}"\nredis_ca_file = "{ca_file}"\n'
    path = _config(tmp_path, "tls", sim.url, tls_files, url, free_port(), extra=extra)
    done = await asyncio.to_thread(_run_cli, "--check-config", str(path))
    assert (done.returncode, done.stdout, done.stderr) == (0, "OK\n", "")
    # Without the private CA the server is not trusted: one line, at the check.
    plain = _config(tmp_path, "untrusted", sim.url, tls_files, url, free_port(),
                    extra=f'redis_password_file = "{secret}"\n')
    refused = await asyncio.to_thread(_run_cli, "--check-config", str(plain))
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    assert "state.redis_url: cannot use rediss://127.0.0.1:" in line
    assert "CERTIFICATE_VERIFY_FAILED" in line or "certificate verify failed" in line
    await _stream_across(tmp_path, tls_files, url, sim.url, extra)
    # The stream went through the TLS server, which wants the password.
    client = redis.Redis(host=server.host, port=server.port, password=PASSWORD, ssl=True,
                         ssl_ca_certs=ca_file)
    assert client.keys("creds:*")
    client.close()
