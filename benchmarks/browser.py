"""Open a report in headless Chromium over the DevTools protocol: what went wrong while it
loaded (console errors, uncaught exceptions, failed or non-local requests), the answer of a
script evaluated in it, and a full-page screenshot.

The browser is the system's ``chromium`` (Debian package ``chromium``), started with a fresh
profile and no network features; the protocol is spoken over ``websockets`` (a dependency of
firstbyte already), so nothing else is installed for it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from websockets.asyncio.client import ClientConnection, connect

from firstbyte.benchmarks._parent import stop_process
from firstbyte.tasks import cancel_and_wait

__all__ = [
    "Browser",
    "BrowserError",
    "Page",
    "PageLoad",
    "chromium_path",
    "intent_script",
    "launch",
    "load",
    "open_page",
    "prewarm_script",
    "screenshot",
    "spki_flag",
    "stream_script",
]

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--remote-debugging-port=0",
)
START_TIMEOUT_S = 30.0
LOAD_TIMEOUT_S = 30.0


class BrowserError(Exception):
    """Chromium is missing, did not start, or the page did not load cleanly."""


@dataclass
class PageLoad:
    """What happened while a page loaded in the browser."""

    url: str
    width: int
    height: int = 0
    errors: list[str] = field(default_factory=list)
    """Console errors, uncaught exceptions, error log entries and failed loads."""
    requests: list[str] = field(default_factory=list)
    """Every URL the page requested (a self-contained report requests only itself)."""
    value: Any = None
    """The result of the ``evaluate`` script, if one was given."""
    png: bytes | None = None


def chromium_path() -> str | None:
    """The system Chromium (or Chrome), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class _Session:
    """One DevTools connection: numbered commands with their answers, events in a list."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.loaded = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for raw in self._ws:
            message = msgspec.json.decode(raw)
            if "id" in message and message["id"] in self._waiting:
                self._waiting.pop(message["id"]).set_result(message)
            elif "method" in message:
                self.events.append((message["method"], message.get("params", {})))
                if message["method"] == "Page.loadEventFired":
                    self.loaded.set()

    async def send(self, method: str, session: str | None = None, **params: Any) -> Any:
        ident = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = future
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        await self._ws.send(msgspec.json.encode(message).decode())
        answer = await asyncio.wait_for(future, LOAD_TIMEOUT_S)
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error'].get('message')}")
        return answer.get("result", {})

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await cancel_and_wait(self._reader)


def spki_flag(cert_pem: bytes) -> str:
    """Chromium's ``--ignore-certificate-errors-spki-list`` for the (first) certificate in
    ``cert_pem``: base64(SHA-256(SPKI)), so Chromium trusts that key and nothing else (for TCP
    TLS and QUIC alike)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    der = cert.public_key().public_bytes(serialization.Encoding.DER,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)
    return ("--ignore-certificate-errors-spki-list="
            + base64.b64encode(hashlib.sha256(der).digest()).decode())


@contextlib.contextmanager
def _chromium(extra_flags: tuple[str, ...] = ()) -> Iterator[str]:
    """Start Chromium with a fresh profile; yield its browser DevTools WebSocket URL. QUIC is
    off unless ``extra_flags`` has ``--enable-quic``."""
    binary = chromium_path()
    if binary is None:
        raise BrowserError("chromium not found (Debian: apt-get install chromium)")
    flags = [f for f in FLAGS if not (f == "--disable-quic" and "--enable-quic" in extra_flags)]
    # Chromium's helper processes may still write to the profile as the main one exits.
    with tempfile.TemporaryDirectory(prefix="firstbyte-chromium-",
                                     ignore_cleanup_errors=True) as root:
        profile = Path(root) / "profile"
        # Chromium keeps its singleton socket in a folder of its own under TMPDIR and leaves
        # it behind when it is stopped; pointing TMPDIR at this run's folder takes that
        # folder away with the profile (one level only: the socket's path has to stay under
        # the kernel's 108 bytes). Its own session lets a stop reach every helper.
        proc = subprocess.Popen(
            [binary, *flags, *extra_flags, f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "TMPDIR": root}, start_new_session=True)
        try:
            port_file = profile / "DevToolsActivePort"
            deadline = time.monotonic() + START_TIMEOUT_S
            while not port_file.exists() or len(port_file.read_text().splitlines()) < 2:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read() if proc.stderr and proc.poll() is not None else ""
                    raise BrowserError(f"chromium did not start: {err.strip()[-500:]}")
                time.sleep(0.05)
            port, path = port_file.read_text().splitlines()[:2]
            yield f"ws://127.0.0.1:{port}{path}"
        finally:
            stop_process(proc)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # helpers that outlived the browser


