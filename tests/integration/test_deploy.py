"""The deployment files are checked and exercised.

* docker/docker-compose.yml (alone and with each overlay) passes ``docker compose config`` when
  the docker client has the compose plugin, and always a JSON-schema check of the fields used;
* CURVE is on by default: a one-shot ``keys`` service writes the keys into a volume every other
  service waits for and mounts read-only as HOGSHARD_KEYS; the insecure overlay (plain TCP)
  and the bring-your-own-keys overlay change exactly that; every Kubernetes pod mounts the
  keys Secret;
* docker/k8s/*.yaml pass kubernetes-validate (the API's own schemas) and consistency checks
  (selectors match pod labels, ConfigMap and claim references resolve);
* every HOGSHARD_* variable they set is one that hogshard reads (no silent typos);
* the compose services' exact commands and environments, run as local processes (service
  names -> 127.0.0.1, ports -> free ones, volumes -> folders), generate the keys the way the
  keys service does (twice: the second run keeps them), refuse a client without keys and train
  the example to completion over CURVE; the insecure overlay's scheduler runs without keys.
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
from hogshard.proto.errors import ConfigError
from hogshard.proto.roles import Role
from hogshard.proto.security import Security, clients_for, generate_keys

#: Every test here, the static checks of the deployment files too.
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
INSECURE_OVERLAY = DOCKER / "docker-compose.insecure.yml"
KEYS_OVERLAY = DOCKER / "docker-compose.keys.yml"
OVERLAYS = (INSECURE_OVERLAY, KEYS_OVERLAY)
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
                                 "target": {"type": "string"},
                                 "args": {"type": "object", "additionalProperties": {
                                     "type": ["string", "null"]}}}},
        "command": _STRINGS,
        "environment": {"type": "object",
                        "additionalProperties": {"type": ["string", "number", "null"]}},
        "ports": {"type": "array", "items": {"type": "string",
                                             "pattern": r"^([0-9.]+:)?\d+(:\d+)?$"}},
        "volumes": {"type": "array", "items": {"type": "string", "pattern": r"^[^:]+:/[^:]*(:(ro|rw))?$"}},
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
    "properties": {  # no top-level "name": docker-compose 1.29 refuses it
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


def volume_target(volume: str) -> str:
    return volume.split(":")[1]


def merge_compose(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``docker compose -f BASE -f OVERLAY``'s merge for the fields these files use: mappings
    (environment, depends_on) merge key by key, volumes by container path, the rest is
    replaced."""
    merged = json.loads(json.dumps(base))
    for name, service in overlay.get("services", {}).items():
        into = merged["services"].setdefault(name, {})
        for key, value in service.items():
            if key in ("environment", "depends_on"):
                into[key] = {**into.get(key, {}), **value}
            elif key == "volumes":
                mounts = {volume_target(v): v for v in into.get("volumes", [])}
                mounts.update({volume_target(v): v for v in value})
                into[key] = list(mounts.values())
            else:
                into[key] = value
    for key in ("volumes", "secrets"):
        if overlay.get(key):
            merged[key] = {**merged.get(key, {}), **overlay[key]}
    return merged


# ---- validation (no sockets) ---------------------------------------------------------------

def compose_cli() -> list[str] | None:
    """``docker-compose`` (Debian's 1.29) or ``docker compose`` (v2), whichever answers."""
    for argv in (["docker-compose"], ["docker", "compose"]):
        if shutil.which(argv[0]) is None:
            continue
        try:
            if subprocess.run([*argv, "version"], capture_output=True,
                              timeout=20).returncode == 0:
                return argv
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


@pytest.mark.timeout(60)
def test_compose_passes_docker_compose_config(tmp_path: Path) -> None:
    """Both compose flavours accept the files (1.29 refuses e.g. a top-level ``name:``)."""
    compose = compose_cli()
    if compose is None:
        pytest.skip("no docker-compose or `docker compose` here; the schema test covers it")
    keys = tmp_path / "keys"
    keys.mkdir()
    for files in ([COMPOSE], *([COMPOSE, overlay] for overlay in OVERLAYS)):
        argv = [*compose, *sum((["-f", str(f)] for f in files), []), "-p", "hogshard-check",
                "config", "-q"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                              env={**os.environ, "HOGSHARD_KEYS_DIR": str(keys)})
        assert done.returncode == 0, done.stderr


