"""The router image's Python environment, built as deploy/Containerfile builds it, and its entry
point run against the shipped config (deploy/router.toml) as the image would run it.

No container runtime runs on this machine, so the image itself is never built here. Instead this
test reads the Containerfile and does what it says in a temporary folder standing for the
image's root: it copies what the build stage COPYs, runs the build stage's RUN lines (the same
deploy/build-env.sh commands, with the same arguments moved under that folder; dependencies
from the package index), then starts the final stage's ENTRYPOINT (and a `firstbyte sim` from
the same environment as its upstream), asks /healthz over TLS and HTTP/3, runs the HEALTHCHECK
command, checks the config with the entry point, and stops it with SIGTERM. What it cannot do:
the base image, the `useradd`, running as uid 10001, the read-only root file system.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trustme

from firstbyte.benchmarks.ports import free_port
from tests.deploy.containerfile import ROOT, Instruction, Stage, read_stages
from tests.router.h3client import h3_request

pytestmark = pytest.mark.slow

SHIPPED_CONFIG = ROOT / "deploy" / "router.toml"
API_KEY = "sk-replace-with-a-generated-key-0001"
"""The placeholder key of the shipped config: it must never appear in the router's output."""


@dataclass(frozen=True)
class ImageRoot:
    """A folder standing for the image's root file system."""

    path: Path

    def __call__(self, image_path: str) -> Path:
        """Where the image's absolute ``image_path`` is in this folder."""
        assert image_path.startswith("/"), image_path
        return self.path / image_path.lstrip("/")

    def remap(self, word: str) -> str:
        return str(self(word)) if word.startswith("/") else word


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without the checkout on the import path (the image has no checkout)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(extra)
    return env


def _copy(root: ImageRoot, workdir: str, instruction: Instruction) -> None:
    """``COPY SRC... DEST`` from the build context (the repository), as the builder does:
    a directory's contents go into DEST; files into DEST/ when it is a folder."""
    *sources, dest = instruction.words()
    assert not any(s.startswith("--") for s in sources), f"not supported here: {instruction}"
    target = root(dest if dest.startswith("/") else f"{workdir}/{dest}")
    into_folder = dest.endswith("/") or len(sources) > 1
    for source in sources:
        origin = ROOT / source
        if origin.is_dir():
            shutil.copytree(origin, target, symlinks=True, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        else:
            destination = target / origin.name if into_folder else target
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, destination)


def _run(root: ImageRoot, workdir: str, instruction: Instruction) -> None:
    """A build-stage ``RUN``: its program found on the image's PATH, its paths moved."""
    program, *args = instruction.words()
    executable = root(program) if program.startswith("/") else root(f"/usr/local/bin/{program}")
    assert executable.is_file(), f"{instruction}: only programs the stage COPYs can run here"
    subprocess.run(
        [str(executable), *(root.remap(a) for a in args)],
        cwd=root(workdir), env=_clean_env(PYTHON=sys.executable), check=True, timeout=600,
    )  # fmt: skip


def _build(stage: Stage, root: ImageRoot) -> None:
    workdir = "/"
    for instruction in stage.instructions:
        if instruction.keyword == "WORKDIR":
            workdir = instruction.args
            root(workdir).mkdir(parents=True, exist_ok=True)
        elif instruction.keyword == "COPY":
            _copy(root, workdir, instruction)
        elif instruction.keyword == "RUN":
            _run(root, workdir, instruction)
        else:
            raise AssertionError(f"the build stage may only COPY and RUN here: {instruction}")


def _image_env(stage: Stage) -> dict[str, str]:
    """The final stage's ``ENV K=V ...`` settings."""
    env: dict[str, str] = {}
    for instruction in stage.all("ENV"):
        for word in instruction.words():
            key, _, value = word.partition("=")
            env[key] = value
    return env


