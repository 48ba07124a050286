"""``firstbyte.protocol`` depends on msgspec and the standard library only."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("httpx", "httpcore", "aioquic", "websockets", "hypercorn", "firstbyte.client_sdk",
             "firstbyte.router", "firstbyte.benchmarks")


def test_importing_the_protocol_pulls_in_no_transport_sdk_or_router() -> None:
    code = (
        "import json, sys; import firstbyte.protocol; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    modules = json.loads(out.stdout)
    assert "firstbyte.protocol.ws" in modules  # the check sees what was imported
    loaded = [m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert loaded == []
