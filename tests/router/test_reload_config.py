"""What a reload may change in place, what needs a restart, and when a drain may end: the pure
parts of :mod:`firstbyte.router.reload` and :mod:`firstbyte.router.drain`, and a reconfigured
:class:`RouterState` (peers, warm prefixes, backends, limits) without sockets."""

from __future__ import annotations

from typing import Any

import pytest

from firstbyte.router.config import RouterConfig, parse_config
from firstbyte.router.drain import drain_finished
from firstbyte.router.reload import changed_keys, needs_restart, reload_summary
from firstbyte.router.routing_metrics import render
from firstbyte.router.state import RouterState
from firstbyte.router.streams import owner_of

BASE: dict[str, Any] = {
    "region": "eu-west-1",
    "upstreams": [{"url": "http://127.0.0.1:9", "name": "a"}],
    "listen": {"insecure_plain_http": True, "port": 8443},
    "auth": {"api_keys": ["sk-first-key"]},
    "routing": {"peer_key": "peer-key-0123456789"},
}


def _config(**changes: Any) -> RouterConfig:
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if name:
            data.setdefault(section, {})[name] = value
        else:
            data[section] = value
    return parse_config(data)


def test_keys_upstreams_peers_and_limits_change_in_place() -> None:
    old = _config()
    new = _config(
        auth__api_keys=["sk-first-key", "sk-second-key"],
        upstreams=[{"url": "http://127.0.0.1:10", "name": "b"}],
        peers=[{"name": "us-east-1", "url": "http://127.0.0.1:11"}],
        limits__max_streams_per_key=4,
        listen__drain_timeout_s=5.0,
    )
    assert changed_keys(old, new) == [
        "auth.api_keys", "limits.max_streams_per_key", "listen.drain_timeout_s", "peers",
        "upstreams",
    ]
    assert needs_restart(old, new) == []


def test_the_reload_line_names_the_upstreams_and_peers_added_removed_or_changed() -> None:
    # "upstreams changed" alone left the operator to diff the files to learn what a reload
    # did: which backend went (and with it a model), which came, which was reweighted.
    old = _config(
        upstreams=[{"url": "http://127.0.0.1:9", "name": "a"},
                   {"url": "http://127.0.0.1:10", "name": "b", "models": ["qwen"]}],
        peers=[{"name": "us-east-1", "url": "http://127.0.0.1:11"}],
    )
    new = _config(
        upstreams=[{"url": "http://127.0.0.1:9", "name": "a", "weight": 3.0,
                    "api_key": "sk-upstream-secret"},
                   {"url": "http://127.0.0.1:12"}],
        peers=[{"name": "us-east-1", "url": "http://127.0.0.1:13"}],
        auth__api_keys=["sk-first-key", "sk-second-key"],
    )
    said = reload_summary(old, new)
    assert said == (
        "auth.api_keys, peers (us-east-1: url),"
        " upstreams (added 127.0.0.1:12; removed b; a: api_key, weight) changed"
    )
    assert "secret" not in said  # names, never values
    assert "sk-second" not in said
    assert reload_summary(old, old) == "nothing changed"


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"listen__port": 9443}, "listen.port"),
        ({"listen__workers": 2, "state__redis_url": "redis://127.0.0.1:6379/0"},
         "listen.workers, state.redis_url"),
        ({"region": "us-east-1"}, "region"),
        ({"limits__upstream_read_timeout_s": 10.0}, "limits.upstream_read_timeout_s"),
        ({"telemetry__service_name": "other"}, "telemetry.service_name"),
        # Read once at start by the QUIC listener and the timing reports' tables.
        ({"limits__quic_retry_above_handshakes_per_s": 0.0},
         "limits.quic_retry_above_handshakes_per_s"),
        ({"client_timings__max_countries": 5}, "client_timings.max_countries"),
        ({"client_timings__reports_per_s_per_key": 5.0}, "client_timings.reports_per_s_per_key"),
    ],
)
def test_what_needs_a_restart_is_named(change: dict[str, Any], key: str) -> None:
    assert ", ".join(needs_restart(_config(), _config(**change))) == key


