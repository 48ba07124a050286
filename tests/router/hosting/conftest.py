"""The hosting layer's tests run on asyncio's event loop and on uvloop's, the one a router
process runs on: they differ where the hosting layer reaches into the loop (uvloop starts
reading a new connection whatever its protocol asked in ``connection_made``); "uvloop" is the
loop :func:`~firstbyte.router.hosting.loop_factory` makes, uvloop's with the router's
accepting servers (:mod:`firstbyte.router.hosting.batch_accept`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest

from firstbyte.router.hosting import loop_factory


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    uvloop = loop_factory()
    assert uvloop is not None, "uvloop is a dependency of the router"
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop}
