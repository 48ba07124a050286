"""The soak's phases that change the world rather than open sockets: a blackholed backend and a
removed key's client tokens.

Both act through :class:`~firstbyte.benchmarks.scenarios._soak_target.WorldHooks` (the soak owns
the processes and the router's config) and return a :class:`collections.Counter` like every
other hostile client.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import msgspec

from firstbyte.benchmarks.scenarios._soak_good import MODEL
from firstbyte.benchmarks.scenarios._soak_target import Target, status_class
from firstbyte.protocol import paths

__all__ = ["blackholed_backend", "revoked_tokens"]

SETTLE_S = 3.0
"""After SIGCONT, how long requests that were waiting on the stopped sim still count as its
(the soak's ``upstream_read_timeout_s``: by then each has ended or moved on)."""
RELOAD_WAIT_S = 10.0
"""How long the revoked key may still be accepted after SIGHUP (the reload is asynchronous)."""


async def blackholed_backend(target: Target, until: float) -> Counter[str]:
    """One sim stopped (SIGSTOP: its sockets stay open, nothing answers) until ``until``, then
    continued; what the good clients lost meanwhile and in the :data:`SETTLE_S` after: failed
    tries, requests given up, and their slowest first token, retries included (the canary's
    is in the phase table)."""
    tries, gave_up = target.hooks.good_failures()
    started = time.monotonic()
    name = target.hooks.stop_upstream()
    try:
        await asyncio.sleep(max(0.0, until - time.monotonic()))
    finally:
        target.hooks.continue_upstream()
    stopped_s = time.monotonic() - started
    await asyncio.sleep(SETTLE_S)
    after_tries, after_gave_up = target.hooks.good_failures()
    slowest = target.hooks.good_slowest_first_token_ms(started)
    return Counter({
        f"{name} stopped for {stopped_s:.1f} s": 1,
        f"good clients' failed tries (stopped + {SETTLE_S:g} s)": after_tries - tries,
        f"good requests given up (stopped + {SETTLE_S:g} s)": after_gave_up - gave_up,
        # a number, not a count: the hostile table has one number column
        f"good clients' slowest first token, ms (stopped + {SETTLE_S:g} s)": round(slowest or 0),
    })


async def revoked_tokens(target: Target, until: float) -> Counter[str]:
    """Mint a client token for a key of its own, start a stream with it, remove the key from the
    config and SIGHUP the router; then the token on every path that takes one: each must be
    ``401 client_token_revoked``."""
    del until  # bounded by count: one mint, one stream, one reload, seven tries
    found: Counter[str] = Counter()
    key = target.hooks.revoked_key
    base = target.base_url
    body = {"model": MODEL, "max_tokens": 8, "stream": True,
            "messages": [{"role": "user", "content": "soak revoked token"}]}
    async with httpx.AsyncClient(verify=target.ca_file, timeout=30) as client:
        minted = await client.post(base + paths.EDGE_TOKENS, headers=_auth(key), json={})
        if minted.status_code != 200:
            return Counter({f"mint: {status_class(minted.status_code, minted.content)}": 1})
        token = msgspec.json.decode(minted.content)["token"]
        started = await client.post(base + paths.STREAMS, headers=_auth(token), json=body)
        found[f"stream started before: {status_class(started.status_code, b'')}"] += 1
        stream_id = msgspec.json.decode(started.content).get("stream", "none") if (
            started.status_code == 201) else "none"
        target.hooks.remove_key()
        found[f"key refused after the reload: {await _until_refused(client, base, key)}"] += 1
        async with httpx.AsyncClient(verify=target.ca_file, http2=True, timeout=30) as h2:
            for name, reply in await _paths(h2, base, token, stream_id, body):
                found[f"{name}: {status_class(reply.status_code, reply.content)}"] += 1
        found[f"WebSocket: {await _websocket(target, token)}"] += 1
    return found


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _until_refused(client: httpx.AsyncClient, base: str, key: str) -> str:
    """Mint again with the removed key until it is refused (the reload done), bounded."""
    deadline = time.monotonic() + RELOAD_WAIT_S
    while True:
        reply = await client.post(base + paths.EDGE_TOKENS, headers=_auth(key), json={})
        if reply.status_code != 200:
            return status_class(reply.status_code, reply.content)
        if time.monotonic() > deadline:
            return f"still 200 after {RELOAD_WAIT_S:g} s"
        await asyncio.sleep(0.1)


async def _paths(client: httpx.AsyncClient, base: str, token: str, stream_id: str,
                 body: dict[str, object]) -> list[tuple[str, httpx.Response]]:
    stream = base + paths.stream(stream_id)
    return [
        ("chat completion", await client.post(base + paths.CHAT_COMPLETIONS,
                                              headers=_auth(token), json=body)),
        ("new stream", await client.post(base + paths.STREAMS, headers=_auth(token), json=body)),
        ("stream read (SSE)", await client.get(stream, headers=_auth(token))),
        ("stream read (?token=)", await client.get(stream, params={"token": token})),
        ("long-poll", await client.get(base + paths.stream_poll(stream_id), headers=_auth(token),
                                       params={"wait": "0"})),
        ("timings", await client.post(base + paths.EDGE_TIMINGS, headers=_auth(token),
                                      json={})),
    ]


async def _websocket(target: Target, token: str) -> str:
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    url = f"wss://{target.host}:{target.port}{paths.WEBSOCKET}"
    try:
        async with asyncio.timeout(10), connect(
            url, ssl=target.tls("http/1.1"), proxy=None,
            subprotocols=["firstbyte.v1", f"firstbyte.token.{token}"],  # type: ignore[list-item]
        ):
            return "opened"
    except InvalidStatus as exc:
        return status_class(exc.response.status_code, bytes(exc.response.body or b""))
    except (OSError, TimeoutError) as exc:
        return type(exc).__name__
