"""The soak's canary: one well-behaved client on its own key, sequential streams for the whole run.

It runs in its own process (``python -m firstbyte.benchmarks.scenarios._soak_canary URL KEY CA
SECONDS``) so its time to first token is the router's, not the load generator's busy event loop.
It prints one JSON line per request: seconds since start, TTFT of the try that succeeded, the
outcome, and the class of every failed try with whether it was a relayed upstream fault.
"""

from __future__ import annotations

import asyncio
import sys
import time

import msgspec

from firstbyte.benchmarks._parent import exit_with_parent
from firstbyte.benchmarks.scenarios._soak_good import open_kind, request_body, run_request
from firstbyte.benchmarks.scenarios._soak_integrity import Ledger

__all__ = ["CANARY_KIND", "main"]

CANARY_KIND = "sdk-sse-h2"
MAX_TOKENS = 24
PAUSE_S = 0.1


async def _run(base_url: str, key: str, ca_file: str, seconds: float) -> None:
    ledger = Ledger()
    started = time.monotonic()
    async with open_kind(CANARY_KIND, base_url, key, ca_file) as client:
        n = 0
        while time.monotonic() - started < seconds:
            t = time.monotonic() - started
            body = request_body("canary", n, MAX_TOKENS)
            outcome, attempts = await run_request(client, key, body, ledger, "canary")
            line = {
                "t": round(t, 3),
                "outcome": outcome,
                "ttft_ms": attempts[-1].ttft_ms,
                "errors": [[a.error, a.upstream_fault] for a in attempts if a.error],
            }
            sys.stdout.write(msgspec.json.encode(line).decode() + "\n")
            sys.stdout.flush()
            n += 1
            await asyncio.sleep(PAUSE_S)


def main(argv: list[str]) -> int:
    base_url, key, ca_file, seconds = argv
    exit_with_parent()
    asyncio.run(_run(base_url, key, ca_file, float(seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
