"""firstbyte's edge client SDK: prewarmed connections, one streaming API over SSE, WebSocket
and long-poll on HTTP/1.1, HTTP/2 and HTTP/3, phase timings, resume and regional failover."""

from __future__ import annotations

from client_sdk.budget import BudgetReport, LatencyBudget

__version__ = "0.1.0"

__all__ = ["BudgetReport", "LatencyBudget", "__version__"]