def test_the_shared_states_expiries_need_a_restart_only_when_shared() -> None:
    # Built into the shared state at start: a reload would change this process's own store
    # and not what it writes to Redis, while logging the change as applied.
    change = {"streams__max_age_s": 60.0, "streams__resume_grace_s": 5.0,
              "routing__affinity_ttl_s": 30.0}
    shared = {"listen__workers": 2, "state__redis_url": "redis://127.0.0.1:6379/0"}
    assert needs_restart(_config(**shared), _config(**shared, **change)) == [
        "routing.affinity_ttl_s", "streams.max_age_s", "streams.resume_grace_s",
    ]
    assert needs_restart(_config(), _config(**change)) == []  # in memory: applied in place


@pytest.mark.parametrize(
    ("elapsed", "in_flight", "grace", "timeout", "finished"),
    [
        (0.0, 0, 0.0, 30.0, True),  # idle, no grace: at once
        (0.0, 3, 0.0, 30.0, False),  # streams in flight: wait
        (29.9, 1, 0.0, 30.0, False),
        (30.0, 1, 0.0, 30.0, True),  # the timeout ends it
        (1.0, 0, 5.0, 30.0, False),  # idle, but the grace is not over
        (5.0, 0, 5.0, 30.0, True),
        (3.0, 0, 60.0, 3.0, True),  # a grace beyond the timeout: the timeout wins
    ],
)
def test_drain_finished(
    elapsed: float, in_flight: int, grace: float, timeout: float, finished: bool
) -> None:
    assert drain_finished(elapsed, in_flight, grace, timeout) is finished


async def test_a_reload_keeps_the_routing_counters() -> None:
    # A reload that added a backend zeroed every firstbyte_route_* series: a counter reset
    # to Prometheus with no restart, and the series of a quiet model or backend gone.
    state = RouterState(_config())
    try:
        old = state.routing
        old.outcomes[("eu-west-1", "a", "ok", "m")] += 18
        old.choices["new-key"] += 18
        old.rejections[("no_peer_with_room", "m")] += 2
        old.ejections[("a", "reset")] += 1
        await state.reconfigure(_config(upstreams=[
            {"url": "http://127.0.0.1:9", "name": "a"}, {"url": "http://127.0.0.1:10", "name": "b"},
        ]))
        new = state.routing
        assert new is not old
        text = render(new)
        assert 'firstbyte_route_requests_total{region="eu-west-1",backend="a",outcome="ok",model="m"} 18' in text
        assert 'firstbyte_route_backend_choices_total{reason="new-key"} 18' in text
        assert 'firstbyte_route_rejections_total{reason="no_peer_with_room",model="m"} 2' in text
        assert 'firstbyte_backend_ejections_total{backend="a",cause="reset"} 1' in text
        old.outcomes[("eu-west-1", "a", "ok", "m")] += 1  # a request finishing on the old one
        assert new.outcomes[("eu-west-1", "a", "ok", "m")] == 19
    finally:
        await state.aclose()


