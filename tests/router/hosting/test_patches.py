"""The one list of library patches (router/hosting/patches.py): it holds every change the
router makes to a library, each patch checks the library's shape before anything is patched,
and a library of another shape stops the router at start, in one line that names it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest

from firstbyte.router.hosting import patches
from firstbyte.router.hosting.patches import PATCHES, PatchShapeError, Shape

ROOT = Path(__file__).resolve().parents[3]


def test_the_installed_libraries_have_every_shape_the_patches_expect() -> None:
    patches.check()
    patches.apply_all()
    patches.check()  # once applied, a patched method is checked as the library has it
    assert len({patch.name for patch in PATCHES}) == len(PATCHES)


_SNAPSHOT = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    LIBRARIES = ("hypercorn", "h11", "h2", "aioquic", "uvicorn", "httpx", "httpcore", "wsproto")

    def modules():
        for top in LIBRARIES:
            package = importlib.import_module(top)
            yield package
            for info in pkgutil.walk_packages(package.__path__, top + "."):
                try:
                    yield importlib.import_module(info.name)
                except Exception:
                    pass

    MODULES = list(modules())
    CLASSES = [
        (module.__name__ + ":" + name, value)
        for module in MODULES for name, value in list(vars(module).items())
        if isinstance(value, type) and value.__module__ == module.__name__
    ]

    def snapshot():
        # The classes as first imported: a patch that replaces a class in its module shows
        # as that module attribute, not as the replacement's members.
        seen = {}
        for module in MODULES:
            for name, value in list(vars(module).items()):
                seen[module.__name__ + ":" + name] = id(value)
        for key, cls in CLASSES:
            for attr, member in list(vars(cls).items()):
                seen[key + "." + attr] = id(member)
        return seen

    before = snapshot()
    from firstbyte.router.hosting import patches
    patches.apply_all()
    after = snapshot()
    changed = sorted(key for key in before if after.get(key) != before[key])
    print(json.dumps(changed))
    """
)


def test_every_change_to_a_library_is_a_listed_patch() -> None:
    """Applying the registry in a fresh process changes exactly the attributes its entries
    say they replace: no module patches a library on the side."""
    out = subprocess.run(
        [sys.executable, "-c", _SNAPSHOT], cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=True,
    )
    changed = set(json.loads(out.stdout.strip().splitlines()[-1]))
    listed = set()
    for patch in PATCHES:
        for owner, attribute in patch.replaces:
            module, _, cls = owner.partition(":")
            listed.add(f"{module}:{cls}.{attribute}" if cls else f"{module}:{attribute}")
    assert changed == listed


def test_a_moved_method_refuses_in_one_line_naming_library_version_and_patch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hypercorn.protocol.h2 import H2Protocol

    monkeypatch.delattr(H2Protocol, "_handle_events")
    with pytest.raises(PatchShapeError) as refused:
        patches.check()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"hypercorn {version('hypercorn')} is not what patch")
    assert "'h2-data-after-answer-and-rapid-reset'" in message
    assert "hypercorn.protocol.h2.H2Protocol has no _handle_events" in message


def test_a_changed_signature_and_a_missing_instance_attribute_refuse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hypercorn.protocol.h2 import H2Protocol

    async def renamed(self: object, sid: int) -> None: ...

    monkeypatch.setattr(H2Protocol, "_close_stream", renamed)
    with pytest.raises(PatchShapeError, match=r"_close_stream takes \(self, sid\)"):
        patches.check()
    monkeypatch.undo()

    moved = Shape("hypercorn.protocol.h2:H2Protocol", source=(("__init__", "self.gone_away"),))
    patch = PATCHES[0]
    broken = type(patch)(**{**{f: getattr(patch, f) for f in patch.__dataclass_fields__},
                           "shapes": (moved,)})
    with pytest.raises(PatchShapeError, match=r"H2Protocol.__init__ no longer has 'self.gone_away'"):
        patches.check((broken,))


_REFUSING_ROUTER = textwrap.dedent(
    """
    import sys
    from hypercorn.protocol.h11 import H11Protocol
    del H11Protocol._send_error_response  # a hypercorn whose internals moved
    from firstbyte.cli import main
    sys.exit(main(["router", "--upstream", "http://127.0.0.1:9", "--host", "127.0.0.1",
                   "--port", "0", "--no-http3", "--insecure-plain-http",
                   "--allow-anonymous"]))
    """
)


def test_the_router_refuses_to_start_on_an_unexpected_shape() -> None:
    """A real ``firstbyte router`` start: exit 2 and one line on stderr (no traceback, no
    listener), naming the library, its version and the patch."""
    out = subprocess.run(
        [sys.executable, "-c", _REFUSING_ROUTER], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"firstbyte router: error: hypercorn {version('hypercorn')} ")
    assert "'h11-ambiguous-framing'" in lines[0]
    assert "_send_error_response" in lines[0]
    assert "serving" not in out.stdout


