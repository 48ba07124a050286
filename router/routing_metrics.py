"""Prometheus text for routing across regions (appended to the router's ``/metrics``).

Families (all prefixed ``firstbyte_``):
``route_requests_total{region,backend,outcome,model}`` (finished requests by serving region
and backend: ``ok``/``error``; ``rejected`` for 429s), ``route_forwards_total{to}``,
``route_spills_total{to,reason}`` (``saturated`` | ``first_token_deadline``),
``route_spill_in_progress``, ``route_spill_refused_total{reason}`` (the spill budget said no),
``route_rejections_total{reason,model}`` (429s by reason),
``route_ttft_seconds{region,transport,model}`` and
``route_itl_seconds`` (histograms), ``backend_in_flight``/``backend_load``/``backend_queue``/
``backend_limit``/``backend_saturated``/``backend_healthy``/``backend_cache_hit_ratio``
``{backend}``, ``warm_state{backend,prefix}`` (1 warm, 0 not),
``warmups_total``/``warm_evictions_total`` ``{backend,prefix}``,
``backend_restarts_total{backend}``, ``backend_serves{backend,model}`` (1 per model served),
``peer_up{peer}``, ``peer_rtt_seconds{peer}``.

``model`` is the request's model where routing found it listed here or by a peer, else ``""``
(:attr:`~firstbyte.router.pipeline.context.RequestContext.model_label`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .hosting.prometheus import family, labels, render_counter, render_gauge
from .metrics import SUM_SPEC

if TYPE_CHECKING:
    from .multiregion import RegionRouting

__all__ = ["render"]


def render(r: RegionRouting) -> str:
    now = r.clock()
    lines = [
        *render_counter(
            "firstbyte_route_requests_total",
            "Routed requests by serving region, backend, outcome and model.",
            [
                (labels(region=region, backend=backend, outcome=outcome, model=model), n)
                for (region, backend, outcome, model), n in sorted(r.outcomes.items())
            ],
        ),
        *render_counter(
            "firstbyte_route_backend_choices_total",
            "Local backend choices by reason (affinity, new-key, balance, ...).",
            [(labels(reason=reason), n) for reason, n in sorted(r.choices.items())],
        ),
        *render_counter(
            "firstbyte_route_forwards_total",
            "Requests forwarded to a peer region expected to answer first.",
            [(labels(to=to), n) for to, n in sorted(r.forwards.items())],
        ),
        *render_counter(
            "firstbyte_route_spills_total",
            "Requests spilled to a peer region (this region saturated, or first token late).",
            [(labels(to=to, reason=reason), n) for (to, reason), n in sorted(r.spills.items())],
        ),
        *render_gauge(
            "firstbyte_route_spill_in_progress",
            "Spilled requests in progress (bounded by the spill budget).",
            [("", r.spill.spilling)],
        ),
        *render_counter(
            "firstbyte_route_spill_refused_total",
            "Spills refused because the spill budget was used up (the request stayed here).",
            [(labels(reason=reason), n) for reason, n in sorted(r.spill.refused.items())],
        ),
        *render_counter(
            "firstbyte_route_rejections_total",
            "Requests refused by routing here (429; 503 no_healthy_backend), by reason and model.",
            [
                (labels(reason=reason, model=model), n)
                for (reason, model), n in sorted(r.rejections.items())
            ],
        ),
        *family(
            "firstbyte_route_ttft_seconds",
            "histogram",
            "Request arrival to first content chunk, by serving region, transport and model.",
        ),
    ]
    for (region, transport, model), hist in sorted(r.ttft.items()):
        lab = labels(region=region, transport=transport, model=model)
        lines += hist.samples("firstbyte_route_ttft_seconds", lab, SUM_SPEC)
    lines += r.itl.render(
        "firstbyte_route_itl_seconds",
        "Gap between successive streamed chunks after the first.",
        sum_spec=SUM_SPEC,
    )
    gauges = {
        "in_flight": "Requests in flight to the backend (router's count).",
        "load": "max(in flight, reported running + waiting).",
        "queue": "Waiting requests the backend reports.",
        "limit": "Load at which it is saturated: learned capacity + allowed queue, capped.",
        "saturated": "1 if the backend is at its limit.",
        "healthy": "1 if in rotation: 0 after a failed scrape, a refused connect, an ejection.",
        "cache_hit_ratio": "Prefix-cache hits / queries since it started.",
    }
    values: dict[str, list[tuple[str, float]]] = {name: [] for name in gauges}
    for name, b in r.tracker.backends.items():
        lab = labels(backend=name)
        m = b.metrics
        values["in_flight"].append((lab, b.in_flight))
        values["load"].append((lab, r.tracker.load(name, now)))
        values["queue"].append((lab, m.waiting if m is not None and m.waiting is not None else 0))
        values["limit"].append((lab, b.limit))
        values["saturated"].append((lab, int(r.tracker.saturated(name, now))))
        values["healthy"].append((lab, int(b.healthy)))
        if m is not None and m.prefix_queries and m.prefix_hits is not None:
            values["cache_hit_ratio"].append((lab, round(m.prefix_hits / m.prefix_queries, 4)))
    for name, help_text in gauges.items():
        lines += render_gauge(f"firstbyte_backend_{name}", help_text, values[name], "g")
    s = r.scheduler
    lines += render_gauge(
        "firstbyte_warm_state",
        "1 if the prefix is warm on the backend.",
        [
            (labels(backend=backend, prefix=prefix), int(state == "warm"))
            for backend, states in sorted(s.registry().items())
            for prefix, state in sorted(states.items())
        ],
    )
    lines += render_counter(
        "firstbyte_warmups_total",
        "Warmup probes that succeeded.",
        [(labels(backend=b, prefix=p), n) for (b, p), n in sorted(s.warmups_total.items())],
    )
    lines += render_counter(
        "firstbyte_warm_evictions_total",
        "Re-probes that found a warmed prefix evicted.",
        [(labels(backend=b, prefix=p), n) for (b, p), n in sorted(s.evictions_total.items())],
    )
    lines += render_counter(
        "firstbyte_backend_ejections_total",
        "Backends ejected by passive health, by cause (first_byte_timeout, reset, 5xx).",
        [(labels(backend=b, cause=c), n) for (b, c), n in sorted(r.ejections.items())],
    )
    lines += render_counter(
        "firstbyte_backend_restarts_total",
        "Backend restarts detected (health flap or counters going backwards).",
        [(labels(backend=b), n) for b, n in sorted(s.restarts_total.items())],
    )
    lines += render_gauge(
        "firstbyte_backend_serves",
        "1 for each model the backend serves (configured, or listed by its /v1/models).",
        [
            (labels(backend=name, model=model), 1)
            for name, models in sorted(r.models.lists.items())
            for model in sorted(models or ())
        ],
    )
    fresh = r.peer_table.fresh(now)
    lines += render_gauge(
        "firstbyte_peer_up",
        "1 if the peer's status is fresh.",
        [(labels(peer=name), int(name in fresh)) for name in sorted(r.peer_table.peers)],
    )
    lines += render_gauge(
        "firstbyte_peer_rtt_seconds",
        "Router-to-router RTT (EWMA of status polls).",
        [
            (labels(peer=name), peer.rtt_ms.value / 1000)
            for name, peer in sorted(r.peer_table.peers.items())
            if peer.rtt_ms is not None and peer.rtt_ms.value is not None
        ],
        ".6f",
    )
    return "\n".join(lines) + "\n"
