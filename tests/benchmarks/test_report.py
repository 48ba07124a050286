from __future__ import annotations

import io
import math
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from firstbyte.benchmarks.progress import Progress
from firstbyte.benchmarks.report import markdown_summary, write_report
from firstbyte.benchmarks.stats import METRIC_DEFINITIONS, SLO, describe, percentile, summarize
from firstbyte.client_sdk.timings import Timings


def make_timings(rtt_ms: float, n: int, seed: int = 0) -> list[Timings]:
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        sent = 2 * rtt_ms + rnd.random()
        first_byte = sent + rtt_ms + rnd.random()
        first_token = first_byte + 80 + rnd.random() * 10
        gaps = [15 + rnd.random() * 10 for _ in range(9)]
        out.append(
            Timings(
                tcp_connect_ms=rtt_ms,
                tls_handshake_ms=rtt_ms,
                request_sent_ms=sent,
                first_byte_ms=first_byte,
                first_token_ms=first_token,
                inter_token_ms=gaps,
                last_token_ms=first_token + sum(gaps),
                render_ms=first_token + 1,
                output_chunks=10,
            )
        )
    return out


def results() -> dict[str, Any]:
    runs = []
    for geography, rtt in (("us-east-1", 5.0), ("ap-southeast-1", 120.0)):
        summary = summarize(make_timings(rtt, 40), duration_s=2.0, slo=SLO(ttft_ms=300))
        runs.append(
            {"label": geography, "transport": "sse", "protocol": "HTTP/2", "geography": geography}
            | summary
        )
    runs[0]["p99_nan_ms"] = math.nan  # must not break the JSON
    return {"scenario": "unit", "quick": True, "summary": {"ratio": 3.5}, "runs": runs}


def test_percentile_matches_linear_interpolation() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="percentile"):
        percentile(values, 101)


def test_describe_uses_vllm_field_names() -> None:
    out = describe([10.0, 20.0, 30.0], "ttft")
    assert out["mean_ttft_ms"] == pytest.approx(20.0)
    assert out["median_ttft_ms"] == pytest.approx(20.0)
    assert out["std_ttft_ms"] == pytest.approx(math.sqrt(200 / 3))
    assert set(out) >= {"p50_ttft_ms", "p90_ttft_ms", "p95_ttft_ms", "p99_ttft_ms"}
    assert describe([], "itl")["p99_itl_ms"] == 0.0


def test_summarize_fields_and_goodput() -> None:
    fast = make_timings(5.0, 30)
    slow = make_timings(150.0, 10, seed=1)
    out = summarize(fast + slow, duration_s=4.0, failed=2, slo=SLO(ttft_ms=300))
    assert out["completed"] == 40
    assert out["failed"] == 2
    assert out["duration"] == 4.0
    assert out["request_throughput"] == pytest.approx(10.0)
    assert out["output_throughput"] == pytest.approx(100.0)
    # TPOT = (E2EL - TTFT) / (tokens - 1) = mean gap here
    mean_gap = sum(sum(t.inter_token_ms) for t in fast + slow) / (40 * 9)
    assert out["mean_tpot_ms"] == pytest.approx(mean_gap)
    assert out["mean_itl_ms"] == pytest.approx(mean_gap)
    assert out["p50_first_byte_ms"] > 0
    assert out["p99_connect_ms"] == pytest.approx(300.0)
    # the 10 transpacific requests miss the 300 ms TTFT SLO; failures count against goodput
    assert out["goodput"] == pytest.approx(30 / 4.0)
    assert out["goodput_fraction"] == pytest.approx(30 / 42)
    assert len(out["ttfts_ms"]) == 40
    assert set(out["budget_lines_ms"]) == {
        "network",
        "first_byte",
        "first_token",
        "next_tokens",
        "render",
    }


def test_write_report_produces_valid_json_markdown_and_html(tmp_path: Path) -> None:
    paths = write_report(results(), tmp_path / "out")
    assert set(paths) == {"json", "markdown", "html"}
    decoded = msgspec.json.decode(paths["json"].read_bytes())
    assert decoded["scenario"] == "unit"
    assert decoded["metric_definitions"] == METRIC_DEFINITIONS
    assert decoded["runs"][0]["p99_nan_ms"] is None
    assert decoded["runs"][1]["p99_ttft_ms"] > decoded["runs"][0]["p99_ttft_ms"]
    assert decoded["conditions"]["command"]
    page = paths["html"].read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert 'data-figure="budget"' in page  # the runs carry budget lines
    text = paths["markdown"].read_text()
    assert text.startswith("# Benchmark: unit")
    assert "| us-east-1 sse HTTP/2 |" in text
    assert "TTFT p99 ms" in text
    assert "[report.html](report.html)" in text
    assert "request start to the first content chunk" in text
    assert "(E2EL - TTFT) / (output tokens - 1)" in text


def test_report_without_request_runs_has_no_latency_plots(tmp_path: Path) -> None:
    paths = write_report(
        {"scenario": "cpu", "runs": [{"label": "a", "events_per_s": 10.0, "ok": True}]},
        tmp_path,
    )
    assert set(paths) == {"json", "markdown", "html"}
    page = paths["html"].read_text()
    assert 'data-figure="throughput"' in page
    assert 'data-figure="ttft-cdf"' not in page
    text = paths["markdown"].read_text()
    assert "| run | events_per_s | ok |" in text
    assert "| a | 10.0 | True |" in text


def test_markdown_lists_every_metric_definition() -> None:
    text = markdown_summary({"scenario": "x"})
    for name in ("TTFT", "ITL", "TPOT", "E2EL", "goodput"):
        assert f"**{name}**" in text


def test_progress_prints_quarters_when_not_a_tty() -> None:
    out = io.StringIO()
    with Progress(8, "unit", stream=out) as bar:
        for _ in range(8):
            bar.advance()
    lines = out.getvalue().splitlines()
    assert [line.split("]")[1].split()[0] for line in lines] == ["2/8", "4/8", "6/8", "8/8"]
    assert all(line.startswith("unit [") for line in lines)


def test_markdown_leaves_the_tails_of_a_few_requests_blank() -> None:
    """As report.html does (docs/reports.md): a P95 of 3 requests is its largest one."""
    few = {"label": "cold", "completed": 3, "p50_ttft_ms": 8.5, "p95_ttft_ms": 8.99,
           "p99_ttft_ms": 9.02}
    enough = {**few, "label": "warm", "completed": 20}
    text = markdown_summary({"scenario": "x", "runs": [few, enough]})
    assert "| cold | 3 | 8.50 | n<20 | n<20 |" in text, text
    assert "| warm | 20 | 8.50 | 8.99 | 9.02 |" in text, text