async def test_reconfigured_state_keeps_what_stays_and_swaps_the_rest() -> None:
    peer = {"name": "us-east-1", "url": "http://127.0.0.1:11"}
    state = RouterState(
        _config(
            upstreams=[{"url": "http://127.0.0.1:9", "name": "a"},
                       {"url": "http://127.0.0.1:10", "name": "b"}],
            peers=[peer],
        )
    )
    try:
        kept = state.pool.backends[0]
        kept.in_flight = 2
        state.routing.tracker.started("a")
        old_peer = state.routing.peer_table.peers["us-east-1"]
        state.start_draining()
        await state.reconfigure(
            _config(
                upstreams=[{"url": "http://127.0.0.1:9", "name": "a"},
                           {"url": "http://127.0.0.1:12", "name": "c"}],
                peers=[peer, {"name": "ap-south-1", "url": "http://127.0.0.1:13"}],
                warm_prefixes=[{"name": "sys", "text": "You are terse."}],
                auth__api_keys=["sk-first-key", "sk-second-key"],
                auth__keys=[{"key": "sk-table-key-1", "weight": 2.0, "max_streams": 5}],
                limits__requests_per_s_per_key=2.0,
                streams__max_total_bytes=1 << 20,
            )
        )
        assert [b.name for b in state.pool.backends] == ["a", "c"]
        assert state.pool.backends[0] is kept  # same name and URL: the same record
        assert state.routing.tracker["a"].in_flight == 1  # its load record carried over
        assert set(state.routing.peer_table.peers) == {"us-east-1", "ap-south-1"}
        assert state.routing.peer_table.peers["us-east-1"] is old_peer
        assert [p.name for p in state.routing.prefixes] == ["sys"]
        assert state.api_keys == [b"sk-first-key", b"sk-second-key", b"sk-table-key-1"]
        assert state.limiter.default.rate_per_s == 2.0
        table_key = state.limiter.policy(owner_of("sk-table-key-1"))  # the table, reloaded
        assert (table_key.weight, table_key.max_streams, table_key.rate_per_s) == (2.0, 5, 2.0)
        assert state.store.max_total_bytes == 1 << 20
        # Clients' timing reports may name the added peer (before: 'unknown_region').
        assert state.client_latency.regions == {"eu-west-1", "us-east-1", "ap-south-1"}
        assert state.routing.draining  # a reload during a drain does not end it
    finally:
        await state.aclose()


async def test_an_unnamed_backend_that_stays_keeps_its_name_and_load_when_one_above_goes() -> None:
    """Unnamed upstreams are named by their URL, not their place: removing the first does not
    rename the second (by place it became ``upstream0``, whose fresh, idle load record let a
    backend capped at 4 run 8, and whose metric series was another backend's)."""
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:12"]
    state = RouterState(_config(upstreams=[{"url": url} for url in urls[:2]]))
    try:
        second = state.pool.backends[1]
        assert [b.name for b in state.pool.backends] == ["127.0.0.1:9", "127.0.0.1:10"]
        for _ in range(4):
            state.routing.tracker.started("127.0.0.1:10")
        await state.reconfigure(_config(upstreams=[{"url": urls[1]}, {"url": urls[2]}]))
        assert [b.name for b in state.pool.backends] == ["127.0.0.1:10", "127.0.0.1:12"]
        assert state.pool.backends[0] is second
        assert state.routing.tracker["127.0.0.1:10"].in_flight == 4
    finally:
        await state.aclose()


async def test_a_reload_applies_the_new_cors_origins() -> None:
    state = RouterState(_config(cors={"allow_origins": ["https://a.example"]}))
    try:
        assert state.cors.allows("https://a.example", {})
        await state.reconfigure(_config(cors={"allow_origins": ["https://b.example"]}))
        assert state.cors.allows("https://b.example", {})
        assert not state.cors.allows("https://a.example", {})  # removed: refused from now
    finally:
        await state.aclose()


async def test_a_reload_does_not_report_again_what_is_still_down() -> None:
    """Peers and backends that stay and were down stay reported down: the rebuilt services'
    first failed poll, scrape or model list is no change (20 reloads logged 40 'peer ... is
    down' lines for two peers that never came up)."""
    peers = [{"name": "us-east-1", "url": "http://127.0.0.1:11"},
             {"name": "ap-south-1", "url": "http://127.0.0.1:13"}]
    state = RouterState(_config(peers=peers))
    try:
        old = state.routing
        old.poller.changes.down("us-east-1", "ConnectError")
        old.poller.changes.down("ap-south-1", "ConnectError")
        old.runner.changes.down("a", "ConnectError")
        old.lister._failed.add("a")
        moved = [peers[0], {**peers[1], "url": "http://127.0.0.1:14"}]
        await state.reconfigure(_config(peers=moved, routing__first_token_deadline_ms=900))
        new = state.routing
        assert new is not old
        assert not new.poller.changes.down("us-east-1", "ConnectError")  # no new line
        assert new.poller.changes.down("ap-south-1", "ConnectError")  # moved: a new peer
        assert not new.runner.changes.down("a", "ConnectError")
        assert "a" in new.lister._failed
    finally:
        await state.aclose()
