from __future__ import annotations

import itertools
import random

from firstbyte.router.backpressure import BackendLoad, Ewma, LoadTracker
from firstbyte.router.upstream_metrics import BackendMetrics, parse_backend_metrics

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 3.0
vllm:num_requests_waiting{model_name="m",engine="0"} 2.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.42
vllm:prefix_cache_queries_total{model_name="m"} 1200.0
vllm:prefix_cache_hits_total{model_name="m"} 900.0
garbage line here
"""


def tracker(n: int = 2, limit: int = 4) -> LoadTracker:
    return LoadTracker([BackendLoad(f"b{i}", max_in_flight=limit) for i in range(n)])


def test_parse_vllm_metrics() -> None:
    m = parse_backend_metrics(VLLM_METRICS)
    assert (m.running, m.waiting, m.cache_usage) == (3.0, 2.0, 0.42)
    assert m.counters() == (1200.0, 900.0)
    sg = parse_backend_metrics("sglang:num_running_reqs 5\nsglang:num_queue_reqs 1\n")
    assert (sg.running, sg.waiting) == (5.0, 1.0)
    assert parse_backend_metrics("").running is None


def test_load_is_max_of_own_count_and_fresh_metrics() -> None:
    t = tracker()
    t.started("b0")
    assert t.load("b0", 0.0) == 1
    t.observe_metrics("b0", BackendMetrics(running=3, waiting=0), now=0.0)
    assert t.load("b0", 1.0) == 3
    assert t.load("b0", 100.0) == 1  # stale metrics ignored


def test_saturation_and_region_saturation() -> None:
    t = tracker(limit=2)
    for _ in range(2):
        t.started("b0")
    assert t.saturated("b0", 0.0)
    assert not t.region_saturated(0.0)
    t.observe_metrics("b1", BackendMetrics(running=2, waiting=0), now=0.0)  # others' load
    assert t.saturated("b1", 0.0)
    assert t.region_saturated(0.0)
    t.set_health("b1", False)
    assert t.available(0.0) == []


def test_saturation_agrees_with_the_load_over_every_kind_of_state() -> None:
    # saturated() computes the load inline (it is asked three times a request): over random
    # counts, scrapes of every age, queues and health it says what load() and the queue say.
    rng = random.Random(7)
    for _ in range(2000):
        t = tracker(n=3, limit=rng.choice([1, 4, 16]))
        now = 0.0
        for _ in range(rng.randint(0, 12)):
            name = f"b{rng.randrange(3)}"
            step = rng.random()
            now += rng.choice([0.0, 0.5, 3.0, 6.0])
            if step < 0.4:
                t.started(name, now)
            elif step < 0.55:
                t.finished(name)
            elif step < 0.85:
                t.observe_metrics(name, BackendMetrics(
                    running=rng.choice([None, 0.0, 2.0, 9.0, 30.0]),
                    waiting=rng.choice([None, 0.0, 3.0, 20.0])), now=now)
            elif step < 0.95:
                t.observe_elsewhere(name, rng.randrange(5))
            else:
                t.set_health(name, rng.random() < 0.5)
        at = now + rng.choice([0.0, 1.0, 5.0, 5.5, 30.0])
        for name, b in t.backends.items():
            fresh = b.metrics is not None and b.metrics_at is not None and (
                at - b.metrics_at <= t.metrics_ttl_s
            )
            expected = (not b.healthy or (fresh and b.queued and b.queue > b.max_waiting)
                        or t.load(name, at) >= b.limit)
            assert t.saturated(name, at) is expected
        assert t.available(at) == [n for n in t.backends if not t.saturated(n, at)]
        among = frozenset(["b0", "b2"])
        assert t.available(at, among) == [
            n for n in ("b0", "b2") if not t.saturated(n, at)
        ]


def test_capacity_is_learned_from_a_queue_that_outlives_a_scrape() -> None:
    t = LoadTracker([BackendLoad("b0", max_in_flight=1024, max_waiting=4)])
    # One scrape catching requests waiting for the next scheduler step: nothing learned.
    t.observe_metrics("b0", BackendMetrics(running=40, waiting=60), now=0.0)
    assert t["b0"].slots is None
    assert not t.saturated("b0", 0.5)
    assert t.queue_wait_ms(0.5) == 0.0
    t.observe_metrics("b0", BackendMetrics(running=100, waiting=0), now=1.0)
    assert t["b0"].limit == 1024  # a cap, not the trigger: 100 in flight is fine
    assert not t.saturated("b0", 1.0)
    # A queue in two scrapes in a row: it runs all it can, and that is its capacity.
    t.observe_metrics("b0", BackendMetrics(running=256, waiting=10), now=2.0)
    t.observe_metrics("b0", BackendMetrics(running=256, waiting=12), now=3.0)
    assert t["b0"].slots == 256
    assert t["b0"].limit == 256 + 4
    assert t.saturated("b0", 3.0)  # 268 > 260 (and 12 waiting > 4 allowed)
    assert t.capacity() == 260
    # The queue drains; a scrape showing more running raises the capacity.
    t.observe_metrics("b0", BackendMetrics(running=200, waiting=0), now=4.0)
    assert not t.saturated("b0", 4.0)
    t.observe_metrics("b0", BackendMetrics(running=300, waiting=0), now=5.0)
    assert t["b0"].slots == 300
    # The configured limit stays a cap over anything learned.
    capped = LoadTracker([BackendLoad("c", max_in_flight=64, max_waiting=4)])
    capped.observe_metrics("c", BackendMetrics(running=256, waiting=1), now=0.0)
    capped.observe_metrics("c", BackendMetrics(running=256, waiting=1), now=1.0)
    assert capped["c"].limit == 64


def test_requests_we_just_sent_waiting_for_a_step_are_not_a_queue() -> None:
    # 100 streams at once, 256 slots: every scrape finds the requests that arrived during
    # the current step waiting for the next one. They are ours and brand new: no queue.
    t = LoadTracker([BackendLoad("b0", max_in_flight=1024, max_waiting=4)])
    for second in range(5):
        now = float(second)
        for i in range(40):
            t.started("b0", now - 0.1 + i * 0.0025)
        t.observe_metrics("b0", BackendMetrics(running=100, waiting=40), now=now)
        assert t["b0"].queue == 0
        assert not t.saturated("b0", now)
    assert t["b0"].slots is None
    # The same waiting count with nothing sent lately is a queue (after two scrapes).
    t.observe_metrics("b0", BackendMetrics(running=100, waiting=40), now=10.0)
    t.observe_metrics("b0", BackendMetrics(running=100, waiting=40), now=11.0)
    assert t["b0"].slots == 100
    assert t.saturated("b0", 11.0)


def test_a_backend_whose_cache_runs_out_is_saturated_at_what_it_runs() -> None:
    # KV cache full at 90 sequences (below max_num_seqs): vLLM queues the rest.
    t = LoadTracker([BackendLoad("b0", max_in_flight=1024, max_waiting=4)])
    for now in (0.0, 1.0):
        t.observe_metrics(
            "b0", BackendMetrics(running=90, waiting=30, cache_usage=0.99), now=now
        )
    assert t["b0"].limit == 94
    assert t.saturated("b0", 1.0)
    assert t.retry_after_s(1.0) >= 1


def test_queue_wait_and_retry_after_from_drain_estimate() -> None:
    t = tracker(n=1, limit=4)
    assert t.queue_wait_ms(0.0) == 0.0
    for _ in range(4):
        t.started("b0")
    t.finished("b0", duration_ms=2000.0)
    t.backends["b0"].service_ms = Ewma(0.2, 2000.0)
    for _ in range(8):
        t.started("b0")  # 11 in flight on a limit of 4: 8 over
    wait = t.queue_wait_ms(0.0)
    assert wait == 8 / 4 * 2000.0
    assert t.retry_after_s(0.0) == 4
    t2 = tracker(n=1, limit=4)
    for _ in range(4):
        t2.started("b0")
    assert t2.retry_after_s(0.0) >= 1  # never 0
    t2.set_health("b0", False)
    assert t2.retry_after_s(0.0) >= 1



def test_a_ramp_is_not_a_queue_while_the_backend_runs_more() -> None:
    # 1,000 new streams a second from two router processes: each scrape finds the other
    # process's recent requests waiting (only its own are subtracted), but the backend runs
    # more at every scrape. That is admission lag, not a full backend.
    t = LoadTracker([BackendLoad("b0", max_in_flight=4096, max_waiting=4)])
    for second, running in enumerate((300, 800, 1300, 1800)):
        t.observe_metrics("b0", BackendMetrics(running=running, waiting=120), now=float(second))
        assert not t.saturated("b0", float(second))
        assert t["b0"].slots is None
    # At capacity the count stops growing (a few up or down as sequences end and start):
    # the queue that stays is real, and what it runs is what it can.
    t.observe_metrics("b0", BackendMetrics(running=2048, waiting=300), now=4.0)
    assert not t.saturated("b0", 4.0)  # grew since the last scrape
    t.observe_metrics("b0", BackendMetrics(running=2050, waiting=420), now=5.0)
    assert t["b0"].slots == 2050
    assert t.saturated("b0", 5.0)


def test_first_byte_timeout_follows_the_backends_high_ttft_within_bounds() -> None:
    t = tracker()
    bounds = {"multiple": 4.0, "min_s": 0.5, "max_s": 30.0}
    assert t.first_byte_timeout_s("b0", **bounds) == 30.0  # nothing seen yet: the ceiling
    for _ in range(19):
        t.observe_ttft("b0", 5000.0, upstream_ms=200.0)  # the upstream's own TTFT counts
    t.observe_ttft("b0", 5000.0, upstream_ms=2000.0)  # one outlier of 20: above the p95
    assert t.first_byte_timeout_s("b0", **bounds) == 4 * 0.2
    # b1 has served nothing: the region's TTFTs stand in for its own.
    assert t.first_byte_timeout_s("b1", **bounds) == 4 * 0.2
    t.observe_ttft("b1", 10.0)
    assert t.first_byte_timeout_s("b1", **bounds) == 0.5  # the floor
    for _ in range(64):
        t.observe_ttft("b0", 20_000.0)  # only the last 64 count
    assert t.first_byte_timeout_s("b0", **bounds) == 30.0  # the ceiling


def test_consecutive_5xx_count_until_a_first_token() -> None:
    t = tracker()
    assert [t.observe_5xx("b0") for _ in range(3)] == [1, 2, 3]
    t.observe_ttft("b0", 50.0)
    assert t.observe_5xx("b0") == 1
    assert t.observe_5xx("b1") == 1


def test_room_is_available_and_capacity_in_one_loop() -> None:
    # RouterState.room reads both from LoadTracker.room: the same lists and sums, for every
    # mix of health, learned slots, load and subset asked.
    backends = [BackendLoad(f"b{i}", max_in_flight=4, max_waiting=1) for i in range(4)]
    tracker = LoadTracker(backends)
    backends[1].healthy = False
    backends[2].slots = 2
    for among in (None, frozenset({"b0", "b1"}), frozenset({"b2", "b3"}), frozenset()):
        for loads in itertools.product((0, 2, 3, 4), repeat=4):
            for b, load in zip(backends, loads, strict=True):
                b.in_flight = load
            assert tracker.room(1.0, among) == (
                tracker.available(1.0, among), tracker.capacity(among)
            ), (among, loads)


async def test_a_first_token_is_observed_at_the_time_the_proxy_read() -> None:
    """The routing's first-token hook takes the arrival the proxy read (the request's
    ``first_token_at``): the inter-token timer starts there, the upstream TTFT is counted
    from the request's sending to there, and the region's TTFT histogram has the TTFT."""
    from firstbyte.router.config import parse_config
    from firstbyte.router.hosting.prometheus import GapTimer
    from firstbyte.router.multiregion import Observation
    from firstbyte.router.pipeline.context import RequestContext
    from firstbyte.router.state import RouterState

    state = RouterState(parse_config({
        "upstreams": [{"url": "http://127.0.0.1:9/v1", "name": "b0"}],
        "auth": {"allow_anonymous": True}, "listen": {"insecure_plain_http": True},
    }, "test"))
    try:
        routing = state.routing
        obs = Observation(
            routing, routing.region, "b0", True, False, 100.0, None, gaps=GapTimer(routing.itl)
        )
        ctx = RequestContext("POST", "/v1/chat/completions", {}, received_at=100.0)
        ctx.stream_requested = True
        ctx.upstream_sent_at, ctx.first_token_at = 100.25, 100.75
        obs.first_token(ctx, 750.0)
        assert obs.gaps.last == 100.75
        assert obs.upstream_ttft_ms == 500.0
        assert routing.tracker["b0"].ttft_recent[-1] == 500.0
        hist = routing.ttft[(routing.region, "sse", "")]
        assert (hist.count, hist.total, sum(hist.counts)) == (1, 0.75, 1)
        assert hist.counts[7] == 1  # the 1.0 s bucket: 0.75 s
    finally:
        await state.aclose()
