"""The hosting layer's tests run on asyncio's event loop and on uvloop's, the one a router
process runs on: they differ where the hosting layer reaches into the loop (uvloop starts
reading a new connection whatever its protocol asked in ``connection_made``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
