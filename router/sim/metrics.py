"""The sim's Prometheus metrics, named as vLLM names them, rendered in the text format.

vLLM (v1 engine) exports, among others: gauges ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:gpu_cache_usage_perc`` (renamed
``vllm:kv_cache_usage_perc`` in newer releases; both are exported here), counters
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (in tokens, exposed with the
``_total`` suffix as prometheus_client does), ``vllm:prompt_tokens``,
``vllm:generation_tokens``, ``vllm:request_success`` (by ``finished_reason``), and histograms
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` (older releases:
``vllm:time_per_output_token_seconds``, also exported) and ``vllm:e2e_request_latency_seconds``.
Every sample carries the ``model_name`` label, as in vLLM. The text is rendered by
:mod:`firstbyte.router.hosting.prometheus`; this module holds vLLM's bucket boundaries.
"""

from __future__ import annotations

__all__ = ["E2E_BUCKETS", "ITL_BUCKETS", "TTFT_BUCKETS"]

# vLLM's bucket boundaries (seconds) for these histograms.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

