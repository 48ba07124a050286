"""``--check-config`` opens every file the router will open: the certificate and key as a
pair, the CA bundle, the GeoIP database; relative paths are relative to the config file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trustme

from firstbyte.router.config import ConfigError, load_config
from firstbyte.router.config_check import check_files
from tests.cli import firstbyte

BASE = """
[auth]
api_keys = ["sk-test-key-0001"]
[[upstreams]]
url = "http://127.0.0.1:8001"
"""


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    """``cert.pem``/``key.pem`` (a pair), ``other-key.pem`` (another certificate's key) and
    ``ca.pem``, in ``tmp_path/conf``."""
    ca = trustme.CA()
    directory = tmp_path / "conf"
    directory.mkdir()
    cert = ca.issue_cert("127.0.0.1")
    other = ca.issue_cert("127.0.0.1")
    (directory / "cert.pem").write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(directory / "key.pem"))
    other.private_key_pem.write_to_path(str(directory / "other-key.pem"))
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    return directory


def check(config: Path, cwd: Path) -> tuple[int, str]:
    """``firstbyte router --check-config CONFIG`` run from ``cwd``: exit code and output."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        result = firstbyte("router", "--check-config", str(config))
    finally:
        os.chdir(here)
    assert "Traceback" not in result.stderr
    return result.returncode, (result.stdout + result.stderr).strip()


def write(directory: Path, listen: str, extra: str = "") -> Path:
    path = directory / "router.toml"
    path.write_text(extra + BASE + "[listen]\n" + listen)
    return path


def test_relative_paths_are_relative_to_the_config_file(certs: Path, tmp_path: Path) -> None:
    config = write(certs, 'certfile = "cert.pem"\nkeyfile = "key.pem"\n', 'upstream_ca_file = "ca.pem"\n')
    # Run from elsewhere: the working directory does not matter.
    assert check(config, tmp_path) == (0, "OK")
    loaded = load_config(config)
    assert loaded.listen.certfile == str(certs / "cert.pem")
    assert loaded.upstream_ca_file == str(certs / "ca.pem")


@pytest.mark.parametrize(
    ("listen", "extra", "expected"),
    [
        (
            'certfile = "missing.pem"\nkeyfile = "key.pem"\n',
            "",
            "listen.certfile: no such file: {dir}/missing.pem",
        ),
        (
            'certfile = "cert.pem"\nkeyfile = "missing.pem"\n',
            "",
            "listen.keyfile: no such file: {dir}/missing.pem",
        ),
        (
            'certfile = "key.pem"\nkeyfile = "cert.pem"\n',
            "",
            "listen.certfile: no PEM certificate in {dir}/key.pem (swapped with listen.keyfile?)",
        ),
        (
            'certfile = "cert.pem"\nkeyfile = "other-key.pem"\n',
            "",
            "listen.certfile, listen.keyfile: the private key does not belong to the certificate",
        ),
        (
            'certfile = "cert.pem"\nkeyfile = "key.pem"\n',
            'upstream_ca_file = "key.pem"\n',
            "upstream_ca_file: not a PEM CA bundle: {dir}/key.pem",
        ),
        (
            'certfile = "cert.pem"\nkeyfile = "key.pem"\n',
            '[geo]\ndatabase = "ca.pem"\n',
            "geo.database: not a MaxMind DB file: {dir}/ca.pem",
        ),
        (
            'certfile = "cert.pem"\nkeyfile = "key.pem"\n',
            '[geo]\ndatabase = "GeoLite2-City.mmdb"\n',
            "geo.database: no such file: {dir}/GeoLite2-City.mmdb",
        ),
    ],
)
def test_check_config_names_the_key_of_a_bad_file(
    certs: Path, tmp_path: Path, listen: str, extra: str, expected: str
) -> None:
    config = write(certs, listen, extra)
    code, output = check(config, tmp_path)
    assert code == 2
    assert output.startswith("firstbyte router: error: ")
    assert f"{config}: {expected.format(dir=certs)}" in output


@pytest.mark.parametrize(
    ("unreadable", "extra", "key"),
    [
        ("cert.pem", "", "listen.certfile"),
        ("key.pem", "", "listen.keyfile"),
        ("ca.pem", 'upstream_ca_file = "ca.pem"\n', "upstream_ca_file"),
    ],
)
def test_a_file_the_router_cannot_read_is_named_so(
    certs: Path, monkeypatch: pytest.MonkeyPatch, unreadable: str, extra: str, key: str
) -> None:
    """A key readable by root only, the router running as its own user: "cannot read", not
    "no PEM private key" (the file is fine) nor a traceback (the CA bundle). Path.open is
    made to refuse because the tests may run as root, whom file modes do not stop."""
    config = write(certs, 'certfile = "cert.pem"\nkeyfile = "key.pem"\n', extra)
    loaded = load_config(config)
    real_open = Path.open

    def refusing_open(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self.name == unreadable:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refusing_open)
    with pytest.raises(ConfigError) as raised:
        check_files(loaded, "router.toml")
    assert str(raised.value) == (
        f"router.toml: {key}: cannot read {certs / unreadable}: Permission denied"
    )


def test_check_config_says_the_router_extra_is_missing_as_the_start_does(
    certs: Path, tmp_path: Path
) -> None:
    """With the SDK alone installed the start says "needs the 'router' extra": the check
    must not print OK for a config that cannot start. hypercorn is made missing by a
    package of its name, first on the path, that fails to import as a missing one does."""
    fake = tmp_path / "without-router-extra" / "hypercorn"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'hypercorn\'", name="hypercorn")\n'
    )
    config = write(certs, 'certfile = "cert.pem"\nkeyfile = "key.pem"\n')
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), root])}
    result = firstbyte("router", "--check-config", str(config), env=env)
    assert (result.returncode, result.stdout) == (2, "")
    assert "firstbyte router: needs the 'router' extra (missing module 'hypercorn')" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def test_flags_are_named_as_flags(certs: Path) -> None:
    """A bad value typed as a flag is reported as that flag, with or without --config."""
    flags = ["--upstream", "http://127.0.0.1:1", "--api-key", "sk-test-key-0001"]
    result = firstbyte(
        "router", *flags, "--certfile", str(certs / "cert.pem"),
        "--keyfile", str(certs / "other-key.pem"),
    )  # fmt: skip
    assert result.returncode == 2
    assert "--certfile, --keyfile: the private key does not belong to the certificate" in (
        result.stderr
    )
    result = firstbyte("router", *flags, "--insecure-plain-http", "--port", "70000")
    assert "command line: --port: Expected `int` <= 65535" in result.stderr
    result = firstbyte("router", *flags, "--insecure-plain-http", "--http3-advertised-port", "443")
    assert result.stderr.splitlines()[-1] == (
        "firstbyte router: error: command line: --http3-advertised-port: no HTTP/3 to advertise:"
        " it needs --certfile/--keyfile and HTTP/3 (on unless --no-http3)")
    # With --config: the overriding flag is named; a key from the file stays a key.
    config = write(certs, 'certfile = "cert.pem"\nkeyfile = "key.pem"\n')
    result = firstbyte("router", "--config", str(config), "--port", "70000")
    assert f"{config} (with command-line flags): --port: Expected `int` <= 65535" in (
        result.stderr
    )
    result = firstbyte("router", "--config", str(config), "--keyfile", str(certs / "cert.pem"))
    assert "--keyfile: no PEM private key in" in result.stderr
    assert "Traceback" not in result.stderr