def test_applied_except_runs_without_one_patch_then_puts_it_back() -> None:
    from hypercorn.protocol.http_stream import HTTPStream

    patches.apply_all()
    with_all = HTTPStream.app_send
    with patches.applied_except("h11-direct-chunk-framing"):
        assert "h11-direct-chunk-framing" not in patches.applied()
        assert HTTPStream.app_send is not with_all
        patches.apply_all()  # a server started meanwhile changes nothing
        assert "h11-direct-chunk-framing" not in patches.applied()
    assert patches.applied() == tuple(patch.name for patch in PATCHES)
    with pytest.raises(ValueError, match="no such patch"), patches.applied_except("nope"):
        pass


# Each patch's own test is named in its entry (``Patch.test``). The two below run with the
# registry minus one patch: what the library does without it (the bug the patch works
# around, docs/libraries.md), and the same scenario with every patch, which is fixed. When the
# library fixes its bug, the "without" half fails: the patch can then go.


async def _fds_back_to(baseline: int, within_s: float) -> int:
    """Open descriptors of this process once they fall to ``baseline`` (or ``within_s`` has
    passed: then the count then)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        count = len(os.listdir("/proc/self/fd"))
        if count <= baseline or loop.time() > deadline:
            return count
        await asyncio.sleep(0.05)


async def _connect_and_close(port: int, times: int) -> None:
    for _ in range(times):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        await writer.wait_closed()


@pytest.mark.parametrize("without", [False, True], ids=["all-patches", "without-the-patch"])
async def test_a_closed_client_frees_its_socket_at_once(without: bool) -> None:
    """hypercorn keeps a connection whose client closed before sending anything until its
    keep-alive timer fires (30 s here): patch ``tcp-refused-connections-and-idle-close``
    stops the timer, so the server's sockets are closed within a second or two."""
    from firstbyte.router.hosting import ServerOptions, bind, running

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        return None

    listeners = bind("127.0.0.1", 0)
    options = ServerOptions(server="hypercorn", keep_alive_timeout_s=30.0, graceful_timeout_s=1.0)
    skip = ("tcp-refused-connections-and-idle-close",) if without else ()
    with patches.applied_except(*skip):
        async with running(app, listeners, options):
            baseline = len(os.listdir("/proc/self/fd"))
            await _connect_and_close(listeners.port, 20)
            left = await _fds_back_to(baseline, within_s=3.0) - baseline
    # 20 sockets: held, or all closed (a loop may open a descriptor of its own meanwhile).
    if without:
        assert left >= 15  # the library's behaviour: each socket held for the keep-alive
    else:
        assert left < 5


@pytest.mark.parametrize("without", [False, True], ids=["all-patches", "without-the-patch"])
async def test_an_http2_stream_whose_app_fails_is_reset(
    tls_files: dict[str, str], without: bool
) -> None:
    """The sim's ``drop`` fault ends its app mid-response; hypercorn forgets the HTTP/2
    stream without END_STREAM or RST_STREAM, so the client waits on it for good: patch
    ``h2-reset-unfinished-streams`` resets it (INTERNAL_ERROR)."""
    import httpx

    from firstbyte.router.sim.server import running_sim
    from tests.router.conftest import client_tls
    from tests.router.sim.helpers import MODEL, chat_body

    skip = ("h2-reset-unfinished-streams",) if without else ()
    certfile, keyfile = tls_files["certfile"], tls_files["keyfile"]
    with patches.applied_except(*skip):
        async with (
            running_sim("instant", certfile=certfile, keyfile=keyfile, faults=["drop:after=2"],
                        served_model_names=[MODEL])
            as url,
            httpx.AsyncClient(http2=True, verify=client_tls(tls_files)) as client,
        ):
            body = chat_body("dropped", max_tokens=5)
            outcome = "ended"
            try:
                async with asyncio.timeout(3.0):
                    async with client.stream(
                        "POST", f"{url}/v1/chat/completions", json=body
                    ) as response:
                        assert response.status_code == 200  # streamed, then dropped
                        async for _ in response.aiter_raw():
                            pass
            except httpx.RemoteProtocolError:
                outcome = "reset"
            except TimeoutError:
                outcome = "hung"
    assert outcome == ("hung" if without else "reset")


def test_every_patch_names_a_test_that_exists() -> None:
    import re

    for patch in PATCHES:
        named = re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", patch.test)
        assert named, patch.name
        for path, function in named:
            source = (ROOT / path).read_text()
            assert not function or f"def {function}(" in source, (patch.name, path, function)
