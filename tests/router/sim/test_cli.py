"""``firstbyte sim`` as a real process: start-up line, serving, clean exit, clear user errors."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from firstbyte.protocol.sse import DONE
from firstbyte.router.hosting.gc_tuning import GEN0_THRESHOLD
from tests.cli import FIRSTBYTE

SIM = [*FIRSTBYTE, "sim"]


@pytest.fixture
def sim_process() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def start(procs: list[subprocess.Popen[str]], *args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [*SIM, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    procs.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"serving (http://\S+)", line)
    assert match, (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
    return proc, match.group(1)


def wait_healthy(url: str, within_s: float = 15.0) -> None:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError(f"{url} not healthy")


def stream_text(url: str) -> list[str]:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 3,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        return [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]


def test_serves_and_exits_cleanly_on_sigterm(sim_process: list[subprocess.Popen[str]]) -> None:
    proc, url = start(
        sim_process, "--port", "0", "--profile", "instant", "--seed", "3",
        "--served-model-name", "m",
    )
    data = stream_text(url)
    assert data[-1] == DONE
    assert len(data) == 1 + 3 + 1 + 1
    assert "vllm:num_requests_running" in httpx.get(f"{url}/metrics").text
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    assert proc.stderr is not None
    assert "Traceback" not in proc.stderr.read()


_GC_WATCH = """
import gc, sys, threading, time
from firstbyte.cli import main
def report():
    deadline = time.monotonic() + 10
    while gc.get_freeze_count() == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    print(f"gc {gc.get_threshold()[0]} {gc.get_freeze_count()}", file=sys.stderr, flush=True)
threading.Thread(target=report, daemon=True).start()
sys.exit(main(sys.argv[1:]))
"""


def test_the_sim_process_sets_its_gc_as_a_router_does(
    sim_process: list[subprocess.Popen[str]],
) -> None:
    """At CPython's defaults a sim holding 2,000 streams stalled its engine for full
    collections of 75-133 ms a few times a ramp; a GPU does not. Start-up frozen out of every
    collection and the young generation's threshold raised, as in a router process."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _GC_WATCH, "sim", "--port", "0", "--profile", "instant"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    sim_process.append(proc)
    assert proc.stdout is not None
    assert proc.stderr is not None
    assert "serving http://" in proc.stdout.readline()
    line = proc.stderr.readline().split()
    while line and line[0] != "gc":  # a log line first
        line = proc.stderr.readline().split()
    assert line, "the sim exited before the GC was read"
    assert int(line[1]) == GEN0_THRESHOLD
    assert int(line[2]) > 10_000  # the modules, functions and classes loaded at start-up
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


def test_granian_server_option(sim_process: list[subprocess.Popen[str]]) -> None:
    """``--port 0`` as with the other servers: the start-up line has the port granian
    serves on (it said 127.0.0.1:0). A busy port is one line, not granian's traceback."""
    proc = subprocess.Popen(
        [*SIM, "--port", "0", "--profile", "instant", "--server", "granian",
         "--served-model-name", "other", "m"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sim_process.append(proc)
    assert proc.stdout is not None
    match = re.search(r"serving (http://127\.0\.0\.1:(\d+)) ", proc.stdout.readline())
    assert match
    url = match.group(1)
    wait_healthy(url)
    assert stream_text(url)[-1] == DONE
    busy = subprocess.run([*SIM, "--port", match.group(2), "--server", "granian"],
                          capture_output=True, text=True, timeout=30)
    assert busy.returncode == 2
    assert busy.stderr == (f"firstbyte sim: error: cannot listen on 127.0.0.1:{match.group(2)}:"
                           " Address already in use\n")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fault", "explode"], "unknown fault 'explode'"),
        (["--fault", "stall:after=x"], "after must be a number"),
        (["--certfile", "/nonexistent.pem"], "--certfile and --keyfile go together"),
        (["--certfile", "/nonexistent.pem", "--keyfile", "/x.pem"], "no such file"),
        (["--certfile", __file__, "--keyfile", __file__], f"--certfile: no PEM certificate in {__file__}"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--queue-limit", "-1"], "--queue-limit must be >= 0"),
        (["--port", "70000"], "--port must be 0..65535"),
        (["--profile", "gpu-9000"], "invalid choice"),
        (["--served-model-name", ""], "--served-model-name: a name cannot be empty"),
        (["--served-model-name"], "expected at least one argument"),
        (["--max-model-len", "0"], "--max-model-len must be >= 1"),
    ],
)
def test_user_errors_are_clear(args: list[str], message: str) -> None:
    result = subprocess.run([*SIM, *args], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_an_encrypted_key_is_named_and_no_pass_phrase_is_asked(tmp_path: Path) -> None:
    """OpenSSL asks an encrypted key's pass phrase on the terminal: the sim would wait there
    (and the server load the key again). It says what is wrong instead, as the router does."""
    issued = trustme.CA().issue_cert("localhost")
    key = serialization.load_pem_private_key(issued.private_key_pem.bytes(), password=None)
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    ))  # fmt: skip
    issued.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    result = subprocess.run(
        [*SIM, "--certfile", str(tmp_path / "cert.pem"), "--keyfile", str(tmp_path / "key.pem")],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 2
    assert "pass phrase" not in result.stdout + result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "the private key is encrypted; give an unencrypted key" in result.stderr


def test_port_in_use_is_a_user_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [*SIM, "--port", str(port)], capture_output=True, text=True, timeout=30
        )
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_documents_the_fault_grammar() -> None:
    result = subprocess.run([*SIM, "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    for text in ("stall:after=N", "drop:after=N", "delay:ms=M", "error503:rate=R", "h100-7b"):
        assert text in result.stdout
