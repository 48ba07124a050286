"""The least a relay hosted on uvicorn does: a reference for the router's CPU per chunk.

:data:`BARE_RELAY` is a child program, as ``bench router_overhead``'s byte pipe is: an ASGI
app on uvicorn (httptools, the router's event loop) that reads a request's body, sends the
same ``POST /v1/chat/completions`` to the upstream on a kept-alive connection (a protocol, no
stream reader), takes the upstream's chunked body apart with the fewest steps, and sends each
chunk's payload as one ASGI body message. No key, no limit, no placement, no store, no
metrics, no log, no heartbeat: what is left is what uvicorn and ASGI cost a relay per
request and per chunk. The router, with all of those on, set beside it and the byte pipe in
the same conditions (``chunk_instructions --target bare``) says how much of its cost is its
own and how much is the server's.

Not a product: no error handling beyond what a measured pass needs (a well-formed chunked
answer from a kept-alive upstream).
"""

from __future__ import annotations

__all__ = ["BARE_RELAY"]

BARE_RELAY = """
import asyncio, sys
import uvicorn
from firstbyte.router.hosting import loop_factory
# UPSTREAM_HOST UPSTREAM_PORT
UPSTREAM = (sys.argv[1], int(sys.argv[2]))
class Upstream(asyncio.Protocol):
    def __init__(self):
        self.transport, self.parts, self.buffer, self.in_body = None, None, b"", False
    def connection_made(self, transport):
        self.transport = transport
    def data_received(self, data):
        buffer = self.buffer + data
        while self.parts is not None:
            if not self.in_body:  # the head: skipped (a 200 with a chunked body)
                end = buffer.find(b"\\r\\n\\r\\n")
                if end < 0:
                    break
                buffer, self.in_body = buffer[end + 4:], True
                continue
            line = buffer.find(b"\\r\\n")
            if line < 0:
                break
            size = int(buffer[:line], 16)
            if len(buffer) < line + size + 4:
                break
            self.parts.put_nowait(buffer[line + 2:line + 2 + size])
            buffer = buffer[line + size + 4:]
            if size == 0:
                break
        self.buffer = buffer
idle = []
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if idle:
        upstream = idle.pop()
    else:
        _, upstream = await asyncio.get_running_loop().create_connection(Upstream, *UPSTREAM)
    upstream.parts, upstream.in_body = asyncio.Queue(), False
    upstream.transport.write(
        b"POST /v1/chat/completions HTTP/1.1\\r\\nhost: upstream\\r\\n"
        b"content-type: application/json\\r\\ncontent-length: %d\\r\\n\\r\\n%b" % (len(body), body))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    while part := await upstream.parts.get():
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    upstream.parts = None
    idle.append(upstream)
async def main():
    server = uvicorn.Server(uvicorn.Config(
        app, host="127.0.0.1", port=0, loop="none", http="httptools", access_log=False,
        log_level="warning", timeout_keep_alive=900))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    print(f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.should_exit = True
    await serving
with asyncio.Runner(loop_factory=loop_factory()) as runner:  # the router's loop
    runner.run(main())
"""
