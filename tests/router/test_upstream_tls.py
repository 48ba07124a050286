"""TLS to upstreams: trusted through ``upstream_ca_file``, refused without it."""

from __future__ import annotations

import httpx

from firstbyte.router.sim.server import sim_server
from tests.router.conftest import RouterFactory, auth, client_tls
from tests.router.streamtext import sse_text

BODY = {
    "model": "sim-instant",
    "messages": [{"role": "user", "content": "Is the upstream private?"}],
    "stream": True,
    "max_tokens": 12,
    "seed": 3,
}


async def test_upstream_behind_a_private_ca(
    start_router: RouterFactory, tls_files: dict[str, str]
) -> None:
    async with sim_server(
        "instant", certfile=tls_files["certfile"], keyfile=tls_files["keyfile"]
    ) as sim:
        assert sim.url.startswith("https://")
        async with (
            start_router([sim.url], upstream_ca_file=tls_files["cafile"]) as trusted,
            start_router([sim.url]) as untrusted,
            httpx.AsyncClient(verify=client_tls(tls_files)) as client,
        ):
            url = "/v1/chat/completions"
            ok = await client.post(trusted.base_url + url, json=BODY, headers=auth())
            assert ok.status_code == 200
            direct = await client.post(sim.url + url, json=BODY)
            assert sse_text(ok.content)[0] == sse_text(direct.content)[0] != ""
            refused = await client.post(untrusted.base_url + url, json=BODY, headers=auth())
            # The public bundle does not know the test CA: the router's health probe fails
            # the handshake, so the only upstream is unhealthy and the answer is 503.
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "no_healthy_backend"
            assert "is answering" in refused.json()["error"]["message"]


def test_missing_ca_file_is_a_config_error(tmp_path: object) -> None:
    import pytest

    from firstbyte.router.config import ConfigError, load_config

    path = tmp_path / "router.toml"  # type: ignore[operator]
    path.write_text(
        'upstream_ca_file = "/no/such/ca.pem"\n'
        '[[upstreams]]\nurl = "http://127.0.0.1:8001"\n'
        "[listen]\ninsecure_plain_http = true\n"
    )
    with pytest.raises(ConfigError, match="upstream_ca_file: no such file"):
        load_config(str(path))
