"""Hosting: everything a firstbyte server process needs besides its app, shared by the router
(:mod:`firstbyte.router.serve`) and the simulated inference server
(:mod:`firstbyte.router.sim.server`), which imports nothing else of the router.

- :mod:`.servers`: bind sockets, run an ASGI app under hypercorn (HTTP/1.1, HTTP/2, HTTP/3),
  uvicorn or granian, with TLS, signal handling and drain; :func:`running` for tests;
- :mod:`.http1_split`: ``auto``, hypercorn handing HTTP/1.1 connections to uvicorn's protocol;
- :mod:`.batch_accept`: the router's loop, uvloop's with servers that accept up to 64 waiting
  connections each turn (libuv's own accepts one a turn);
- :mod:`.accept`: connections counted per client address from their accept, before TLS,
  and a refused one answered 503 after its request's head (:mod:`.limits` decides);
- :mod:`.proxy_protocol`: the PROXY protocol header (v1, v2) an L4 balancer sends before
  TLS, parsed sans-IO; the accept layer reads it and serves the connection as its client's;
- :mod:`.quic`: the QUIC session-ticket store that gives hypercorn's HTTP/3 0-RTT, and
  :class:`~.quic.Http3Status`, whether HTTP/3 is up (``Alt-Svc`` follows it);
- :mod:`.hardening`, :mod:`.quic_hardening`: the defences hypercorn lacks, as patches;
- :mod:`.patches`: every patch of a library's internals, listed, shape-checked and applied
  in one order (a library of another shape: the server refuses to start, in one line);
- :mod:`.gc_tuning`: the cyclic-GC settings of a serving process;
- :mod:`.prometheus`: the text format both servers' ``/metrics`` speak.

This package imports only the standard library at import time; each server is imported when
it is first used.
"""

from .servers import *  # noqa: F403 (the package's API is the servers module's)
from .servers import __all__ as __all__
