"""Which models each backend of this region serves: a sans-IO map and the service that fills it.

A backend's models come from ``upstreams[].models`` when configured (then only those, never
asked), else from its ``GET /v1/models`` (vLLM, SGLang, llama.cpp, LiteLLM and OpenAI answer
it), asked before the router serves and again every ``routing.models_refresh_s``. A list that
could not be read keeps the last one read (a backend that is down is out of rotation by its
health, not by its list).

A backend whose list is not known yet (its first ask failed or has not answered) never takes a
model another backend here lists, nor one a peer region lists: only a model nobody is known to
serve, which it may serve (without it, such a request would be refused untried; with it, the
backend's own answer, vLLM's 404 if it does not, reaches the client). See
:meth:`firstbyte.router.pipeline.chooser.RouteChooser.serving`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from firstbyte.protocol import paths
from firstbyte.protocol.openai import ModelList
from firstbyte.tasks import cancel_and_wait

from .observability.logs import describe_error

__all__ = ["MAX_LIST_BYTES", "MAX_MODELS", "ModelLister", "ModelMap"]

MAX_MODELS = 1024
"""Model ids kept from one backend's list; the rest are ignored (a list is bounded input)."""

MAX_LIST_BYTES = 1 << 20
"""A ``/v1/models`` answer longer than this is not read (the previous list stays)."""

UNKNOWN_RETRY_S = 2.0
"""While some backend's list is unknown, it is asked again this often (not every
``routing.models_refresh_s``)."""

log = logging.getLogger("firstbyte.router")
_NOBODY: frozenset[str] = frozenset()
_model_list = msgspec.json.Decoder(ModelList)


class ModelMap:
    """Each local backend's models (sans-IO): configured ones fixed, the others learned."""

    def __init__(self, configured: Mapping[str, Sequence[str]]) -> None:
        """``configured``: every backend by name, with its configured models (empty: to be
        learned from its ``/v1/models``)."""
        self.fixed = {name for name, models in configured.items() if models}
        self.lists: dict[str, frozenset[str] | None] = {
            name: frozenset(models) if models else None for name, models in configured.items()
        }
        self.listed_at: dict[str, float] = {}
        self._index()

    def _index(self) -> None:
        """Who serves each listed model, and whose list is unknown: asked several times a
        request, rebuilt only when a list changes. Bounded by the lists (``MAX_MODELS`` a
        backend), never by the model names clients send."""
        by_model: dict[str, list[str]] = {}
        for name, models in self.lists.items():
            for model in models or ():
                by_model.setdefault(model, []).append(name)
        self.by_model = {model: frozenset(names) for model, names in by_model.items()}
        """Who serves each listed model (never an empty set): :meth:`serving`'s answers, read
        directly where a request asks (a method is a Python call)."""
        self.unknown_set = frozenset(n for n, models in self.lists.items() if models is None)
        """:meth:`unknown` as a set."""

    def to_learn(self) -> list[str]:
        """Backends whose list comes from their ``/v1/models``."""
        return [name for name in self.lists if name not in self.fixed]

    def learned(self, name: str, ids: Iterable[str], now: float) -> bool:
        """``name`` listed ``ids`` at ``now``; True if its list changed."""
        models = frozenset(list(dict.fromkeys(ids))[:MAX_MODELS])
        self.listed_at[name] = now
        changed = self.lists.get(name) != models
        self.lists[name] = models
        if changed:
            self._index()
        return changed

    def keep(self, name: str, models: frozenset[str] | None) -> None:
        """``name``'s list is ``models`` (one learned before a reload, kept)."""
        self.lists[name] = models
        self._index()

    def serving(self, model: str) -> frozenset[str]:
        """The backends known to serve ``model``."""
        return self.by_model.get(model, _NOBODY)

    def unknown(self) -> list[str]:
        """Backends whose list is not known yet."""
        return [n for n, models in self.lists.items() if models is None]

    def models(self) -> list[str]:
        """Every model some backend serves, sorted."""
        return sorted({m for models in self.lists.values() if models for m in models})

    def of(self, name: str) -> frozenset[str]:
        return self.lists.get(name) or frozenset()


