"""Prometheus text for routing across regions (appended to the router's ``/metrics``).

Families (all prefixed ``firstbyte_``):
``route_requests_total{region,backend,outcome}`` (finished requests by serving region and
backend: ``ok``/``error``; ``rejected`` for 429s), ``route_forwards_total{to}``,
``route_spills_total{to,reason}`` (``saturated`` | ``first_token_deadline``),
``route_spill_in_progress``, ``route_ttft_seconds{region}`` and ``route_itl_seconds``
(histograms), ``backend_in_flight``/``backend_load``/``backend_queue``/``backend_saturated``/
``backend_healthy``/``backend_cache_hit_ratio`` ``{backend}``,
``warm_state{backend,prefix}`` (1 warm, 0 not), ``warmups_total``/``warm_evictions_total``
``{backend,prefix}``, ``backend_restarts_total{backend}``, ``peer_up{peer}``,
``peer_rtt_ms{peer}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .metrics import Histogram

if TYPE_CHECKING:
    from .multiregion import RegionRouting

__all__ = ["render"]


def _labels(**labels: str) -> str:
    inner = ",".join(
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in labels.items()
    )
    return "{" + inner + "}"


def _family(lines: list[str], name: str, kind: str, help_text: str) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")


def _histogram(lines: list[str], name: str, hist: Histogram, **labels: str) -> None:
    if not labels:
        lines.extend(hist.render(name))
        return
    extra = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in hist.render(name):
        if "{" in line:
            lines.append(line.replace("{", "{" + extra + ",", 1))
        else:
            metric, value = line.split(" ", 1)
            lines.append(f"{metric}{{{extra}}} {value}")


def render(r: RegionRouting) -> str:
    now = r.clock()
    lines: list[str] = []
    _family(lines, "firstbyte_route_requests_total", "counter",
            "Routed requests by serving region, backend and outcome.")
    for (region, backend, outcome), n in sorted(r.outcomes.items()):
        lab = _labels(region=region, backend=backend, outcome=outcome)
        lines.append(f"firstbyte_route_requests_total{lab} {n}")
    _family(lines, "firstbyte_route_backend_choices_total", "counter",
            "Local backend choices by reason (affinity, new-key, balance, ...).")
    for reason, n in sorted(r.choices.items()):
        lines.append(f"firstbyte_route_backend_choices_total{_labels(reason=reason)} {n}")
    _family(lines, "firstbyte_route_forwards_total", "counter",
            "Requests forwarded to a peer region expected to answer first.")
    for to, n in sorted(r.forwards.items()):
        lines.append(f"firstbyte_route_forwards_total{_labels(to=to)} {n}")
    _family(lines, "firstbyte_route_spills_total", "counter",
            "Requests spilled to a peer region (this region saturated, or first token late).")
    for (to, reason), n in sorted(r.spills.items()):
        lines.append(f"firstbyte_route_spills_total{_labels(to=to, reason=reason)} {n}")
    _family(lines, "firstbyte_route_spill_in_progress", "gauge",
            "Spilled requests in progress (bounded by the spill budget).")
    lines.append(f"firstbyte_route_spill_in_progress {r.spill.spilling}")
    _family(lines, "firstbyte_route_ttft_seconds", "histogram",
            "Request arrival to first content chunk, by serving region.")
    for region, hist in sorted(r.ttft.items()):
        _histogram(lines, "firstbyte_route_ttft_seconds", hist, region=region)
    _family(lines, "firstbyte_route_itl_seconds", "histogram",
            "Gap between successive streamed chunks after the first.")
    _histogram(lines, "firstbyte_route_itl_seconds", r.itl)
    gauges = {
        "firstbyte_backend_in_flight": "Requests in flight to the backend (router's count).",
        "firstbyte_backend_load": "max(in flight, reported running + waiting).",
        "firstbyte_backend_queue": "Waiting requests the backend reports.",
        "firstbyte_backend_saturated": "1 if the backend is at its limit.",
        "firstbyte_backend_healthy": "1 if the backend answered its last scrape.",
        "firstbyte_backend_cache_hit_ratio": "Prefix-cache hits / queries since it started.",
    }
    values: dict[str, list[str]] = {name: [] for name in gauges}

    def put(name: str, lab: str, value: float) -> None:
        values[f"firstbyte_backend_{name}"].append(f"firstbyte_backend_{name}{lab} {value:g}")

    for name, b in r.tracker.backends.items():
        lab = _labels(backend=name)
        m = b.metrics
        put("in_flight", lab, b.in_flight)
        put("load", lab, r.tracker.load(name, now))
        put("queue", lab, m.waiting if m is not None and m.waiting is not None else 0)
        put("saturated", lab, int(r.tracker.saturated(name, now)))
        put("healthy", lab, int(b.healthy))
        if m is not None and m.prefix_queries and m.prefix_hits is not None:
            put("cache_hit_ratio", lab, round(m.prefix_hits / m.prefix_queries, 4))
    for name, help_text in gauges.items():
        _family(lines, name, "gauge", help_text)
        lines.extend(values[name])
    s = r.scheduler
    _family(lines, "firstbyte_warm_state", "gauge", "1 if the prefix is warm on the backend.")
    for backend, states in sorted(s.registry().items()):
        for prefix, state in sorted(states.items()):
            lab = _labels(backend=backend, prefix=prefix)
            lines.append(f"firstbyte_warm_state{lab} {int(state == 'warm')}")
    _family(lines, "firstbyte_warmups_total", "counter", "Warmup probes that succeeded.")
    for (backend, prefix), n in sorted(s.warmups_total.items()):
        lines.append(f"firstbyte_warmups_total{_labels(backend=backend, prefix=prefix)} {n}")
    _family(lines, "firstbyte_warm_evictions_total", "counter",
            "Re-probes that found a warmed prefix evicted.")
    for (backend, prefix), n in sorted(s.evictions_total.items()):
        lines.append(f"firstbyte_warm_evictions_total{_labels(backend=backend, prefix=prefix)} {n}")
    _family(lines, "firstbyte_backend_restarts_total", "counter",
            "Backend restarts detected (health flap or counters going backwards).")
    for backend, n in sorted(s.restarts_total.items()):
        lines.append(f"firstbyte_backend_restarts_total{_labels(backend=backend)} {n}")
    _family(lines, "firstbyte_peer_up", "gauge", "1 if the peer's status is fresh.")
    fresh = r.peer_table.fresh(now)
    for name in sorted(r.peer_table.peers):
        lines.append(f"firstbyte_peer_up{_labels(peer=name)} {int(name in fresh)}")
    _family(lines, "firstbyte_peer_rtt_ms", "gauge", "Router-to-router RTT (EWMA of status polls).")
    for name, peer in sorted(r.peer_table.peers.items()):
        if peer.rtt_ms is not None and peer.rtt_ms.value is not None:
            lines.append(f"firstbyte_peer_rtt_ms{_labels(peer=name)} {peer.rtt_ms.value:.3f}")
    return "\n".join(lines) + "\n"
