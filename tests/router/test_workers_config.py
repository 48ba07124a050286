"""``listen.workers > 1`` needs ``state.redis_url``: refused in the config and on the command
line with one line naming both keys."""

from __future__ import annotations

import subprocess
import sys

import pytest

from firstbyte.router.config import ConfigError, parse_config

BASE = {
    "upstreams": [{"url": "http://127.0.0.1:9"}],
    "listen": {"insecure_plain_http": True},
    "auth": {"allow_anonymous": True},
}


def test_workers_without_redis_url_is_a_config_error_naming_both_keys() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({**BASE, "listen": {"insecure_plain_http": True, "workers": 2}}, "r.toml")
    message = str(raised.value)
    assert message.startswith("r.toml: ")
    assert "listen.workers" in message
    assert "state.redis_url" in message


def test_workers_with_redis_url_and_one_worker_without_it_are_fine() -> None:
    shared = parse_config(
        {**BASE, "listen": {"insecure_plain_http": True, "workers": 4},
         "state": {"redis_url": "redis://127.0.0.1:6379/0"}}
    )
    assert shared.listen.workers == 4
    assert parse_config(BASE).state.redis_url is None  # the embedded default


def test_redis_url_must_be_a_redis_url() -> None:
    with pytest.raises(ConfigError, match=r"state\.redis_url"):
        parse_config({**BASE, "state": {"redis_url": "http://127.0.0.1:6379"}})


def test_cli_workers_without_redis_is_one_line_exit_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "firstbyte", "router", "--upstream", "http://127.0.0.1:9",
         "--insecure-plain-http", "--allow-anonymous", "--workers", "2"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    # Named as typed: flags, not the config keys they became.
    assert lines[0] == (
        "firstbyte router: error: command line: --workers 2 needs --redis-url: processes share"
        " streams, QUIC tickets and limits only through Redis (or give --workers 1)")