def test_workers_redis_and_limit_flags_are_named_as_flags(certs: Path) -> None:
    """The same for the flags of shared state and of the limits; a Redis URL redis-py could
    not parse is one line naming it, not urllib's traceback."""
    flags = ["--upstream", "http://127.0.0.1:1", "--api-key", "sk-test-key-0001",
             "--insecure-plain-http"]
    result = firstbyte("router", *flags, "--workers", "0")
    assert "command line: --workers: Expected `int` >= 1" in result.stderr
    result = firstbyte("router", *flags, "--max-streams-per-key", "0")
    assert "--max-streams-per-key: Expected `int` >= 1" in result.stderr
    for url, why in (("redis://:secret@127.0.0.1:99999/0", "Port out of range 0-65535"),
                     ("redis://127.0.0.1:port/0", "Port could not be cast")):
        result = firstbyte("router", *flags, "--workers", "2", "--redis-url", url)
        assert result.returncode == 2, result
        assert result.stderr.count("\n") == 1, result.stderr
        assert "command line: --redis-url: redis://" in result.stderr
        assert why in result.stderr
        assert "secret" not in result.stderr
    config = write(certs, 'certfile = "cert.pem"\nkeyfile = "key.pem"\n[state]\n'
                          'redis_url = "redis://127.0.0.1:99999/0"\n')
    result = firstbyte("router", "--check-config", str(config))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"{config}: state.redis_url: redis://127.0.0.1:99999/0: Port out of range" in (
        result.stderr)


def test_check_config_checks_the_flags_given_beside_the_file(certs: Path) -> None:
    """What would run is checked: a flag that would stop the start is an error here too
    (it printed OK, and the start then failed)."""
    config = write(certs, 'certfile = "cert.pem"\nkeyfile = "key.pem"\n')
    result = firstbyte("router", "--check-config", str(config), "--port", "70000")
    assert result.returncode == 2
    assert result.stderr == (f"firstbyte router: error: {config} (with command-line flags):"
                             " --port: Expected `int` <= 65535\n")
    assert firstbyte("router", "--check-config", str(config), "--port", "9443").stdout == "OK\n"