def _problems(events: list[tuple[str, dict[str, Any]]], page_url: str) -> list[str]:
    out = []
    for method, p in events:
        if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])
            out.append(f"console.{p['type']}: {args}")
        elif method == "Runtime.exceptionThrown":
            details = p.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text")
            out.append(f"uncaught exception: {text}")
        elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            entry = p["entry"]
            out.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}")
        elif method == "Network.loadingFailed":
            out.append(f"failed load: {p.get('errorText')} (request {p.get('requestId')})")
        elif method == "Network.requestWillBeSent":
            url = p.get("request", {}).get("url", "")
            if url != page_url and not url.startswith("data:"):
                out.append(f"request beyond the page itself: {url}")
    return out


async def _load(
    devtools: str, url: str, width: int, evaluate: str | None, capture: bool
) -> PageLoad:
    result = PageLoad(url=url, width=width)
    async with connect(devtools, max_size=None) as ws:
        b = _Session(ws)
        try:
            await _drive(b, result, evaluate, capture)
        finally:
            await b.close()
    return result


async def _navigate(b: _Session, url: str, width: int, context: str | None = None) -> str:
    """Open a tab of ``width`` CSS pixels (in browser context ``context``, else the default
    one), load ``url`` in it; its DevTools session id."""
    where = {"browserContextId": context} if context else {}
    target = await b.send("Target.createTarget", url="about:blank", **where)
    attached = await b.send("Target.attachToTarget", targetId=target["targetId"], flatten=True)
    s: str = attached["sessionId"]
    for domain in ("Page", "Runtime", "Log", "Network"):
        await b.send(f"{domain}.enable", s)
    await b.send("Emulation.setDeviceMetricsOverride", s, width=width, height=900,
                 deviceScaleFactor=1, mobile=width < 600)
    b.loaded.clear()
    await b.send("Page.navigate", s, url=url)
    try:
        await asyncio.wait_for(b.loaded.wait(), LOAD_TIMEOUT_S)
    except TimeoutError:
        raise BrowserError(f"{url}: did not finish loading in {LOAD_TIMEOUT_S:g} s") from None
    return s


async def _drive(b: _Session, result: PageLoad, evaluate: str | None, capture: bool) -> None:
    url, width = result.url, result.width
    s = await _navigate(b, url, width)
    if evaluate is not None:
        answer = await b.send("Runtime.evaluate", s, expression=evaluate,
                              returnByValue=True)
        if "exceptionDetails" in answer:
            result.errors.append(f"evaluate: {answer['exceptionDetails'].get('text')}")
        result.value = answer.get("result", {}).get("value")
    metrics = await b.send("Page.getLayoutMetrics", s)
    size = metrics.get("cssContentSize") or metrics["contentSize"]
    result.height = int(size["height"])
    if capture:
        shot = await b.send("Page.captureScreenshot", s, format="png",
                            captureBeyondViewport=True,
                            clip={"x": 0, "y": 0, "width": width, "height": result.height,
                                  "scale": 1})
        result.png = base64.b64decode(shot["data"])
    await asyncio.sleep(0.1)  # late console messages of the load
    result.requests = [p.get("request", {}).get("url", "") for m, p in b.events
                       if m == "Network.requestWillBeSent"]
    result.errors += _problems(b.events, url)


