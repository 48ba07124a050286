"""``firstbyte router --config FILE`` as a real process: serves TLS, streams, stops on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import httpx

from firstbyte.benchmarks.ports import free_port
from firstbyte.router.sim.server import sim_server
from tests.cli import FIRSTBYTE
from tests.router.conftest import API_KEY, auth, client_tls


async def test_router_process_from_config_file(tmp_path: Path, tls_files: dict[str, str]) -> None:
    async with sim_server("instant", served_model_names=["m"]) as sim:
        port = free_port(udp=True)  # the router needs the UDP port too
        config = tmp_path / "router.toml"
        config.write_text(
            f'region = "cli-1"\n[[upstreams]]\nurl = "{sim.url}"\n'
            f'[listen]\nport = {port}\ncertfile = "{tls_files["certfile"]}"\nkeyfile = "{tls_files["keyfile"]}"\n'
            f'[auth]\napi_keys = ["{API_KEY}"]\n'
        )
        process = await asyncio.create_subprocess_exec(
            *FIRSTBYTE, "router", "--config", str(config),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            base = f"https://127.0.0.1:{port}"
            async with httpx.AsyncClient(verify=client_tls(tls_files), http2=True) as client:
                for _ in range(200):
                    try:
                        if (await client.get(base + "/healthz")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        assert process.returncode is None, await process.stderr.read()  # type: ignore[union-attr]
                        await asyncio.sleep(0.05)
                body = {
                    "model": "m",
                    "messages": [{"role": "user", "content": "cli"}],
                    "stream": True,
                    "max_tokens": 5,
                }
                response = await client.post(
                    base + "/v1/chat/completions", json=body, headers=auth()
                )
                assert response.status_code == 200
                assert response.http_version == "HTTP/2"
                assert response.headers["x-firstbyte-region"] == "cli-1"
                assert response.headers["alt-svc"] == f'h3=":{port}"; ma=86400'
                assert response.text.endswith("data: [DONE]\n\n")
                assert (
                    json.loads(response.text.split("data: ", 2)[1].split("\n")[0])["object"]
                    == "chat.completion.chunk"
                )
        finally:
            process.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(process.communicate(), 20)
        assert process.returncode == 0
        assert b"Traceback" not in stderr
        assert API_KEY.encode() not in stderr