@dataclass(frozen=True)
class Image:
    root: ImageRoot
    final: Stage

    def entrypoint(self) -> list[str]:
        return [self.root.remap(w) for w in self.final.one("ENTRYPOINT").exec_form()]

    def healthcheck(self) -> list[str]:
        _options, cmd, command = self.final.one("HEALTHCHECK").args.partition("CMD ")
        assert cmd, "HEALTHCHECK needs a CMD"
        return [self.root.remap(w) for w in Instruction("CMD", command).exec_form()]

    @property
    def workdir(self) -> Path:
        return self.root(self.final.all("WORKDIR")[-1].args)

    def env(self, **extra: str) -> dict[str, str]:
        image_env = _image_env(self.final)
        path = ":".join(self.root.remap(p) for p in image_env.pop("PATH").split(":")[:-1])
        return _clean_env(**{**image_env, "PATH": f"{path}:{os.environ['PATH']}", **extra})


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    build, final = read_stages()
    root = ImageRoot(tmp_path_factory.mktemp("image") / "rootfs")
    _build(build, root)
    (copied,) = [i for i in final.all("COPY") if i.args.startswith("--from=")]
    _, source, dest = copied.words()
    # A virtual environment is not relocatable: it must sit where the build stage made it.
    assert (source, dest) == ("/opt/firstbyte", "/opt/firstbyte")
    return Image(root, final)


def test_the_build_stage_copies_every_part_of_the_package() -> None:
    build, _ = read_stages()
    copied = {i.words()[0] for i in build.all("COPY")}
    parts = {p.name for p in (ROOT / "firstbyte").iterdir() if p.is_symlink()}
    assert parts <= copied, f"deploy/Containerfile does not COPY {sorted(parts - copied)}"
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert {f"!{part}" for part in parts} <= set(ignore), ".dockerignore leaves a part out"
    # Every file the build stage COPYs is in the build context (LICENSE: pyproject.toml's
    # license-files; without it the wheel does not build).
    sources = {source for i in build.all("COPY") for source in i.words()[:-1]}
    assert {f"!{source}" for source in sources} <= set(ignore), ".dockerignore leaves a COPY out"


def test_the_final_stage_runs_as_a_fixed_non_root_user_on_both_ports() -> None:
    build, final = read_stages()
    assert build.base == final.base == "python:3.11-slim"
    assert final.one("USER").args == "10001:10001"
    assert set(final.one("EXPOSE").words()) == {"8443/tcp", "8443/udp"}
    assert final.one("ENTRYPOINT").exec_form() == [
        "/opt/firstbyte/bin/firstbyte", "router", "--config", "/etc/firstbyte/router.toml",
    ]  # fmt: skip
    assert _image_env(final)["FIRSTBYTE_HEALTHZ_URL"] == "https://127.0.0.1:8443/healthz"
    assert re.search(r"^port = 8443\b", SHIPPED_CONFIG.read_text(), re.MULTILINE)


def test_the_environment_holds_the_router_extra_only(image: Image) -> None:
    python = image.root("/opt/firstbyte/bin/python")
    code = (
        "import importlib.util as u; print(' '.join(m for m in ("
        "'hypercorn', 'uvicorn', 'granian', 'geoip2', 'uvloop', 'aioquic',"
        " 'trustme', 'mmdb_writer', 'openai', 'pytest', 'pip') if u.find_spec(m)))"
    )
    found = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                           env=_clean_env(), check=True, timeout=60).stdout.split()  # fmt: skip
    assert found == ["hypercorn", "uvicorn", "granian", "geoip2", "uvloop", "aioquic"]