@dataclass
class Page:
    """One open page of a running Chromium: evaluate scripts in it (promises awaited)."""

    url: str
    _session: _Session
    _id: str

    async def evaluate(self, expression: str, timeout_s: float = LOAD_TIMEOUT_S) -> Any:
        """The JSON value of ``expression`` (a promise is awaited); :class:`BrowserError` with
        the page's exception text if it throws."""
        answer = await self._session.send(
            "Runtime.evaluate", self._id, expression=expression, returnByValue=True,
            awaitPromise=True, timeout=timeout_s * 1000)
        if "exceptionDetails" in answer:
            details = answer["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"evaluate: {text}")
        return answer.get("result", {}).get("value")

    async def set_visible(self, visible: bool) -> None:
        """Minimize (or restore) the page's window: the page becomes ``hidden`` (or
        ``visible``) for the Page Visibility API, with its ``visibilitychange`` event."""
        window = await self._session.send("Browser.getWindowForTarget", self._id)
        state = "normal" if visible else "minimized"
        await self._session.send("Browser.setWindowBounds", windowId=window["windowId"],
                                 bounds={"windowState": state})

    def events(self) -> list[tuple[str, dict[str, Any]]]:
        """The DevTools events of this browser so far (method, params), oldest first."""
        return self._session.events

    def problems(self) -> list[str]:
        """Console errors, exceptions and failed loads so far (as :class:`PageLoad` ``errors``,
        requests to other origins allowed)."""
        return [p for p in _problems(self._session.events, self.url)
                if not p.startswith("request beyond")]


@dataclass
class Browser:
    """A running Chromium (see :func:`launch`): pages in fresh browser contexts."""

    _session: _Session

    @contextlib.asynccontextmanager
    async def isolated_page(self, url: str) -> AsyncIterator[Page]:
        """``url`` in a new browser context: its own cache and connection pool, so the page
        and everything it fetches start cold; the context is disposed of afterwards."""
        b = self._session
        context = (await b.send("Target.createBrowserContext"))["browserContextId"]
        try:
            yield Page(url, b, await _navigate(b, url, 1000, context))
        finally:
            await b.send("Target.disposeBrowserContext", browserContextId=context)


@contextlib.asynccontextmanager
async def launch(flags: tuple[str, ...] = ()) -> AsyncIterator[Browser]:
    """A fresh headless Chromium started with extra ``flags``, until the block ends."""
    with contextlib.ExitStack() as stack:
        devtools = await asyncio.to_thread(stack.enter_context, _chromium(flags))
        async with connect(devtools, max_size=None) as ws:
            b = _Session(ws)
            try:
                yield Browser(b)
            finally:
                await b.close()
        await asyncio.to_thread(stack.close)


@contextlib.asynccontextmanager
async def open_page(url: str, *, flags: tuple[str, ...] = ()) -> AsyncIterator[Page]:
    """Load ``url`` (any scheme) in a fresh headless Chromium started with extra ``flags``;
    the page stays open for scripts until the block ends. Usable inside a running event loop
    that also serves the page."""
    async with launch(flags) as browser:
        yield Page(url, browser._session, await _navigate(browser._session, url, 1000))


def load(path: Path, *, width: int = 1000, evaluate: str | None = None,
         capture: bool = False) -> PageLoad:
    """Load ``path`` in a fresh headless Chromium at ``width`` CSS pixels; see :class:`PageLoad`."""
    if not path.is_file():
        raise BrowserError(f"{path}: no such file")
    with _chromium() as devtools:
        return asyncio.run(_load(devtools, path.resolve().as_uri(), width, evaluate, capture))


def screenshot(report: Path, png: Path, *, width: int = 1000) -> PageLoad:
    """Save a full-page PNG of ``report``; :class:`BrowserError` if anything failed to load."""
    page = load(report, width=width, capture=True)
    if page.errors:
        raise BrowserError(f"{report}: " + "; ".join(page.errors[:5]))
    assert page.png is not None
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
        png.write_bytes(page.png)
    except OSError as exc:
        raise BrowserError(f"cannot write {png}: {exc.strerror or exc}") from None
    return page


def stream_script(base_url: str, token: str, transport: str, request: dict[str, Any], *,
                  busy_ms: int = 0, report: bool = False,
                  options: dict[str, Any] | None = None) -> str:
    """A script for a page that has the client as ``window.fb`` and a ``#out`` element: stream
    ``request`` into ``#out`` and answer what it saw (text, DOM text, sequence numbers,
    ``timings``, usage; or ``error``); with ``report`` the client reports its timings, sent
    before the script answers. The page keeps one client per set of options, as an
    application does: its connections (a WebSocket too) serve the page's next streams.
    ``options``: more of the client's options (``simpleStart``...)."""
    return f"""(async () => {{
  const out = document.getElementById("out");
  out.textContent = "";
  {_page_client(base_url, token, transport, report, options)}
  const sentBefore = client.timingsReporter?.sentReports ?? 0;
  const failedBefore = client.timingsReporter?.failedReports ?? 0;
  const busy = (ms) => {{ const end = performance.now() + ms; while (performance.now() < end); }};
  const stream = client.stream({json.dumps(request)}, {{ into: out,
    onFirstToken: () => busy({busy_ms}) }});
  const seqs = [];
  try {{
    for await (const delta of stream) if (delta.seq != null) seqs.push(delta.seq);
  }} catch (err) {{
    return {{ error: err.name, status: err.status ?? null, code: err.code ?? null,
             message: err.message, timings: stream.timings }};
  }}
  await new Promise((r) => requestAnimationFrame(() => setTimeout(r, 0)));
  await client.flushTimings();
  const reporter = client.timingsReporter;
  return {{ text: stream.text, dom: out.textContent, seqs, timings: stream.timings,
           usage: stream.usage, reports: reporter && {{
             sent: reporter.sentReports - sentBefore,
             failed: reporter.failedReports - failedBefore }} }};
}})()"""


def _page_client(base_url: str, token: str, transport: str, report: bool,
                 options: dict[str, Any] | None) -> str:
    """Script lines binding ``client``: the page's one client for these options."""
    merged = {"baseUrl": base_url, "token": token, "transport": transport, "idleTimeoutS": 10,
              "reportTimings": report, **(options or {})}
    return f"""const options = {json.dumps(merged)};
  const key = JSON.stringify(options);
  window.fbClients ??= {{}};
  const client = window.fbClients[key] ??= new fb.Client(options);"""


def prewarm_script(base_url: str, token: str, transport: str, *, report: bool = False,
                   options: dict[str, Any] | None = None,
                   prompt: dict[str, Any] | None = None) -> str:
    """A script that runs ``client.prewarm(prompt)`` (``prompt``: ``model`` and ``messages``
    to warm the prompt too) on the client :func:`stream_script` with the same arguments uses,
    and answers ``{ms, prompt}``."""
    return f"""(async () => {{
  {_page_client(base_url, token, transport, report, options)}
  return await client.prewarm({json.dumps(prompt or {})});
}})()"""


def intent_script(base_url: str, token: str, transport: str, *, report: bool = False,
                  options: dict[str, Any] | None = None,
                  conversation: dict[str, Any] | None = None) -> str:
    """A script that adds a prompt box (``#prompt``) to the page, has the client
    :func:`stream_script` with the same arguments uses warm on intent in it
    (``window.warmer``), and focuses it: the user starts to type. ``conversation``
    (``model`` and ``messages``): the history so far, warmed with the connection."""
    warm_options = ("" if conversation is None
                    else f", {{ conversation: () => ({json.dumps(conversation)}) }}")
    return f"""(() => {{
  {_page_client(base_url, token, transport, report, options)}
  let prompt = document.getElementById("prompt");
  if (!prompt) {{
    prompt = document.createElement("textarea");
    prompt.id = "prompt";
    document.body.append(prompt);
  }}
  window.warmer ??= client.warmOnIntent(prompt{warm_options});
  prompt.focus();
  return true;
}})()"""


TYPE_KEY = """(() => {
  const prompt = document.getElementById("prompt");
  prompt.value += "h";
  prompt.dispatchEvent(new KeyboardEvent("keydown", {key: "h"}));
  prompt.dispatchEvent(new Event("input"));
  return true;
})()"""
"""One keystroke in the prompt box of :func:`intent_script`."""