def test_compose_schema_and_references() -> None:
    for path in (COMPOSE, *OVERLAYS):
        doc = load_compose(path)
        if path in OVERLAYS:  # an overlay names a subset of fields
            schema = json.loads(json.dumps(COMPOSE_SCHEMA))
            schema["properties"]["services"]["additionalProperties"].pop("anyOf")
        else:
            schema = COMPOSE_SCHEMA
        jsonschema.validate(doc, schema)
    doc = load_compose(COMPOSE)
    services = doc["services"]
    assert {"keys", "scheduler", "server0", "server1", "worker"} <= set(services)
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"
            if service["depends_on"][dependency]["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], dependency
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith((".", "/")) or source in doc["volumes"], volume
        assert service.get("restart"), f"{name} has no restart policy"
        if name != "keys":
            assert "/checkpoints" in " ".join(service.get("volumes", [])), name
    for path in OVERLAYS:
        overlay = load_compose(path)
        for name, service in overlay["services"].items():
            assert name in services, f"{path.name}: unknown service {name}"
            assert set(service.get("secrets", [])) <= set(overlay.get("secrets", {}))


KEYS_COMMAND = ["hogshard", "keys", "generate", "--if-missing", "--servers", "2", "/keys"]


def job_services(doc: dict[str, Any]) -> dict[str, Any]:
    """Every service but the one-shot keys service."""
    return {k: v for k, v in doc["services"].items() if k != "keys"}


def test_compose_runs_curve_by_default() -> None:
    doc = load_compose(COMPOSE)
    keys = doc["services"]["keys"]
    assert keys["command"] == KEYS_COMMAND and keys["volumes"] == ["keys:/keys"]
    assert keys["restart"] == "no" and "keys" in doc["volumes"]
    assert keys["build"]["target"] == "server"
    for name, service in job_services(doc).items():
        env = service["environment"]
        assert env["HOGSHARD_KEYS"] == "/keys", name
        assert "HOGSHARD_INSECURE" not in env, f"{name}: plain TCP must be opt-in"
        assert "keys:/keys:ro" in service["volumes"], f"{name} must mount the keys read-only"
        assert service["depends_on"]["keys"] == {
            "condition": "service_completed_successfully"}, name
    # one keypair per server rank: every server service's rank has its own key
    servers = int(doc["services"]["scheduler"]["environment"]["HOGSHARD_SERVERS"])
    assert keys["command"][keys["command"].index("--servers") + 1] == str(servers)
    ranks = sorted(int(service["environment"]["HOGSHARD_RANK"])
                   for service in job_services(doc).values()
                   if service["command"][:2] == ["hogshard", "server"])
    assert ranks == list(range(servers))


def test_insecure_overlay_turns_curve_off() -> None:
    doc = merge_compose(load_compose(COMPOSE), load_compose(INSECURE_OVERLAY))
    assert "generate" not in doc["services"]["keys"]["command"]
    for name, service in job_services(doc).items():
        assert service["environment"]["HOGSHARD_KEYS"] == "", name  # click: unset
        assert service["environment"]["HOGSHARD_INSECURE"] == "1", name


def test_keys_overlay_mounts_your_own_keys_everywhere(tmp_path: Path) -> None:
    doc = merge_compose(load_compose(COMPOSE),
                        load_compose(KEYS_OVERLAY, {"HOGSHARD_KEYS_DIR": str(tmp_path)}))
    for name, service in doc["services"].items():
        mounts = [v for v in service["volumes"] if volume_target(v) == "/keys"]
        assert mounts == [f"{tmp_path}:/keys:ro"], f"{name}: {service['volumes']}"
    assert doc["services"]["keys"]["command"] == KEYS_COMMAND  # checks them, writes nothing
    default = merge_compose(load_compose(COMPOSE), load_compose(KEYS_OVERLAY))
    assert "./keys:/keys:ro" in default["services"]["worker"]["volumes"]


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
            # CURVE by default: the keys Secret, mounted read-only where HOGSHARD_KEYS points,
            # readable by the images' non-root user through fsGroup.
            pod = template["spec"]
            secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
            assert [s["secretName"] for s in secrets.values()] == ["hogshard-keys"], name
            assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
            # A server pod's container sees only its own keys: a memory folder its init
            # container fills from the Secret (test_k8s_server_pods_get_only_their_own_key).
            own = {v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get(
                "medium") == "Memory"} if kind == "StatefulSet" else set()
            for container in pod["containers"]:
                mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
                mount = mounts[config["HOGSHARD_KEYS"]]
                assert mount["name"] in set(secrets) | own and mount["readOnly"], name
                assert kind != "StatefulSet" or mount["name"] in own, name
    assert "HOGSHARD_INSECURE" not in config
    for name, service in by_kind["Service"].items():
        selector = service["spec"]["selector"]
        assert any(selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
                   for kind in ("Deployment", "StatefulSet") for d in by_kind[kind].values()), \
            f"Service {name} selects no pods"


def test_k8s_server_pods_get_only_their_own_key(tmp_path: Path) -> None:
    """The server StatefulSet's init container, run here on a flattened copy of a `keys
    generate --servers N` folder (what the Secret mounts) for pod hogshard-server-1: the
    folder it fills holds the cluster's keys, the public keys and rank 1's keypair only, and
    a server of rank 1 loads its own key from it."""
    docs = {doc["metadata"]["name"]: doc for _, doc in k8s_documents()}
    config = docs["hogshard-config"]["data"]
    servers = int(config["HOGSHARD_SERVERS"])
    pod = docs["hogshard-server"]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    secret = next(v["name"] for v in pod["volumes"] if "secret" in v)
    own = next(v["name"] for v in pod["volumes"] if "emptyDir" in v)
    keys = tmp_path / "keys"
    generate_keys(keys, clients_for(servers=servers))
    flat, target = tmp_path / "secret", tmp_path / "own"
    flat.mkdir()
    target.mkdir()
    for path in keys.glob("*.key*"):
        (flat / path.name).write_bytes(path.read_bytes())
    command = init["command"][-1].replace(mounts[secret], str(flat)).replace(
        mounts[own], str(target))
    done = subprocess.run([*init["command"][:-1], command], capture_output=True, text=True,
                          env={**os.environ, "HOSTNAME": "hogshard-server-1"}, timeout=30)
    assert done.returncode == 0, done.stderr
    secrets = sorted(p.name for p in target.glob("*.key_secret"))
    assert secrets == ["server.key_secret", "shard-1.key_secret"], secrets
    assert Security.from_dir(target, role=Role.SERVER, rank=1).client_name == "shard-1"
    with pytest.raises(ConfigError, match="shard-0.key_secret"):
        Security.from_dir(target, role=Role.SERVER, rank=0)


def test_every_hogshard_variable_is_read_by_hogshard() -> None:
    known = known_env()
    used: dict[str, str] = {}
    for path in (COMPOSE, *OVERLAYS):
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


def localise(services: dict[str, Any], volumes: Path) -> dict[str, dict[str, Any]]:
    """Each service's argv and environment with service names -> 127.0.0.1, every (service,
    port) -> a free port, and every volume -> a folder under ``volumes`` (created empty, as
    docker creates a named volume)."""
    ports: dict[tuple[str, str], int] = {}

    def port_for(service: str, port: str) -> str:
        return str(ports.setdefault((service, port), free_port()))

    def fix(service: str, text: str, mounts: dict[str, Path]) -> str:
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
        for target, folder in mounts.items():
            text = re.sub(rf"(?<![\w/.]){re.escape(target)}(?=/|$)", lambda _, f=folder: str(f),
                          text)
        return text

    local = {}
    for name, service in services.items():
        mounts = {}
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            mounts[target] = volumes / re.sub(r"[^A-Za-z0-9_.-]", "_", source)
            mounts[target].mkdir(parents=True, exist_ok=True)
        env = {k: fix(name, str(v), mounts)
               for k, v in (service.get("environment") or {}).items()}
        for variable in ("HOGSHARD_METRICS_PORT", "HOGSHARD_HTTP_PORT"):
            if variable in env:
                env[variable] = port_for(name, env[variable])
        local[name] = {"argv": [fix(name, a, mounts) for a in service["command"]], "env": env,
                       "health": [fix(name, a, mounts) for a in service.get(
                           "healthcheck", {}).get("test", ["NONE"])[1:]]}
    return local


def key_files(keys: Path) -> dict[str, bytes]:
    return {p.relative_to(keys).as_posix(): p.read_bytes() for p in keys.rglob("*")
            if p.is_file()}


def on_path() -> dict[str, str]:
    """`hogshard` and `python` on PATH are this interpreter's, as in the image."""
    return {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def start_scheduler(procs, local: dict[str, dict[str, Any]]) -> Any:
    """The scheduler service, waited for until its own healthcheck (in its environment)
    passes, as the servers' depends_on does."""
    scheduler = procs.spawn("scheduler", local["scheduler"]["argv"],
                            {**local["scheduler"]["env"], **on_path()})

    def healthy() -> bool:
        if not scheduler.alive():
            raise AssertionError(f"the scheduler exited\n{scheduler.tail()}")
        code, _ = procs.run("scheduler-health", local["scheduler"]["health"], 30.0,
                            {**local["scheduler"]["env"], **on_path()})
        return code == 0

    procs.wait_until(healthy, 40.0, "the scheduler's healthcheck", interval=0.5,
                     on_timeout=scheduler.tail)
    return scheduler


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_compose_services_train_as_local_processes(procs, tmp_path: Path) -> None:
    workers = 2
    environ = {"HOGSHARD_NUM_WORKERS": str(workers), "HOGSHARD_CHECKPOINT_EVERY": "5",
               "HOGSHARD_EXAMPLE_ARGS": "--epochs 1 --limit 256 --batch 64 --rule sgd --lr 0.05"}
    services = load_compose(COMPOSE, environ)["services"]
    local = localise(services, tmp_path / "volumes")
    checkpoints, keys = tmp_path / "volumes" / "checkpoints", tmp_path / "volumes" / "keys"

    def start(name: str, label: str) -> Any:
        return procs.spawn(label, local[name]["argv"], {**local[name]["env"], **on_path()})

    # The keys service, on the fresh (empty) volume and again on the next `up`: same keys.
    assert local["keys"]["argv"][-1] == str(keys)
    for attempt in range(2):
        code, output = procs.run(f"keys{attempt}", local["keys"]["argv"], 60.0,
                                 {**local["keys"]["env"], **on_path()})
        assert code == 0, output
        if attempt == 0:
            generated = key_files(keys)
            assert "server.key_secret" in generated and "worker.key_secret" in generated
            # each server its own key, none shared
            assert {"shard-0.key_secret", "shard-1.key_secret"} <= set(generated)
            assert "shard.key_secret" not in generated
    assert key_files(keys) == generated
    for name in ("scheduler", "server0", "server1", "worker"):
        assert local[name]["env"]["HOGSHARD_KEYS"] == str(keys), name

    scheduler = start_scheduler(procs, local)
    scheduler.wait_for_output(r"CURVE on", 10.0)
    # A client without the keys gets nothing (no status, no error reply).
    health = local["scheduler"]["health"]
    address = health[health.index("--scheduler") + 1]
    code, output = procs.run("no-keys-status", ["hogshard", "status", "--json", "--timeout", "1",
                                                "--scheduler", address], 30.0, on_path())
    assert code != 0 and '"members"' not in output, output
    servers = [start(name, name) for name in ("server0", "server1")]
    for server, name in zip(servers, ("server0", "server1"), strict=True):
        server.wait_for_output(r"server metrics on", 40.0)
        code, output = procs.run(f"{name}-health", local[name]["health"], 30.0,
                                 {**local[name]["env"], **on_path()})
        assert code == 0, output
    runs = [start("worker", f"worker{i}") for i in range(workers)]
    for run in runs:
        assert run.wait(90.0) == 0, run.tail()
    report = json.loads((checkpoints / "report.json").read_text())
    assert report["workers"] == workers and report["servers"] == 2, report
    assert report["final_loss"] is not None
    assert report["history"] and len(report["history"][0]) == len(report["history_columns"])
    # HOGSHARD_EXIT_WHEN_DONE: the job ends with its workers (a final checkpoint), every
    # process exiting 0, which `restart: on-failure` leaves down
    for proc in [scheduler, *servers]:
        assert proc.wait(60.0) == 0, proc.tail()
    assert (checkpoints / "LATEST").is_file(), scheduler.tail()


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_insecure_overlay_scheduler_runs_without_keys(procs, tmp_path: Path) -> None:
    """With docker-compose.insecure.yml the keys service writes nothing and the scheduler binds
    0.0.0.0 over plain TCP (HOGSHARD_KEYS="" reads as unset), healthy to a client without
    keys."""
    doc = merge_compose(load_compose(COMPOSE), load_compose(INSECURE_OVERLAY))
    local = localise(doc["services"], tmp_path / "volumes")
    code, output = procs.run("keys", local["keys"]["argv"], 30.0, on_path())
    assert code == 0 and not key_files(tmp_path / "volumes" / "keys"), output
    scheduler = start_scheduler(procs, local)
    assert "CURVE on" not in scheduler.output()
