"""The routing-across-regions config sections: a full example loads; mistakes name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from firstbyte.router.config import ConfigError, load_config
from tests.cli import firstbyte
from tests.router.geo_fixtures import write_city_mmdb

FULL = """
region = "tokyo"

[listen]
insecure_plain_http = true

[auth]
api_keys = ["sk-test-key-0001"]

[[upstreams]]
url = "http://127.0.0.1:8001"
kind = "vllm"
weight = 2
max_in_flight = 32
models = ["llama-3-8b"]

[[upstreams]]
url = "http://127.0.0.1:8002"
kind = "sglang"

[geo]
latitude = 35.68
longitude = 139.69
public_url = "https://tokyo.example.com"
database = "DB"
trusted_proxies = ["127.0.0.1/32", "10.0.0.0/8"]

[routing]
peer_key = "0123456789abcdef-peer"
first_token_deadline_ms = 1500
backend_policy = "prefix"

[[peers]]
name = "frankfurt"
url = "https://frankfurt.example.com"
latitude = 50.11
longitude = 8.68

[[peers]]
name = "us-east-1"
url = "https://virginia.example.com"

[[warm_prefixes]]
name = "support"
text = "You are a support agent."
models = ["llama-3-8b"]

[warmup]
interval_s = 30
"""


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(write_city_mmdb(tmp_path / "cities.mmdb"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "router.toml"
    path.write_text(text)
    return path


def test_missing_geoip_database_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, FULL.replace("DB", str(tmp_path / "missing.mmdb")))
    with pytest.raises(ConfigError, match=r"geo\.database: no such file"):
        load_config(path)


def test_full_example_loads(tmp_path: Path, db: str) -> None:
    config = load_config(write(tmp_path, FULL.replace("DB", db)))
    assert config.upstreams[0].weight == 2
    assert config.upstreams[1].kind == "sglang"
    assert [p.name for p in config.peers] == ["frankfurt", "us-east-1"]  # a known region code
    assert config.routing.first_token_deadline_ms == 1500
    assert config.warm_prefixes[0].models == ["llama-3-8b"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (('peer_key = "0123456789abcdef-peer"', ""), "routing.peer_key: required when peers"),
        (('peer_key = "0123456789abcdef-peer"', 'peer_key = "short"'), "routing.peer_key"),
        (('name = "frankfurt"', 'name = "tokyo"'), "peers[0].name: 'tokyo' is this router's own"),
        (('name = "us-east-1"', 'name = "frankfurt"'), "peers[1].name: duplicate peer"),
        (('name = "us-east-1"', 'name = "atlantis"'), "peers[1].latitude: required"),
        (("latitude = 35.68", "latitude = 135.68"), "geo.latitude: Expected `float` <= 90.0"),
        (("longitude = 139.69", ""), "geo.latitude and geo.longitude must be given together"),
        (('"10.0.0.0/8"', '"10.0.0.0/33"'), "geo.trusted_proxies"),
        (("database = ", 'database = "/nonexistent.mmdb"\nx = '), "geo.x: unknown key"),
        (('kind = "vllm"', 'kind = "tgi"'), "upstreams[0].kind"),
        (("weight = 2", "weight = 0"), "upstreams[0].weight"),
        (('backend_policy = "prefix"', 'backend_policy = "random"'), "routing.backend_policy"),
        (
            ('text = "You are a support agent."', ""),
            "warm_prefixes[0]: give exactly one of text or file",
        ),
        (("interval_s = 30", "interval_s = 0"), "warmup.interval_s"),
    ],
)
def test_mistakes_name_the_key(
    tmp_path: Path, db: str, change: tuple[str, str], expected: str
) -> None:
    text = FULL.replace("DB", db)
    assert change[0] in text
    path = write(tmp_path, text.replace(change[0], change[1], 1))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert expected in str(info.value)


def test_check_config_cli_reports_region_errors(tmp_path: Path, db: str) -> None:
    bad = write(tmp_path, FULL.replace("DB", db).replace('name = "frankfurt"', 'name = "tokyo"'))
    result = firstbyte("router", "--check-config", str(bad))
    assert result.returncode == 2
    assert "peers[0].name" in result.stderr
    assert "Traceback" not in result.stderr
    good = write(tmp_path, FULL.replace("DB", db))
    result = firstbyte("router", "--check-config", str(good))
    assert (result.returncode, result.stdout.strip()) == (0, "OK")


def test_shipped_example_config_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "router-tokyo.toml"
    config = load_config(example)
    assert config.region == "ap-northeast-1"
    assert [p.name for p in config.peers] == ["eu-central-1", "us-east-1"]
    # README: "SIGHUP (or `firstbyte router reload --config FILE`)": reload finds the
    # router through listen.pid_file, beside the config like its other relative paths.
    assert config.listen.pid_file == str(example.parent / "router-tokyo.pid")
