"""``--check-config`` warns, one line per key, about a shipped placeholder key and a key too
short to resist guessing; it names the key, never prints its value, and still passes."""

from __future__ import annotations

from pathlib import Path

from firstbyte.router.config import parse_config
from firstbyte.router.config_check import MIN_KEY_CHARS, key_warnings
from tests.cli import firstbyte

PLACEHOLDER = "sk-replace-with-a-generated-key-0001"
"""The API key of deploy/router.toml and the Kubernetes Secret."""
GOOD = "sk-" + "Q7" * 20
SHORT = "sk-short1"  # 9 characters: passes the schema (8), under MIN_KEY_CHARS

CONFIG = f"""
[listen]
insecure_plain_http = true
[auth]
api_keys = ["{GOOD}", "{PLACEHOLDER}", "{SHORT}"]
metrics_keys = ["replace-with-the-prometheus-scrape-token", "{"m" * MIN_KEY_CHARS}"]
[[auth.keys]]
key = "tenant-b"
[[upstreams]]
url = "http://127.0.0.1:9"
"""


def test_check_config_warns_once_per_placeholder_or_short_key(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(CONFIG)
    result = firstbyte("router", "--check-config", str(path))
    assert (result.returncode, result.stdout) == (0, "OK\n")  # warnings, not errors
    lines = result.stderr.splitlines()
    prefix = f"firstbyte router: warning: {path}: "
    assert all(line.startswith(prefix) for line in lines), lines
    named = [line.removeprefix(prefix).split(":")[0] for line in lines]
    assert named == ["auth.api_keys[1]", "auth.api_keys[2]", "auth.keys[0].key",
                     "auth.metrics_keys[0]"]  # fmt: skip
    assert "placeholder" in lines[0]
    assert f"9 characters, under {MIN_KEY_CHARS}" in lines[1]
    for secret in (PLACEHOLDER, SHORT, "tenant-b", "replace-with-the-prometheus"):
        assert secret not in result.stderr  # the key's position, never its value


def test_a_config_of_generated_keys_checks_quietly(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(CONFIG.replace(f', "{PLACEHOLDER}", "{SHORT}"', "")
                    .replace('"replace-with-the-prometheus-scrape-token", ', "")
                    .replace('key = "tenant-b"', f'key = "{GOOD}-b"'))
    result = firstbyte("router", "--check-config", str(path))
    assert (result.returncode, result.stdout, result.stderr) == (0, "OK\n", "")


def test_the_peer_key_placeholder_is_named() -> None:
    config = parse_config({
        "upstreams": [{"url": "http://127.0.0.1:9"}], "auth": {"api_keys": [GOOD]},
        "listen": {"insecure_plain_http": True},
        "routing": {"peer_key": "replace-with-a-long-shared-peer-secret"},
    }, "t")  # fmt: skip
    (line,) = key_warnings(config)
    assert line.startswith("routing.peer_key: the placeholder of the shipped config")
