"""HTTP/3 over QUIC with aioquic as a client that misbehaves on purpose."""

from __future__ import annotations

from tests.router.conftest import API_KEY
from tests.router.h3client import h3_request

from .conftest import RouterStarter, canary_running

CHAT = "/v1/chat/completions"
H3 = {"listen": {"http3": True}}


async def test_early_answer_leaves_http3_serving(start_router_process: RouterStarter) -> None:
    """A POST answered before its body was read (no key, a large body; a keyed POST to an
    unknown path): the body's late DATA is dropped and HTTP/3 goes on serving."""
    async with start_router_process(**H3) as router, canary_running(router):
        body = b"x" * (64 * 1024)
        no_key = await h3_request(
            router.port, "POST", CHAT, cafile=router.cafile, body=body,
            headers={"content-type": "application/json"},
        )
        assert no_key.status == 401
        unknown = await h3_request(
            router.port, "POST", "/v1/nowhere", cafile=router.cafile, body=body,
            headers={"authorization": f"Bearer {API_KEY}"},
        )
        assert unknown.status == 404
        for _ in range(3):
            health = await h3_request(
                router.port, "GET", "/healthz", cafile=router.cafile, timeout_s=10
            )
            assert health.status == 200
        router.assert_clean_log()
