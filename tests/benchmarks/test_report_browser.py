"""The reports in a real browser: headless Chromium (installed by the fixture when missing)
loads each page from disk with no console error, no failed load and no request beyond the
file itself, shows the headline and every figure with drawn content, and fits a phone."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from firstbyte.benchmarks.browser import load
from firstbyte.benchmarks.report import write_combined_report, write_report
from tests.benchmarks.chromium import chromium_or_skip
from tests.benchmarks.reports_data import demo_like, overhead_like
from tests.cli import firstbyte

CHECK = """(() => {
  const figures = [...document.querySelectorAll('figure[data-figure]')].map(f => ({
    key: f.dataset.figure,
    panels: f.querySelectorAll('svg.chart').length,
    drawn: [...f.querySelectorAll('svg.chart')].every(s => s.getBoundingClientRect().height > 50
      && s.querySelectorAll('circle, polyline, rect').length > 0),
  }));
  const answer = document.querySelector('[data-headline]');
  return {figures, headline: answer ? answer.innerText : '',
          overflow: document.documentElement.scrollWidth - window.innerWidth};
})()"""


@pytest.fixture(scope="module")
def chromium() -> str:
    """The system Chromium (see :func:`install_chromium`)."""
    return chromium_or_skip()


def check_page(page: Path, figures: set[str], words: str, width: int = 1000) -> None:
    got = load(page, width=width, evaluate=CHECK)
    assert got.errors == []
    assert got.requests == [page.resolve().as_uri()]  # the page itself, nothing else
    value = got.value
    assert words in value["headline"]
    shown = {f["key"] for f in value["figures"]}
    assert figures <= shown, shown
    assert all(f["drawn"] and f["panels"] for f in value["figures"]), value["figures"]
    assert value["overflow"] <= 0, "the page is wider than the screen"


@pytest.mark.usefixtures("chromium")
def test_demo_report_loads_cleanly_on_desktop_and_phone(tmp_path: Path) -> None:
    page = write_report(demo_like(20), tmp_path)["html"]
    for width in (1000, 400):
        check_page(page, {"ttft-dots", "ttft-cdf", "budget"}, "Prewarming saved", width)


@pytest.mark.usefixtures("chromium")
def test_bench_all_page_loads_cleanly(tmp_path: Path) -> None:
    combined = {"scenario": "all", "quick": True,
                "scenarios": {"demo": demo_like(3), "router_overhead": overhead_like()}}
    page = write_combined_report(combined, tmp_path)["html"]
    check_page(page, {"ttft-dots", "budget", "overhead"}, "router added")


@pytest.mark.usefixtures("chromium")
def test_a_broken_page_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><img src="missing.png"><script>console.error("bad")'
                    "</script>")
    errors = load(page).errors
    assert any("console.error: bad" in e for e in errors), errors
    assert any("missing.png" in e or "ERR_FILE_NOT_FOUND" in e for e in errors), errors


@pytest.mark.usefixtures("chromium")
def test_screenshot_command_writes_a_png(tmp_path: Path) -> None:
    page = write_report(demo_like(5), tmp_path)["html"]
    png = tmp_path / "shot.png"
    done = firstbyte("bench", "screenshot", str(page), str(png), "--width", "400", timeout=120)
    assert done.returncode == 0, done.stderr
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "400x" in done.stderr
    missing = firstbyte("bench", "screenshot", str(tmp_path / "nope.html"), str(png))
    assert missing.returncode == 2
    assert "no such file" in missing.stderr
    assert "Traceback" not in missing.stderr


@pytest.mark.usefixtures("chromium")
def test_a_browser_run_leaves_no_folder_and_no_process_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chromium's singleton folder (``org.chromium.Chromium.*`` under TMPDIR) and the profile
    go with the run, and no helper process outlives it."""
    page = write_report(demo_like(5), tmp_path)["html"]
    # Short, unlike tmp_path: Chromium's singleton socket lives a few folders below TMPDIR.
    system_tmp = Path(tempfile.mkdtemp(prefix="fb-"))
    try:
        monkeypatch.setenv("TMPDIR", str(system_tmp))
        monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
        got = load(page, width=400)
        assert got.errors == []
        assert list(system_tmp.iterdir()) == []
        left = subprocess.run(["pgrep", "-f", f"--user-data-dir={system_tmp}"],
                              capture_output=True, text=True)
        assert left.stdout == ""
    finally:
        shutil.rmtree(system_tmp, ignore_errors=True)
