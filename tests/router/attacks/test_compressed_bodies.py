"""Compressed request bodies against a real router process: a decompression bomb costs at most
the body limit in memory and is a 413; corrupt data is a 400; neither is a traceback, and a
canary stream runs whole through it all."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import httpx

from firstbyte.protocol import error_codes
from tests.router.attacks.conftest import RouterStarter, canary_running, chat_body
from tests.router.conftest import auth

BOMB_BYTES = 10 << 20
"""What the bomb inflates to: ten times the default body limit (1 MiB)."""


def _peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (``VmHWM``): what a bomb inflated whole would raise,
    even if it was freed by the time we look."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _bomb() -> bytes:
    """A chat request padded with 10 MiB of spaces (valid JSON when inflated), ~10 KiB gzipped."""
    head = json.dumps(chat_body(stream=False)).encode()
    return gzip.compress(head[:-1] + b" " * BOMB_BYTES + b"}")


async def test_a_decompression_bomb_is_413_within_the_body_limit(
    start_router_process: RouterStarter,
) -> None:
    bomb = _bomb()
    assert len(bomb) < 64 << 10
    packed = gzip.compress(json.dumps(chat_body(stream=False)).encode())
    headers = {**auth(), "content-encoding": "gzip", "content-type": "application/json"}
    async with start_router_process() as router:
        before = _peak_rss_bytes(router.proc.pid)
        async with canary_running(router):
            answers = []
            for http2 in (False, True):
                async with httpx.AsyncClient(verify=router.client_tls(), http2=http2,
                                             timeout=30) as client:
                    url = router.base_url + "/v1/chat/completions"
                    answers += await asyncio.gather(
                        *(client.post(url, content=bomb, headers=headers) for _ in range(3)))
                    corrupt = await client.post(url, content=packed[:-12] + b"\x00" * 12,
                                                headers=headers)
                    served = await client.post(url, content=packed, headers=headers)
                    assert corrupt.status_code == 400, corrupt.text
                    assert corrupt.json()["error"]["code"] == error_codes.INVALID_CONTENT_ENCODING
                    assert served.status_code == 200, served.text
        grown = _peak_rss_bytes(router.proc.pid) - before
        print(f"6 bombs of {BOMB_BYTES >> 20} MiB ({len(bomb) >> 10} KiB gzipped):"
              f" peak RSS +{grown / (1 << 20):.1f} MiB")
        router.assert_clean_log()
    for answer in answers:
        assert answer.status_code == 413, answer.text
        assert answer.json()["error"]["code"] == error_codes.REQUEST_TOO_LARGE
    # Inflated whole, one bomb alone is 10 MiB (twice that with the copy a join makes).
    assert grown < BOMB_BYTES // 2