class ModelLister:
    """Asks each backend without configured models for its ``/v1/models`` (bounded in time
    and size) and feeds :class:`ModelMap`; ``on_change(name, models)`` after a list changed."""

    def __init__(
        self,
        models: ModelMap,
        client: object,
        urls: Mapping[str, str],
        *,
        interval_s: float = 30.0,
        timeout_s: float = 5.0,
        headers: Mapping[str, Mapping[str, str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, frozenset[str]], object] | None = None,
    ) -> None:
        self.models = models
        self.client = client
        self.urls = dict(urls)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.headers = {k: dict(v) for k, v in (headers or {}).items()}
        self.clock = clock
        self.on_change = on_change
        self._task: asyncio.Task[None] | None = None
        self._failed: set[str] = set()
        self.ready = asyncio.Event()
        """Set once every list was asked for once (answered or not)."""
        self._wake = asyncio.Event()

    def carry_failures(self, previous: ModelLister, names: Iterable[str]) -> None:
        """Take over ``previous``'s (a reloaded lister's) failing backends among ``names``:
        their next failure is not a new line."""
        self._failed.update(name for name in names if name in previous._failed)

    async def list_once(self, name: str) -> None:
        """Ask ``name`` once; a failure keeps what was known (one log line per failure run)."""
        import httpx

        client = self.client
        assert isinstance(client, httpx.AsyncClient)
        url = self.urls[name].rstrip("/") + paths.MODELS
        try:
            try:
                body = await self._read(client, name, url)
            except httpx.RemoteProtocolError:
                # A kept-alive connection the backend closed as it was reused (uvicorn's and
                # vLLM's keep-alive is 5 s, the pool's longer): a GET, asked again at once.
                body = await self._read(client, name, url)
            ids = [m.id for m in _model_list.decode(body).data]
        except (httpx.HTTPError, ValueError, msgspec.DecodeError) as exc:
            if name not in self._failed:
                self._failed.add(name)
                log.warning(
                    "model list of upstream %s (%s) could not be read: %s; %s", name, url,
                    describe_error(exc) if isinstance(exc, httpx.HTTPError) else exc,
                    "it takes only models no other backend lists until it is"
                    if self.models.lists.get(name) is None else "its last list stays",
                )
            return
        self._failed.discard(name)
        if self.models.learned(name, ids, self.clock()):
            log.info("model list of upstream %s: %s", name, ", ".join(sorted(self.models.of(name))))
            if self.on_change is not None:
                self.on_change(name, self.models.of(name))

    async def _read(self, client: Any, name: str, url: str) -> bytes:
        """``GET url``'s body, bounded (``ValueError`` past :data:`MAX_LIST_BYTES`)."""
        async with client.stream(
            "GET", url, headers=self.headers.get(name, {}), timeout=self.timeout_s
        ) as response:
            body = b""
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_LIST_BYTES:
                    raise ValueError(f"its list is over {MAX_LIST_BYTES} bytes")
        response.raise_for_status()
        return body

    async def step(self) -> None:
        """Ask every backend whose list is learned, at once."""
        await asyncio.gather(*(self.list_once(n) for n in self.models.to_learn()))

    async def _loop(self) -> None:
        while True:
            await self.step()
            self.ready.set()
            wait = self.interval_s
            if self.models.unknown():
                wait = min(wait, UNKNOWN_RETRY_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            self._wake.clear()

    def wake(self) -> None:
        """Ask now (a backend whose list is unknown just answered its metrics scrape)."""
        self._wake.set()

    async def wait_ready(self, timeout_s: float) -> None:
        """Return once every list was asked for once (:meth:`start` first), or after
        ``timeout_s``."""
        if self._task is None or self.ready.is_set():
            return  # every request asks: nothing to wait for once the lists are in
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.ready.wait()

    def start(self) -> None:
        if self.models.to_learn() and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="model-lists")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
