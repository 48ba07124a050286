"""Geography profiles: placement at the nearest AWS region, RTTs from the shipped table plus the
last mile, per-direction loss and bandwidth, and clear errors for bad profiles."""

from __future__ import annotations

from pathlib import Path

import pytest

from firstbyte.benchmarks.wan import geo
from firstbyte.benchmarks.wan.delayline import NS_PER_MS


def test_shipped_table_is_complete_and_read_both_ways() -> None:
    table = geo.rtt_table()
    assert len(table) == 21
    assert set(table) == set(geo.regions())
    assert all(set(row) == set(table) for row in table.values())
    # The table is not quite symmetric; a pair's RTT is the mean of its two directions.
    assert table["af-south-1"]["ap-northeast-1"] == 353
    assert table["ap-northeast-1"]["af-south-1"] == 358
    assert geo.region_rtt_ms("af-south-1", "ap-northeast-1") == 355.5


def test_clients_sit_at_their_nearest_region() -> None:
    place = geo.cities()["beijing"]
    assert geo.nearest_region(place.lat, place.lon) == "ap-northeast-2"
    place = geo.cities()["london"]
    assert geo.nearest_region(place.lat, place.lon) == "eu-west-2"
    assert geo.distance_km(51.51, -0.13, 48.86, 2.35) == pytest.approx(343, abs=5)


def test_transpacific_profile_adds_the_last_mile() -> None:
    profile = geo.load_profile("transpacific")
    sites = {s.name: s for s in profile.sites}
    beijing, us = sites["client-beijing"], sites["region-us-west"]
    expected = geo.region_rtt_ms("ap-northeast-2", "us-west-1") + geo.last_miles()["fiber"].rtt_ms
    assert profile.rtt_ms(beijing, us) == expected
    links = profile.link_params()
    assert links[("client-beijing", "region-us-west")].delay_ns == round(expected * NS_PER_MS / 2)
    assert links[("region-us-west", "client-beijing")].delay_ns == round(expected * NS_PER_MS / 2)
    # region to region: the table alone, no last mile, no rate limit
    peer = links[("region-us-west", "region-ap-northeast")]
    assert peer.delay_ns == round(geo.region_rtt_ms("us-west-1", "ap-northeast-2") * NS_PER_MS / 2)
    assert peer.rate_bps is None
    assert peer.loss_pct == 0.0


def test_last_mile_loss_and_bandwidth_per_direction() -> None:
    profile = geo.profile_from_dict(
        {
            "client": [{"name": "phone", "city": "New York", "last_mile": "4g"}],
            "region": [{"name": "edge", "aws": "us-east-1"}],
        },
        "t",
    )
    links = profile.link_params()
    up, down = links[("phone", "edge")], links[("edge", "phone")]
    assert up.rate_bps == 10e6  # 4g: 10 Mbit/s up
    assert down.rate_bps == 20e6  # and 20 down
    assert up.loss_pct == down.loss_pct == 0.5
    assert [h.ip for h in profile.hosts()] == ["192.0.2.10", "198.51.100.10"]


def test_world_profile_addresses_by_role() -> None:
    profile = geo.load_profile("world")
    ips = {h.name: h.ip for h in profile.hosts()}
    assert ips["client-tokyo"] == "192.0.2.10"
    assert ips["client-sydney"] == "192.0.2.13"
    assert ips["region-us-east"] == "198.51.100.10"
    assert len(profile.link_params()) == len(ips) * (len(ips) - 1)


def test_toml_profile_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(
        '[[client]]\nname = "c"\nlat = -33.9\nlon = 151.2\nlast_mile = "wifi"\n'
        '[[region]]\nname = "r"\naws = "ap-southeast-2"\n'
        '[[backend]]\nname = "b"\naws = "ap-southeast-2"\n'
    )
    profile = geo.load_profile(str(path))
    assert profile.name == "mine"
    assert [(h.name, h.ip) for h in profile.hosts()] == [
        ("c", "192.0.2.10"),
        ("r", "198.51.100.10"),
        ("b", "203.0.113.10"),
    ]
    c, r, b = profile.sites
    assert c.aws == "ap-southeast-2"
    assert profile.rtt_ms(r, b) == geo.rtt_table()["ap-southeast-2"]["ap-southeast-2"]
    assert profile.rtt_ms(c, r) == profile.rtt_ms(r, b) + 25


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {
                "client": [{"name": "c", "city": "Atlantis"}],
                "region": [{"name": "r", "aws": "us-east-1"}],
            },
            "unknown city 'Atlantis'",
        ),
        (
            {
                "client": [{"name": "c", "city": "Tokyo", "last_mile": "carrier-pigeon"}],
                "region": [{"name": "r", "aws": "us-east-1"}],
            },
            "unknown last_mile",
        ),
        (
            {"region": [{"name": "r", "aws": "mars-1"}, {"name": "s", "aws": "us-east-1"}]},
            "unknown AWS region 'mars-1'",
        ),
        ({"region": [{"name": "r", "aws": "us-east-1"}]}, "at least two hosts"),
        (
            {"region": [{"name": "r", "aws": "us-east-1"}, {"name": "r", "aws": "us-east-2"}]},
            "duplicate host names",
        ),
        ({"region": [{"aws": "us-east-1"}]}, "needs a name"),
        ({"region": [{"name": "r"}, {"name": "s", "aws": "us-east-1"}]}, "give one of"),
        ({"regions": []}, "unknown keys"),
    ],
)
def test_bad_profiles_say_what_is_wrong(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        geo.profile_from_dict(data, "bad")


def test_unknown_profile_name_lists_builtins(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="transpacific, world"):
        geo.load_profile("nowhere")
    broken = tmp_path / "broken.toml"
    broken.write_text("[[client]\n")
    with pytest.raises(ValueError, match="cannot read profile"):
        geo.load_profile(str(broken))