@pytest.fixture
def sims(image: Image) -> Iterator[list[str]]:
    """Two ``firstbyte sim`` from the image's environment: the region's upstreams (one each:
    the router refuses one URL listed twice)."""
    firstbyte = image.root("/opt/firstbyte/bin/firstbyte")
    procs = [subprocess.Popen(
        [str(firstbyte), "sim", "--port", "0", "--profile", "instant"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_clean_env(),
    ) for _ in range(2)]  # fmt: skip
    try:
        urls = []
        for proc in procs:
            assert proc.stdout is not None
            match = re.search(r"serving (http://\S+)", proc.stdout.readline())
            assert match, proc.stderr.read() if proc.stderr else ""
            urls.append(match.group(1))
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(20)


@dataclass(frozen=True)
class Mounted:
    config: Path
    cafile: str


@pytest.fixture
def mounted(image: Image, sims: list[str]) -> Mounted:
    """The shipped config and a certificate where the image expects them. Only addresses and
    mounted paths change: the upstreams become the sims, the peers a closed loopback port (a
    peer that does not answer is no candidate), /etc/firstbyte this test's folder."""
    ca = trustme.CA()
    tls = image.root("/etc/firstbyte/tls")
    tls.mkdir(parents=True, exist_ok=True)
    cert = ca.issue_cert("localhost", "127.0.0.1", "us-east-1.llm.example.com")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tls / "tls.crt"))
    cert.private_key_pem.write_to_path(str(tls / "tls.key"))
    ca.cert_pem.write_to_path(str(tls.parent / "ca.pem"))
    text = SHIPPED_CONFIG.read_text()
    upstreams = re.findall(r'^url = "(http://[^"]+)"', text, re.MULTILINE)
    peers = re.findall(r'^url = "(https://[^"]+)"', text, re.MULTILINE)
    assert len(upstreams) == len(sims), upstreams
    assert len(peers) == 2, peers
    closed = f"https://127.0.0.1:{free_port(udp=True)}"
    for url, sim in zip(upstreams, sims, strict=True):
        text = text.replace(f'"{url}"', f'"{sim}"')
    for url in peers:
        text = text.replace(f'"{url}"', f'"{closed}"')
    text = text.replace('"/etc/firstbyte/', f'"{image.root("/etc/firstbyte")}/')
    config = image.root("/etc/firstbyte/router.toml")
    config.write_text(text)
    return Mounted(config, str(tls.parent / "ca.pem"))


def test_the_entry_point_checks_the_config(image: Image, mounted: Mounted) -> None:
    result = subprocess.run(
        [*image.entrypoint(), "--check-config", str(mounted.config)],
        capture_output=True, text=True, env=image.env(), cwd=image.workdir, timeout=60,
        check=False,
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (0, "OK\n"), result.stderr
    # The shipped placeholders, one warning each, until the operator replaces them.
    prefix = f"firstbyte router: warning: {mounted.config}: "
    assert [line.removeprefix(prefix).split(": ")[0] for line in result.stderr.splitlines()] == [
        "auth.api_keys[0]", "auth.metrics_keys[0]", "routing.peer_key"]
    assert "placeholder" in result.stderr


async def test_the_entry_point_serves_the_shipped_config(image: Image, mounted: Mounted) -> None:
    port = free_port(udp=True)
    healthz = f"https://127.0.0.1:{port}/healthz"
    # `docker run IMAGE --host 127.0.0.1 --port N`: arguments after the image are appended.
    proc = await asyncio.create_subprocess_exec(
        *image.entrypoint(), "--host", "127.0.0.1", "--port", str(port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=image.env(), cwd=image.workdir,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(
            verify=ssl.create_default_context(cafile=mounted.cafile), http2=True
        ) as client:
            for _ in range(400):
                try:
                    response = await client.get(healthz)
                    if response.status_code == 200:
                        break
                except httpx.TransportError:
                    assert proc.returncode is None, await proc.communicate()
                await asyncio.sleep(0.05)
            assert (response.status_code, response.text) == (200, "ok\n")
            assert response.http_version == "HTTP/2"
            assert response.headers["alt-svc"] == f'h3=":{port}"; ma=86400'
        h3 = await h3_request(port, "GET", "/healthz", cafile=mounted.cafile)
        assert (h3.status, h3.body) == (200, b"ok\n")
        check = await asyncio.create_subprocess_exec(
            *image.healthcheck(), env=image.env(FIRSTBYTE_HEALTHZ_URL=healthz),
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, check_stderr = await asyncio.wait_for(check.communicate(), 30)
        assert check.returncode == 0, check_stderr
    finally:
        proc.send_signal(signal.SIGTERM)  # drains: exit 0
        raw_stdout, raw_stderr = await asyncio.wait_for(proc.communicate(), 30)
    stdout, stderr = raw_stdout.decode(), raw_stderr.decode()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr + stdout
    assert "(us-east-1)" in stdout  # the start-up line, with the other log lines on stdout
    assert "draining" in stdout
    assert API_KEY not in stderr + stdout
