"""SIGHUP (and ``firstbyte router reload``) reloads a real router process's config in place:
keys and upstreams change while a stream runs on, over the same HTTP/2 connection; a config
that fails the check, or changes what needs a restart, is refused with one log line."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from firstbyte.cli import CLIError
from firstbyte.router.cli import _check_router_pid
from tests.router.attacks.conftest import RouterStarter, chat_body, router_sections
from tests.router.conftest import API_KEY
from tests.router.upstream import Upstream, running_upstream

from .conftest import H2Session, RouterProcess, content_of, write_config

pytestmark = pytest.mark.slow

NEW_KEY = "sk-added-on-reload"


def _config_path(router: RouterProcess) -> Path:
    return router.log_path.with_suffix(".toml")  # where start_router_process wrote it


def _rewrite(
    router: RouterProcess, tls_files: dict[str, str], upstreams: list[str], **sections: Any
) -> None:
    """Write the router's config file again: the harness's settings, ``sections`` over them."""
    path = _config_path(router)
    write_config(path, router_sections(router.port, tls_files, **sections), upstreams[0])
    with path.open("a") as extra:
        for url in upstreams[1:]:
            extra.write(f'\n[[upstreams]]\nurl = "{url}"\n')


async def _reload(router: RouterProcess, outcome: str = "config reloaded") -> str:
    """SIGHUP the router; the log line saying how it went (``outcome`` in it)."""
    before = router.log().count(outcome)
    router.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while router.log().count(outcome) == before:
        assert router.proc.poll() is None, router.log()[-3000:]
        assert time.monotonic() < deadline, router.log()[-3000:]
        await asyncio.sleep(0.05)
    return [line for line in router.log().splitlines() if outcome in line][-1]


def _words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


async def test_a_key_added_on_sighup_works_on_the_same_connection_as_a_running_stream(
    start_router_process: RouterStarter, upstream: Upstream, tls_files: dict[str, str]
) -> None:
    upstream.delay_s = 0.02
    async with start_router_process() as router:
        session = await H2Session.open(router)
        refused = await session.request(chat_body(2), NEW_KEY)
        await session.read(lambda: refused.ended)
        assert refused.status == 401
        running = await session.request(chat_body(150), API_KEY)  # ~3 s
        await session.read(lambda: b"w3" in running.body)
        _rewrite(router, tls_files, [upstream.url], auth={"api_keys": [API_KEY, NEW_KEY]})
        line = await _reload(router)
        assert "auth.api_keys" in line
        assert NEW_KEY not in router.log()  # key names, never key values
        added = await session.request(chat_body(5), NEW_KEY)
        await session.read(lambda: added.ended and running.ended)
        assert (added.status, content_of(added.body)[0]) == (200, _words(5))
        text, errors, done = content_of(running.body)
        assert (running.status, errors, done, text) == (200, [], True, _words(150))
        assert session.goaway is None
        assert not session.client.closed  # the connection stayed up throughout
    router.assert_clean_log()


async def test_a_broken_config_is_refused_with_one_line_and_the_old_one_serves(
    start_router_process: RouterStarter, upstream: Upstream, tls_files: dict[str, str]
) -> None:
    async with start_router_process() as router:
        _rewrite(router, tls_files, [upstream.url], auth={"api_keys": [API_KEY, NEW_KEY]},
                 warm_prefixes={})  # not a list: fails the schema
        path = _config_path(router)
        path.write_text(path.read_text().replace("[warm_prefixes]", "[warm_prefixes_typo]"))
        line = await _reload(router, "reload refused")
        assert "warm_prefixes_typo: unknown key" in line
        assert "the running config stays" in line
        assert router.log().count("reload refused") == 1
        _rewrite(router, tls_files, [upstream.url], listen={"keep_alive_timeout_s": 5.0})
        line = await _reload(router, "reload refused")
        assert "listen.keep_alive_timeout_s cannot change on reload; restart" in line
        session = await H2Session.open(router)
        old, new = (await session.request(chat_body(3), API_KEY),
                    await session.request(chat_body(3), NEW_KEY))
        await session.read(lambda: old.ended and new.ended)
        assert (old.status, new.status) == (200, 401)
    router.assert_clean_log()


async def test_upstreams_removed_and_added_on_sighup(
    start_router_process: RouterStarter, upstream: Upstream, tls_files: dict[str, str]
) -> None:
    upstream.delay_s = 0.02
    async with running_upstream() as other, start_router_process() as router:
        session = await H2Session.open(router)
        on_first = await session.request(chat_body(100), API_KEY)
        await session.read(lambda: b"w3" in on_first.body)
        _rewrite(router, tls_files, [other.url])  # the first upstream removed
        assert "upstreams" in await _reload(router)
        moved = [await session.request(chat_body(3), API_KEY) for _ in range(3)]
        await session.read(lambda: on_first.ended and all(s.ended for s in moved))
        assert [s.status for s in moved] == [200, 200, 200]
        assert (upstream.started, other.started) == (1, 3)  # new work goes to the new one
        assert content_of(on_first.body)[0] == _words(100)  # the removed one finished its own
        assert (upstream.completed, upstream.cancelled) == (1, 0)
        _rewrite(router, tls_files, [other.url, upstream.url])
        await _reload(router)
        # Distinct prompts: prefix affinity sends one prompt to one backend.
        bodies = [{**chat_body(3), "messages": [{"role": "user", "content": f"question {i}"}]}
                  for i in range(8)]
        both = [await session.request(body, API_KEY) for body in bodies]
        await session.read(lambda: all(s.ended for s in both))
        assert [s.status for s in both] == [200] * 8
        assert upstream.started > 1  # the re-added upstream takes work again
    router.assert_clean_log()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "firstbyte", "router", *args],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])},
    )


async def test_firstbyte_router_reload_checks_the_file_then_signals_the_pid_file(
    start_router_process: RouterStarter, upstream: Upstream, tls_files: dict[str, str],
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "router.pid"
    async with start_router_process(listen={"pid_file": str(pid_file)}) as router:
        assert pid_file.read_text().strip() == str(router.proc.pid)
        config = str(_config_path(router))
        _rewrite(router, tls_files, [upstream.url], listen={"pid_file": str(pid_file)},
                 auth={"api_keys": ["short"]})
        broken = await asyncio.to_thread(_cli, "reload", "--config", config)
        assert broken.returncode == 2
        assert broken.stderr.count("\n") == 1
        assert "auth.api_keys[0]" in broken.stderr
        assert "reload refused" not in router.log()  # checked here: nothing was sent
        _rewrite(router, tls_files, [upstream.url], listen={"pid_file": str(pid_file)},
                 auth={"api_keys": [API_KEY, NEW_KEY]})
        before = router.log().count("config reloaded")
        done = await asyncio.to_thread(_cli, "reload", "--config", config)
        assert done.returncode == 0, done.stderr
        assert f"pid {router.proc.pid}" in done.stdout
        deadline = time.monotonic() + 10
        while router.log().count("config reloaded") == before:
            assert time.monotonic() < deadline, router.log()[-3000:]
            await asyncio.sleep(0.05)
    assert not pid_file.exists()  # removed at exit
    missing = await asyncio.to_thread(_cli, "reload", "--pid-file", str(pid_file))
    assert missing.returncode == 2
    assert "cannot read a pid" in missing.stderr


async def test_a_second_start_on_the_same_pid_file_leaves_it_to_the_running_router(
    start_router_process: RouterStarter, tmp_path: Path,
) -> None:
    """Started again by mistake, the same config cannot bind its port: it must not take the
    pid file over and, leaving, remove it, or `reload` no longer finds the running router."""
    pid_file = tmp_path / "router.pid"
    async with start_router_process(listen={"pid_file": str(pid_file)}) as router:
        config = str(_config_path(router))
        again = await asyncio.to_thread(_cli, "--config", config)
        assert again.returncode == 2, again
        assert again.stderr.count("\n") == 1, again.stderr
        assert f"names pid {router.proc.pid}, a firstbyte router still running" in again.stderr
        assert pid_file.read_text().strip() == str(router.proc.pid)
        done = await asyncio.to_thread(_cli, "reload", "--config", config)
        assert done.returncode == 0, done.stderr
    # A stale file (its router gone) does not stop a start: the same config starts again.
    pid_file.write_text("999999999\n")
    async with start_router_process(listen={"pid_file": str(pid_file)}) as router:
        assert pid_file.read_text().strip() == str(router.proc.pid)


def test_firstbyte_router_reload_signals_nothing_but_a_firstbyte_router(
    tmp_path: Path,
) -> None:
    """A stale pid file may name a pid reused by another process, and ``kill`` reads 0 and -1
    as process groups or every process: SIGHUP would end them. Each is refused, in one line."""
    pid_file = tmp_path / "router.pid"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid_file.write_text(f"{other.pid}\n")
        done = _cli("reload", "--pid-file", str(pid_file))
        assert other.poll() is None  # not signalled
        assert done.returncode == 2, done
        assert done.stderr.count("\n") == 1, done.stderr
        assert f"process {other.pid} is not a firstbyte router (" in done.stderr
        assert f"(a stale {pid_file}?)" in done.stderr
    finally:
        other.kill()
        other.wait()
    # Checked where the pid is read, not through the command: were the check lost, the
    # command would SIGHUP this test's process group, or every process.
    for pid in (0, -1):
        with pytest.raises(CLIError) as info:
            _check_router_pid(pid, str(pid_file))
        assert str(info.value) == f"{pid} is not a process id (a stale {pid_file}?): nothing signalled"
