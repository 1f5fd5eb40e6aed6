"""The deployment files are checked and exercised.

* docker/docker-compose.yml (and the CURVE overlay) pass ``docker compose config`` when the
  docker client has the compose plugin, and always a JSON-schema check of the fields used;
* docker/k8s/*.yaml pass kubernetes-validate (the API's own schemas) and consistency checks
  (selectors match pod labels, ConfigMap and claim references resolve);
* every HOGSHARD_* variable they set is one that hogshard reads (no silent typos);
* the compose services' exact commands and environments, run as local processes (service
  names -> 127.0.0.1, ports -> free ones), train the example to completion.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import jsonschema
import pytest
import yaml

from hogshard.cli import main as cli_main
from hogshard.proto.config import ClientSettings, env_name

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
CURVE_OVERLAY = DOCKER / "docker-compose.curve.yml"
K8S = sorted((DOCKER / "k8s").glob("*.yaml"))
#: Read by the example's container command and by the example itself.
EXTRA_ENV = {"HOGSHARD_EXAMPLE_ARGS", "HOGSHARD_TORCH_THREADS"}

_DURATION = {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"}
_STRINGS = {"type": "array", "items": {"type": "string"}, "minItems": 1}
SERVICE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "anyOf": [{"required": ["image"]}, {"required": ["build"]}],
    "properties": {
        "image": {"type": "string"},
        "build": {"type": "object", "additionalProperties": False, "required": ["context"],
                  "properties": {"context": {"type": "string"}, "dockerfile": {"type": "string"},
                                 "target": {"type": "string"}}},
        "command": _STRINGS,
        "environment": {"type": "object",
                        "additionalProperties": {"type": ["string", "number", "null"]}},
        "ports": {"type": "array", "items": {"type": "string",
                                             "pattern": r"^([0-9.]+:)?\d+(:\d+)?$"}},
        "volumes": {"type": "array", "items": {"type": "string", "pattern": r"^[^:]+:/[^:]*$"}},
        "secrets": {"type": "array", "items": {"type": "string"}},
        "depends_on": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["condition"], "additionalProperties": False,
            "properties": {"condition": {"enum": ["service_started", "service_healthy",
                                                  "service_completed_successfully"]}}}},
        "healthcheck": {"type": "object", "additionalProperties": False, "required": ["test"],
                        "properties": {"test": _STRINGS, "interval": _DURATION,
                                       "timeout": _DURATION, "start_period": _DURATION,
                                       "retries": {"type": "integer", "minimum": 1}}},
        "restart": {"type": "string",
                    "pattern": r"^(no|always|unless-stopped|on-failure(:\d+)?)$"},
    },
}
COMPOSE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "patternProperties": {"^x-": {}},
    "properties": {
        "name": {"type": "string"},
        "services": {"type": "object", "additionalProperties": SERVICE_SCHEMA},
        "volumes": {"type": "object"},
        "secrets": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["file"], "properties": {"file": {"type": "string"}}}},
    },
}


def known_env() -> set[str]:
    """Every HOGSHARD_* variable a hogshard command or worker reads."""
    names = {env_name(f) for f in ClientSettings.__dataclass_fields__} | EXTRA_ENV

    def walk(command: click.Command) -> None:
        for param in command.params:
            if isinstance(param.envvar, str):
                names.add(param.envvar)
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(cli_main)
    return names


def interpolate(text: str, environ: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}`` and ``$$``."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, default = match.group(1), match.group(2), match.group(3) or ""
        value = environ.get(name)
        if op == ":-" and not value or op == "-" and value is None:
            return default
        return value or ""

    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}", one, text)


def load_compose(path: Path, environ: dict[str, str] | None = None) -> dict[str, Any]:
    raw = yaml.safe_load(path.read_text())
    environ = {} if environ is None else environ

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return interpolate(node, environ) if isinstance(node, str) else node

    return walk(raw)


# ---- validation (no sockets) ---------------------------------------------------------------

def docker_compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "compose", "version"], capture_output=True,
                              timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.timeout(60)
def test_compose_passes_docker_compose_config(tmp_path: Path) -> None:
    if not docker_compose_available():
        pytest.skip("no `docker compose` on this machine; the schema test below covers it")
    keys = tmp_path / "keys"
    keys.mkdir()
    for files in ([COMPOSE], [COMPOSE, CURVE_OVERLAY]):
        argv = ["docker", "compose", *sum((["-f", str(f)] for f in files), []), "config", "-q"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                              env={**os.environ, "HOGSHARD_KEYS_DIR": str(keys)})
        assert done.returncode == 0, done.stderr


def test_compose_schema_and_references() -> None:
    for path in (COMPOSE, CURVE_OVERLAY):
        doc = load_compose(path)
        if path == CURVE_OVERLAY:  # an overlay names a subset of fields
            schema = json.loads(json.dumps(COMPOSE_SCHEMA))
            schema["properties"]["services"]["additionalProperties"].pop("anyOf")
        else:
            schema = COMPOSE_SCHEMA
        jsonschema.validate(doc, schema)
    doc = load_compose(COMPOSE)
    services = doc["services"]
    assert {"scheduler", "server0", "server1", "worker"} <= set(services)
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"
            if service["depends_on"][dependency]["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], dependency
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith((".", "/")) or source in doc["volumes"], volume
        assert service.get("restart"), f"{name} has no restart policy"
        assert "/checkpoints" in " ".join(service.get("volumes", [])), name
    overlay = load_compose(CURVE_OVERLAY)
    for name, service in overlay["services"].items():
        assert name in services
        assert set(service["secrets"]) <= set(overlay["secrets"])


def k8s_documents() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in K8S for doc in yaml.safe_load_all(path.read_text())
            if doc]


def test_k8s_manifests_validate() -> None:
    validate = pytest.importorskip("kubernetes_validate").validate
    docs = k8s_documents()
    assert {d["kind"] for _, d in docs} >= {"ConfigMap", "Deployment", "Service", "StatefulSet",
                                            "Job"}
    for name, doc in docs:
        try:
            validate(doc, "1.30", strict=True)
        except Exception as err:
            raise AssertionError(f"{name} {doc['kind']}: {err}") from None


def test_k8s_references_resolve() -> None:
    docs = k8s_documents()
    by_kind: dict[str, dict[str, dict]] = {}
    for _, doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    config = by_kind["ConfigMap"]["hogshard-config"]["data"]
    assert config["HOGSHARD_SCHEDULER"] == "tcp://hogshard-scheduler:7000"
    assert "hogshard-scheduler" in by_kind["Service"]
    statefulset = by_kind["StatefulSet"]["hogshard-server"]
    assert by_kind["Service"][statefulset["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["replicas"] == int(config["HOGSHARD_SERVERS"])
    job = by_kind["Job"]["hogshard-workers"]
    assert job["spec"]["completions"] == int(config["HOGSHARD_NUM_WORKERS"])
    for kind in ("Deployment", "StatefulSet", "Job"):
        for name, doc in by_kind[kind].items():
            template = doc["spec"]["template"]
            selector = doc["spec"].get("selector", {}).get("matchLabels", {})
            assert selector.items() <= template["metadata"]["labels"].items(), name
            for container in template["spec"]["containers"]:
                for source in container.get("envFrom", []):
                    assert source["configMapRef"]["name"] in by_kind["ConfigMap"], name
            for volume in template["spec"].get("volumes", []):
                claim = volume.get("persistentVolumeClaim", {}).get("claimName")
                assert claim is None or claim in by_kind["PersistentVolumeClaim"], name
    for name, service in by_kind["Service"].items():
        selector = service["spec"]["selector"]
        assert any(selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
                   for kind in ("Deployment", "StatefulSet") for d in by_kind[kind].values()), \
            f"Service {name} selects no pods"


def test_every_hogshard_variable_is_read_by_hogshard() -> None:
    known = known_env()
    used: dict[str, str] = {}
    for path in (COMPOSE, CURVE_OVERLAY):
        for name, service in load_compose(path)["services"].items():
            for key in service.get("environment", {}) or {}:
                used[key] = f"{path.name}:{name}"
    for path_name, doc in k8s_documents():
        if doc["kind"] == "ConfigMap":
            used.update({k: path_name for k in doc["data"]})
        for container in doc.get("spec", {}).get("template", {}).get("spec", {}).get(
                "containers", []):
            used.update({e["name"]: path_name for e in container.get("env", [])})
    sbatch = (DOCKER / "slurm" / "train.sbatch").read_text()
    used.update({k: "train.sbatch" for k in re.findall(r"export (HOGSHARD_[A-Z_]+)", sbatch)})
    unknown = {k: where for k, where in used.items() if k.startswith("HOGSHARD_")
               and k not in known}
    assert not unknown, f"variables no hogshard command reads: {unknown}"


def test_grafana_dashboard_queries_known_metrics() -> None:
    dashboard = json.loads((DOCKER / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    metric_names = set(re.findall(r"hogshard_[a-z_]+", " ".join(exprs)))
    sources = "".join((REPO / p).read_text() for p in
                      ("ps/metrics.py", "scheduler/metrics.py"))
    for metric in metric_names:
        base = re.sub(r"_(total|bucket|count|sum)$", "", metric)
        assert f'"{base}"' in sources or f'"{base}' in sources, f"{metric} is not exported"


# ---- the compose services as local processes -------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def localise(services: dict[str, Any], checkpoints: Path) -> dict[str, dict[str, Any]]:
    """Each service's argv and environment with service names -> 127.0.0.1, every (service,
    port) -> a free port, and the checkpoints volume -> a local folder."""
    ports: dict[tuple[str, str], int] = {}

    def port_for(service: str, port: str) -> str:
        return str(ports.setdefault((service, port), free_port()))

    def fix(service: str, text: str) -> str:
        def one(m: re.Match[str]) -> str:
            scheme, host, port = m.groups()
            if host in ("0.0.0.0", "127.0.0.1"):  # the service's own port
                owner = service
            elif host in services:
                owner = host
            else:
                return m.group(0)
            return f"{scheme}://127.0.0.1:{port_for(owner, port)}"

        text = re.sub(r"(tcp|http)://([a-z0-9_.-]+):(\d+)", one, text)
        return text.replace("/checkpoints", str(checkpoints))

    local = {}
    for name, service in services.items():
        env = {k: fix(name, str(v)) for k, v in (service.get("environment") or {}).items()}
        if "HOGSHARD_METRICS_PORT" in env:
            env["HOGSHARD_METRICS_PORT"] = port_for(name, env["HOGSHARD_METRICS_PORT"])
        local[name] = {"argv": [fix(name, a) for a in service["command"]], "env": env,
                       "health": [fix(name, a) for a in service.get("healthcheck", {}).get(
                           "test", ["NONE"])[1:]]}
    return local


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_compose_services_train_as_local_processes(procs, tmp_path: Path) -> None:
    workers = 2
    environ = {"HOGSHARD_NUM_WORKERS": str(workers), "HOGSHARD_CHECKPOINT_EVERY": "5",
               "HOGSHARD_EXAMPLE_ARGS": "--epochs 1 --limit 256 --batch 64 --rule sgd --lr 0.05"}
    services = load_compose(COMPOSE, environ)["services"]
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    local = localise(services, checkpoints)
    # `hogshard` and `python` on PATH are this interpreter's, as in the image.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

    def start(name: str, label: str) -> Any:
        return procs.spawn(label, local[name]["argv"], {**local[name]["env"], "PATH": path})

    scheduler = start("scheduler", "scheduler")
    health = local["scheduler"]["health"]

    def healthy() -> bool:
        if not scheduler.alive():
            raise AssertionError(f"the scheduler exited\n{scheduler.tail()}")
        done = subprocess.run(health, capture_output=True, timeout=30,
                              env={**os.environ, "PATH": path})
        return done.returncode == 0

    procs.wait_until(healthy, 40.0, "the scheduler's healthcheck", interval=0.5,
                     on_timeout=scheduler.tail)
    servers = [start(name, name) for name in ("server0", "server1")]
    for server, name in zip(servers, ("server0", "server1"), strict=True):
        server.wait_for_output(r"server metrics on", 40.0)
        done = subprocess.run(local[name]["health"], capture_output=True, timeout=30,
                              env={**os.environ, "PATH": path})
        assert done.returncode == 0, done.stderr
    runs = [start("worker", f"worker{i}") for i in range(workers)]
    for run in runs:
        assert run.wait(90.0) == 0, run.tail()
    report = json.loads((checkpoints / "report.json").read_text())
    assert report["workers"] == workers and report["servers"] == 2, report
    assert report["final_loss"] is not None
    assert report["history"] and len(report["history"][0]) == len(report["history_columns"])
    assert all(p.alive() for p in [scheduler, *servers]), procs.report()
