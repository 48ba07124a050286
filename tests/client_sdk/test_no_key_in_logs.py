"""An application logging everything at DEBUG still never logs the API key (HTTP/2's header
compression libraries log header values at DEBUG). The client runs in its own process: the
router under test shares this one and sets those loggers itself."""

from __future__ import annotations

import asyncio
import sys

import pytest

from tests.client_sdk.conftest import ROUTER_KEY, Stack

CLIENT = """
import asyncio, logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
from firstbyte.client_sdk.client import AsyncClient

async def main(url, key, ca_file, http):
    async with AsyncClient(url, key, ca_file=ca_file, http=http) as client:
        async with client.stream(model="sim-instant", max_tokens=4,
                                 messages=[{"role": "user", "content": "hi"}]) as stream:
            print("".join([d.text async for d in stream]))

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_debug_logging_does_not_show_the_key(stack: Stack, http: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, stack.base_url, ROUTER_KEY, stack.ca_file, http,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert out.strip()
    assert b"DEBUG:httpcore" in err  # debug logging was on
    assert ROUTER_KEY.encode() not in err
