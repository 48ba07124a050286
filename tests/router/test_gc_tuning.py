"""The router's GC tuning: what it sets, that a router process gets it and a test loop does
not, and that stored stream events stay out of the cyclic collector's walks."""

from __future__ import annotations

import asyncio
import gc
import json
import sys

import pytest

from firstbyte.router.hosting.gc_tuning import (
    DEFERRED_THIRD,
    GEN0_THRESHOLD,
    FullCollections,
    restore,
    tune_for_serving,
)
from firstbyte.router.streams import DONE_DATA, StreamEvent, StreamStore

# Runs a sim and a router in one child process (freezing is process-wide state); streams
# one completion through the router and prints the collector's state around it.
_CHILD = """
import asyncio, gc, json, sys
import httpx
from firstbyte.router.config import AuthConfig, ListenConfig, RouterConfig, UpstreamConfig
from firstbyte.router.serve import running_router
from firstbyte.router.sim.server import running_sim

async def main(tune):
    before = {"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count()}
    async with running_sim(profile="instant", served_model_names=["m"]) as sim:
        config = RouterConfig(
            upstreams=[UpstreamConfig(url=sim)],
            listen=ListenConfig(port=0, http3=False, insecure_plain_http=True),
            auth=AuthConfig(allow_anonymous=True),
        )
        kwargs = {"tune_gc": True} if tune else {}
        async with running_router(config, **kwargs) as ep, httpx.AsyncClient() as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "gc"}],
                    "stream": True, "max_tokens": 3}
            response = await client.post(ep.base_url + "/v1/chat/completions", json=body)
            during = {"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count(),
                      "status": response.status_code,
                      "done": response.text.endswith("data: [DONE]\\n\\n")}
    print(json.dumps({"before": before, "during": during}))

asyncio.run(main(sys.argv[1] == "tune"))
"""


async def _child(mode: str) -> dict[str, dict[str, object]]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CHILD, mode,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, stderr.decode()[-2000:]
    result: dict[str, dict[str, object]] = json.loads(stdout)
    return result


def test_tune_for_serving_freezes_and_raises_gen0_then_restores() -> None:
    assert gc.get_freeze_count() == 0  # pytest itself freezes nothing
    old = gc.get_threshold()
    settings = tune_for_serving()
    try:
        assert gc.get_freeze_count() > 1000  # at least the imported modules' objects
        assert gc.get_threshold() == (GEN0_THRESHOLD, old[1], old[2])
        assert settings.thresholds == old
        assert settings.frozen_before == 0
    finally:
        restore(settings)
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == old


def test_tune_for_serving_refuses_a_threshold_that_disables_the_collector() -> None:
    old = gc.get_threshold()
    with pytest.raises(ValueError, match="at least 1"):
        tune_for_serving(0)
    assert gc.get_threshold() == old
    assert gc.get_freeze_count() == 0


async def test_router_process_is_tuned_and_an_embedded_router_is_not() -> None:
    tuned, plain = await asyncio.gather(_child("tune"), _child("plain"))
    for result in (tuned, plain):
        assert result["during"]["status"] == 200
        assert result["during"]["done"] is True
        assert result["before"]["frozen"] == 0
    assert tuned["during"]["threshold"][0] == GEN0_THRESHOLD  # type: ignore[index]
    assert tuned["during"]["threshold"][2] == DEFERRED_THIRD  # type: ignore[index]
    assert tuned["during"]["frozen"] > 1000  # type: ignore[operator]
    assert plain["during"]["threshold"] == plain["before"]["threshold"]
    assert plain["during"]["frozen"] == 0


def test_stored_events_are_not_tracked_by_the_cyclic_gc() -> None:
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60.0)
    stream = store.create(b"owner", now=0.0)
    events = [stream.append(b'{"n": %d}' % i, now=0.0) for i in range(3)]
    stream.finish(now=1.0)
    assert all(event is not None and not gc.is_tracked(event) for event in events)
    assert [e.seq for e in stream.after(0)] == [1, 2, 3, 4]
    assert stream.after(3) == [StreamEvent(4, DONE_DATA)]
    assert stream.after(3)[0].is_done
    assert not stream.after(0)[0].is_done


def test_a_due_full_collection_waits_for_a_quiet_second_or_its_deadline() -> None:
    policy = FullCollections(quiet_share=0.05, max_defer_s=60.0, due_after=10)
    assert not policy.now_due(0.0, 0.0, 3)  # not due: 3 middle collections
    assert not policy.now_due(1.0, 0.01, 9)
    assert not policy.now_due(2.0, 0.50, 10)  # due, but half a core was used this second
    assert not policy.now_due(3.0, 0.90, 11)
    assert policy.now_due(4.0, 0.92, 12)  # 2% of a core: quiet
    busy = FullCollections(quiet_share=0.05, max_defer_s=60.0, due_after=10)
    cpu = 0.0
    for second in range(60):
        cpu += 0.4
        assert not busy.now_due(float(second), cpu, 10)
    assert busy.now_due(60.0, cpu + 0.4, 10)  # never quiet: at its deadline all the same
    assert not busy.now_due(61.0, cpu + 0.8, 0)  # collected: not due again


# A serving process's loop: full collections made due (ten middle-generation collections),
# then the process busy (a thread burning CPU) for 2.5 s, then idle for 2.5 s; prints when
# each full collection ran, relative to the start.
_DEFER_CHILD = """
import asyncio, gc, json, threading, time
from firstbyte.router.hosting.gc_tuning import restore, tune_for_serving
full = []
started = time.monotonic()
gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2
                    and full.append(round(time.monotonic() - started, 2)))
async def main():
    settings = tune_for_serving()
    full.clear()
    busy_until = time.monotonic() + 2.5
    def burn():
        while time.monotonic() < busy_until:
            pass
    thread = threading.Thread(target=burn)
    for _ in range(10):
        gc.collect(1)
    thread.start()
    await asyncio.sleep(5.0)
    thread.join()
    print(json.dumps({"full": full, "third": gc.get_threshold()[2]}))
    restore(settings)
asyncio.run(main())
"""


async def test_a_serving_process_runs_its_full_collection_once_quiet() -> None:
    """A full collection walks every live object (227 ms in a router holding 2,000 streams):
    due while the process works, it waits for the first quiet second."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _DEFER_CHILD,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, stderr.decode()[-2000:]
    result = json.loads(stdout)
    assert result["third"] == DEFERRED_THIRD
    assert len(result["full"]) == 1, result  # one, not while busy, not CPython's at once
    assert 2.5 <= result["full"][0] <= 4.8, result
