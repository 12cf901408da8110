"""The Kubernetes manifests in compose/k8s, checked offline.

kubernetes-validate checks every resource against the Kubernetes API's JSON schemas, strictly
(an unknown field is an error), for fixed Kubernetes versions; the schemas ship inside the
package, so nothing is fetched. Our own checks then read the manifests as tandem would run them:

- every TANDEM_* variable a container gets (its `env`, or the ConfigMaps it reads) is a setting
  of its role's config dataclass, and together they build a valid config (`$(POD_IP)` resolved
  to a dummy address, Secrets to dummy values);
- every long-running container has liveness and readiness probes on the port and path its
  service answers them at, bound where the kubelet can reach it, and advertises addresses that
  other pods can reach;
- the gateway stops before the kubelet's SIGKILL: its preStop sleep (the pod leaves the
  Service's endpoints while it still serves), its `shutdown_grace_s` and its exit all fit in the
  pod's terminationGracePeriodSeconds, which the preStop counts against too;
- the HPAs scale the prefill and decode Deployments on metrics that the adapter rules map from
  gauges those roles export;
- the kustomization lists every manifest.

Each check returns its problems as sentences; the mutated manifests at the end show that the
checks fail, and what they say.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate.utils as kubernetes_validate
import pytest
import torch
import yaml
import zmq
from transformers import AutoConfig

from services.batch.service import BatchServiceConfig
from services.gateway.service import STREAM_END_S, GatewayConfig
from services.scheduler.service import SchedulerConfig
from services.worker.config import WorkerConfig
from shared.config import ConfigError, config_from_args, env_name
from shared.engine.kv_cache import num_blocks_for_budget
from shared.engine.model_config import ModelConfig
from shared.engine.model_files import resolve_model_dir
from shared.lifecycle import DecodeEvents, PrefillEvents

K8S = Path(__file__).resolve().parents[2] / "compose" / "k8s"
KUSTOMIZATION = "kustomization.yaml"
ADAPTER_RULES = "prometheus-adapter-rules.yaml"  # the adapter's configuration, applied apart
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")  # the oldest we claim; the newest the package knows

CONFIGS = {
    "gateway": GatewayConfig,
    "scheduler": SchedulerConfig,
    "prefill": WorkerConfig,
    "decode": WorkerConfig,
    "batch-service": BatchServiceConfig,
}
# Read outside the config dataclasses: shared/engine/loader.py and shared/logs.py.
PROCESS_SETTINGS = {"TANDEM_CACHE_DIR", "TANDEM_LOG_FORMAT", "TANDEM_LOG_LEVEL"}
PREPARE_SETTINGS = {"TANDEM_MODEL"}  # services/commands/prepare.py
DUMMY_POD_IP = "10.1.2.3"
GATEWAY_RPC = "tcp://tandem-gateway:8001"  # the gateway Service's RPC port (gateway.yaml)
BATCH_SERVICE = "tcp://tandem-batch:5700"  # the batch Service (batch.yaml)
DUMMY_SECRETS = {
    ("tandem-api-keys", "api-keys"): "0123456789abcdef0123=team-a,fedcba9876543210fedc",
    ("tandem-api-keys", "batch-api-key"): "fedcba9876543210fedc",  # the bare key above
}
# Whole Secrets read with envFrom: a valid CurveZMQ secret key, so the settings validate.
DUMMY_SECRET_ENVS = {
    "tandem-curve": {"TANDEM_CURVE_SECRET_KEY": zmq.curve_keypair()[1].decode()},
}
WILDCARD_HOSTS = ("0.0.0.0", "::")
# After the gateway's grace and its streams' end (STREAM_END_S): the cluster link's close and the
# interpreter's exit, with room (tests/unit/test_gateway_shutdown.py allows a real one 5 s in all).
GATEWAY_EXIT_MARGIN_S = 4.0
# HPA -> (the role it scales, the Prometheus gauge it must be driven by).
HPA_METRICS = {
    "tandem-prefill": ("prefill", "tandem:num_requests_waiting"),
    "tandem-decode": ("decode", "tandem:kv_cache_usage_perc"),
}
EXPORTED = {
    role: {family.name for family in events(None).registry.collect()}
    for role, events in (("prefill", PrefillEvents), ("decode", DecodeEvents))
}

Manifests = dict[str, list[dict]]  # file name -> its resources


def load_manifests() -> Manifests:
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        for path in sorted(K8S.glob("*.yaml"))
    }


def resources(manifests: Manifests, kind: str | None = None):
    for filename, docs in manifests.items():
        for doc in docs:
            if filename != KUSTOMIZATION and kind in (None, doc["kind"]):
                yield filename, doc


def by_name(manifests: Manifests, kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, doc in resources(manifests, kind)}


# -- the API's schemas ----------------------------------------------------------------------------


def schema_problems(manifests: Manifests, version: str) -> list[str]:
    problems = []
    for filename, doc in resources(manifests):
        where = f"{filename}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            problems.append(f"{where}: {path}: {error.message} (Kubernetes {error.version})")
        except kubernetes_validate.SchemaNotFoundError as error:
            problems.append(f"{where}: {error.message}")
    return problems


# -- containers: settings, probes, addresses ------------------------------------------------------


def container_problems(manifests: Manifests) -> list[str]:
    configmaps = {
        name: doc.get("data", {}) for name, doc in by_name(manifests, "ConfigMap").items()
    }
    schedulers = scheduler_addresses(manifests)
    problems = []
    models = {}  # the scheduler refuses workers of another model
    workloads = [*resources(manifests, "Deployment"), *resources(manifests, "StatefulSet")]
    for filename, deployment in workloads:
        pod = deployment["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            where = f"{filename}: container {container['name']}"
            found, config = check_container(container, configmaps, schedulers)
            problems += [f"{where}: {problem}" for problem in found]
            if config is not None and hasattr(config, "model"):
                models[where] = config.model
            if isinstance(config, GatewayConfig):
                problems += [f"{where}: {p}" for p in shutdown_problems(pod, container, config)]
            if config is not None and container in pod["containers"]:
                annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
                problems += [f"{filename}: {p}" for p in scrape_problems(annotations, config)]
    if len(set(models.values())) > 1:
        problems.append(f"the roles name different models: {models}")
    return problems


def check_container(container: dict, configmaps: dict, schedulers: set[str]):
    """The container's problems, and its role's config when its settings build one."""
    command = container.get("command", []) + container.get("args", [])
    role = command[1] if command[:1] == ["tandem"] and len(command) > 1 else None
    if role not in (*CONFIGS, "prepare"):
        return [f"runs {command}, not `tandem <role>`"], None
    environ, problems = container_environ(container, configmaps)
    known = PREPARE_SETTINGS if role == "prepare" else setting_names(CONFIGS[role])
    for name in sorted(n for n in environ if n.startswith("TANDEM_")):
        if name not in known | PROCESS_SETTINGS:
            owner = "tandem prepare" if role == "prepare" else CONFIGS[role].__name__
            problems.append(f"{name} is not a setting of {owner}")
    if role == "prepare":
        return problems, None
    try:
        config = config_from_args(CONFIGS[role], environ=environ)
    except ConfigError as error:
        return [*problems, f"the {role} refuses its settings: {error}"], None
    problems += probe_problems(role, container, config)
    return problems + address_problems(role, config, schedulers), config


def setting_names(cls: type) -> set[str]:
    return {env_name(field.name) for field in dataclasses.fields(cls)}


def container_environ(container: dict, configmaps: dict) -> tuple[dict[str, str], list[str]]:
    """The environment Kubernetes would give the container: envFrom, then env in order, with
    `$(NAME)` expanded from what came before."""
    environ: dict[str, str] = {}
    problems = []
    for source in container.get("envFrom", []):
        if "secretRef" in source:  # a Secret's keys are its variables: test them with dummies
            secret = source["secretRef"]["name"]
            if secret not in DUMMY_SECRET_ENVS:
                problems.append(f"envFrom names Secret {secret!r}, which has no dummy here")
            environ.update(DUMMY_SECRET_ENVS.get(secret, {}))
            continue
        name = source.get("configMapRef", {}).get("name")
        if name not in configmaps:
            problems.append(f"envFrom names ConfigMap {name!r}, which no manifest defines")
            continue
        environ.update(configmaps[name])
    for var in container.get("env", []):
        value, problem = env_value(var, configmaps)
        if problem:
            problems.append(f"{var['name']}: {problem}")
            continue
        value = re.sub(r"\$\((\w+)\)", lambda m: environ.get(m[1], m[0]), value)
        if "$(" in value:
            problems.append(f"{var['name']}={value!r} refers to a variable not set before it")
        environ[var["name"]] = value
    return environ, problems


def env_value(var: dict, configmaps: dict) -> tuple[str, str | None]:
    source = var.get("valueFrom")
    if source is None:
        return str(var.get("value", "")), None
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        if ref["key"] not in configmaps.get(ref["name"], {}):
            return "", f"ConfigMap {ref['name']!r} has no key {ref['key']!r}"
        return configmaps[ref["name"]][ref["key"]], None
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        if (ref["name"], ref["key"]) not in DUMMY_SECRETS:
            return "", f"Secret {ref['name']}/{ref['key']} has no dummy value in this test"
        return DUMMY_SECRETS[ref["name"], ref["key"]], None
    if source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
        return DUMMY_POD_IP, None
    return "", f"unsupported valueFrom {source}"


def probe_problems(role: str, container: dict, config) -> list[str]:
    """Liveness on /health and readiness on /health (/ready for the gateway), on the port the
    service serves them at: the gateway's HTTP port, the others' metrics port."""
    if role == "gateway":
        host, port, paths = config.host, config.port, {"livenessProbe": "/health"}
        paths["readinessProbe"] = "/ready"
    else:
        host, port = config.metrics_host, config.metrics_port
        paths = {"livenessProbe": "/health", "readinessProbe": "/health"}
    problems = []
    if not port:
        problems.append("serves /health on no fixed port (set TANDEM_METRICS_PORT)")
    if host not in WILDCARD_HOSTS:
        problems.append(f"binds its health port to {host}, which the kubelet cannot reach")
    if "startupProbe" in container:
        paths["startupProbe"] = "/health"
    for kind, path in paths.items():
        get = container.get(kind, {}).get("httpGet")
        if get is None:
            problems.append(f"has no {kind} (an httpGet on {path}, port {port})")
            continue
        asked = (get.get("path"), container_port(container, get.get("port")))
        if asked != (path, port):
            problems.append(
                f"{kind} asks {asked[0]} on port {asked[1]}; the {role} answers {path} on {port}"
            )
    return problems


def shutdown_problems(pod: dict, container: dict, config: GatewayConfig) -> list[str]:
    """The kubelet runs the preStop hook, then sends SIGTERM, then SIGKILL at
    terminationGracePeriodSeconds after the pod's deletion, the hook's time included. The
    gateway's preStop sleep keeps it serving while the endpoints controller and every node's
    proxy drop the pod (uvicorn closes its listening socket and keep-alive connections at
    SIGTERM: no probe can tell a load balancer it is leaving); then its grace and its exit."""
    problems = []
    pre_stop_s = pre_stop_sleep_s(container)
    if pre_stop_s is None:
        problems.append("has no preStop sleep, so it closes its socket while still an endpoint")
    if "terminationGracePeriodSeconds" not in pod:
        problems.append("its pod sets no terminationGracePeriodSeconds (Kubernetes' 30 s, unsaid)")
    killed_at = pod.get("terminationGracePeriodSeconds", 30)
    grace_s = config.shutdown_grace_s
    needed_s = (pre_stop_s or 0) + grace_s + STREAM_END_S + GATEWAY_EXIT_MARGIN_S
    if needed_s > killed_at:
        problems.append(
            f"needs {needed_s:g} s to stop (preStop {pre_stop_s or 0:g} s, shutdown_grace_s "
            f"{grace_s:g} s, {STREAM_END_S + GATEWAY_EXIT_MARGIN_S:g} s to exit), more than its "
            f"pod's terminationGracePeriodSeconds {killed_at}"
        )
    return problems


def pre_stop_sleep_s(container: dict) -> float | None:
    """How long the container's preStop hook sleeps (`exec: sleep N` or the `sleep` action)."""
    hook = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook.get("exec", {}).get("command", [])
    if len(command) == 2 and command[0] == "sleep":
        try:
            return float(command[1])
        except ValueError:
            return None
    return None


def scrape_problems(annotations: dict, config) -> list[str]:
    """The pod's prometheus.io annotations point at its /metrics: the gateway's HTTP port, the
    others' metrics port (the adapter rules behind the HPAs read what they scrape)."""
    port = config.port if isinstance(config, GatewayConfig) else config.metrics_port
    wanted = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port)}
    wanted["prometheus.io/path"] = "/metrics"
    return [
        f"annotation {key} is {annotations.get(key)!r}, not {value!r}"
        for key, value in wanted.items()
        if annotations.get(key) != value
    ]


def container_port(container: dict, port: int | str | None) -> int | None:
    if isinstance(port, int):
        return port
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    return named.get(port)


def address_problems(role: str, config, schedulers: set[str]) -> list[str]:
    problems = []
    if role in ("gateway", "prefill", "decode") and config.scheduler_address not in schedulers:
        problems.append(
            f"TANDEM_SCHEDULER_ADDRESS is {config.scheduler_address}, not the scheduler "
            f"Service ({', '.join(sorted(schedulers)) or 'none defined'})"
        )
    if role == "batch-service" and config.gateway_rpc_address != GATEWAY_RPC:
        problems.append(
            f"TANDEM_GATEWAY_RPC_ADDRESS is {config.gateway_rpc_address}: lines must go to the "
            f"gateway Service's RPC port, {GATEWAY_RPC}"
        )
    if role == "gateway" and config.batch_address != BATCH_SERVICE:
        problems.append(
            f"TANDEM_BATCH_ADDRESS is {config.batch_address}, not the batch Service "
            f"({BATCH_SERVICE})"
        )
    if role == "decode" and config.address is None:
        problems.append("a decode worker needs TANDEM_ADDRESS (its KV socket)")
    advertised = {  # role -> (bound, advertised): the gateway's token stream, decode's KV socket
        "gateway": ("stream_address", "advertise_stream_address"),
        "decode": ("address", "advertise_address"),
    }
    if role in advertised:
        bound, name = advertised[role]
        host, _, port = (getattr(config, name) or "").removeprefix("tcp://").rpartition(":")
        bound_port = (getattr(config, bound) or "").rpartition(":")[2]
        if host in ("", *WILDCARD_HOSTS, "127.0.0.1", "localhost"):
            problems.append(f"{env_name(name)} is {getattr(config, name)!r}: pods cannot reach it")
        elif port != bound_port:
            problems.append(
                f"{env_name(name)} is on port {port}, {env_name(bound)} on {bound_port}"
            )
    return problems


def scheduler_addresses(manifests: Manifests) -> set[str]:
    """tcp://<service>:<port> for every Service port in front of the scheduler's pods."""
    return {
        f"tcp://{name}:{port['port']}"
        for name, service in by_name(manifests, "Service").items()
        if service["spec"].get("selector", {}).get("app.kubernetes.io/component") == "scheduler"
        for port in service["spec"]["ports"]
    }


# -- autoscaling ----------------------------------------------------------------------------------


def adapter_rules(manifests: Manifests) -> dict[str, str]:
    """Custom metric name -> the Prometheus series the adapter rule serves it from."""
    (configmap,) = manifests[ADAPTER_RULES]
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    return {
        rule["name"]["as"]: rule["name"]["matches"].removeprefix("^").removesuffix("$")
        for rule in config["rules"]
    }


def hpa_problems(manifests: Manifests) -> list[str]:
    hpas = by_name(manifests, "HorizontalPodAutoscaler")
    deployments = by_name(manifests, "Deployment")
    rules = adapter_rules(manifests)
    problems = []
    for name, (role, series) in HPA_METRICS.items():
        if name not in hpas:
            problems.append(f"no HorizontalPodAutoscaler {name} for the {role} workers")
            continue
        spec = hpas[name]["spec"]
        target = spec["scaleTargetRef"]
        deployment = deployments.get(target["name"])
        labels = (deployment or {}).get("metadata", {}).get("labels", {})
        minimum = spec.get("minReplicas", 1)
        if target["kind"] != "Deployment" or labels.get("app.kubernetes.io/component") != role:
            problems.append(f"HPA {name} scales {target['kind']}/{target['name']}, not {role}")
        elif deployment["spec"].get("replicas", minimum) != minimum:  # absent: the HPA's count
            problems.append(
                f"HPA {name}: minReplicas {minimum} differs from Deployment "
                f"{target['name']}'s replicas {deployment['spec']['replicas']}"
            )
        metrics = [m["pods"]["metric"]["name"] for m in spec["metrics"] if m["type"] == "Pods"]
        if len(metrics) != len(spec["metrics"]) or len(metrics) != 1:
            problems.append(f"HPA {name} should have one metric, of type Pods")
            continue
        served = rules.get(metrics[0])
        if served is None:
            problems.append(f"HPA {name} uses {metrics[0]}, which no adapter rule serves")
        elif served != series:
            problems.append(f"HPA {name} is driven by {served}, not {series}")
        elif series not in EXPORTED[role]:
            problems.append(f"the {role} workers do not export {series}")
    return problems


# -- kustomization --------------------------------------------------------------------------------


def kustomization_problems(manifests: Manifests) -> list[str]:
    (kustomization,) = manifests[KUSTOMIZATION]
    listed = set(kustomization.get("resources", []))
    present = set(manifests) - {KUSTOMIZATION, ADAPTER_RULES}
    problems = [f"{KUSTOMIZATION} does not list {name}" for name in sorted(present - listed)]
    problems += [f"{KUSTOMIZATION} lists {name}, which is missing" for name in listed - present]
    for filename, doc in resources(manifests):
        namespace = doc["metadata"].get("namespace")
        if filename in listed and doc["kind"] != "Namespace" and namespace != "tandem":
            problems.append(f"{filename}: {doc['kind']}/{doc['metadata']['name']} not in tandem")
    return problems


def all_problems(manifests: Manifests) -> list[str]:
    return [
        *schema_problems(manifests, KUBERNETES_VERSIONS[0]),
        *container_problems(manifests),
        *hpa_problems(manifests),
        *kustomization_problems(manifests),
    ]


# -- the tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifests() -> Manifests:
    return load_manifests()


def test_the_manifests_are_there(manifests):
    kinds = sorted(doc["kind"] for _, doc in resources(manifests))
    assert kinds.count("Deployment") == 4 and kinds.count("HorizontalPodAutoscaler") == 2
    assert kinds.count("StatefulSet") == 1  # the batch service, on its PersistentVolume
    assert set(by_name(manifests, "Service")) == {
        "tandem-gateway", "tandem-scheduler", "tandem-batch"
    }  # fmt: skip


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_resource_validates_against_the_api_schemas(manifests, version):
    assert schema_problems(manifests, version) == []


def test_containers_have_valid_settings_probes_and_addresses(manifests):
    assert container_problems(manifests) == []


def test_hpas_scale_prefill_and_decode_on_their_own_load(manifests):
    assert hpa_problems(manifests) == []


def test_the_kustomization_lists_every_manifest(manifests):
    assert kustomization_problems(manifests) == []


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not found")
def test_the_kustomization_builds_what_the_files_hold(manifests):
    docs = kustomize_build(K8S)
    assert len(docs) == sum(1 for name, _ in resources(manifests) if name != ADAPTER_RULES)
    assert schema_problems({"built.yaml": docs}, KUBERNETES_VERSIONS[-1]) == []


def kustomize_build(directory: Path) -> list[dict]:
    built = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(built) if doc]


WORKERS = ("tandem-prefill", "tandem-decode")


def as_on_gpus(doc: dict) -> dict:
    """What compose/k8s-gpu should make of a base resource: the workers' ConfigMaps name the
    GPU, their pods run the CUDA image, and each worker container asks for one GPU."""
    doc = copy.deepcopy(doc)
    name = doc["metadata"]["name"]
    if doc["kind"] == "ConfigMap" and name in WORKERS:
        doc["data"]["TANDEM_DEVICE"] = "cuda"
    if doc["kind"] == "Deployment" and name in WORKERS:
        pod = doc["spec"]["template"]["spec"]
        for container in pod["initContainers"] + pod["containers"]:
            container["image"] = "tandem:cuda"
        pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 1
    return doc


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not found")
def test_the_gpu_overlay_changes_only_the_workers_device_image_and_gpu():
    base = kustomize_build(K8S)
    on_gpus = kustomize_build(K8S.parent / "k8s-gpu")
    assert on_gpus == [as_on_gpus(doc) for doc in base]
    assert on_gpus != base
    assert schema_problems({"k8s-gpu": on_gpus}, KUBERNETES_VERSIONS[-1]) == []


def _container(manifests: Manifests, filename: str, index: int = 0) -> dict:
    return manifests[filename][index]["spec"]["template"]["spec"]["containers"][0]


def _configmap(manifests: Manifests, name: str) -> dict:
    return by_name(manifests, "ConfigMap")[name]["data"]


def _hpa(manifests: Manifests, name: str) -> dict:
    return by_name(manifests, "HorizontalPodAutoscaler")[name]["spec"]


def _rename_key(data: dict, old: str, new: str) -> None:
    data[new] = data.pop(old)


MUTATIONS = {
    "unknown setting": (
        lambda m: _rename_key(
            _configmap(m, "tandem-decode"), "TANDEM_KV_CACHE_BYTES", "TANDEM_KV_CACHE_BYTE"
        ),
        "decode.yaml: container decode: TANDEM_KV_CACHE_BYTE is not a setting of WorkerConfig",
    ),
    "bad value": (
        lambda m: _configmap(m, "tandem-prefill").update(TANDEM_METRICS_PORT="91OO"),
        "the prefill refuses its settings: TANDEM_METRICS_PORT: expected an integer, got '91OO'",
    ),
    "missing probe": (
        lambda m: _container(m, "gateway.yaml").pop("readinessProbe"),
        "gateway.yaml: container gateway: has no readinessProbe (an httpGet on /ready, port 8000)",
    ),
    "probe on the wrong port": (
        lambda m: _container(m, "prefill.yaml")["livenessProbe"]["httpGet"].update(port=8080),
        "livenessProbe asks /health on port 8080; the prefill answers /health on 9100",
    ),
    "health bound to loopback": (
        lambda m: _configmap(m, "tandem-scheduler").update(TANDEM_METRICS_HOST="127.0.0.1"),
        "binds its health port to 127.0.0.1, which the kubelet cannot reach",
    ),
    "unresolved pod IP": (
        lambda m: _container(m, "decode.yaml")["env"].pop(0),
        "TANDEM_ADVERTISE_ADDRESS='tcp://$(POD_IP):5601' refers to a variable not set before it",
    ),
    "another model": (
        lambda m: _container(m, "decode.yaml")["env"].append(
            {"name": "TANDEM_MODEL", "value": "/models/llama"}
        ),
        "the roles name different models",
    ),
    "wrong scheduler address": (
        lambda m: _configmap(m, "tandem-gateway").update(
            TANDEM_SCHEDULER_ADDRESS="tcp://scheduler:5555"
        ),
        "TANDEM_SCHEDULER_ADDRESS is tcp://scheduler:5555, not the scheduler Service",
    ),
    "advertised port not bound": (
        lambda m: _container(m, "decode.yaml")["env"][1].update(value="tcp://$(POD_IP):5602"),
        "TANDEM_ADVERTISE_ADDRESS is on port 5602, TANDEM_ADDRESS on 5601",
    ),
    "HPA metric without a rule": (
        lambda m: _hpa(m, "tandem-decode")["metrics"][0]["pods"]["metric"].update(name="kv"),
        "HPA tandem-decode uses kv, which no adapter rule serves",
    ),
    "HPA on the wrong Deployment": (
        lambda m: _hpa(m, "tandem-prefill")["scaleTargetRef"].update(name="tandem-decode"),
        "HPA tandem-prefill scales Deployment/tandem-decode, not prefill",
    ),
    "unknown field": (
        lambda m: m["decode.yaml"][0]["spec"].update(replica=3),
        "decode.yaml: Deployment/tandem-decode: spec: Additional properties are not allowed "
        "('replica' was unexpected)",
    ),
    "batch lines sent to the HTTP port": (
        lambda m: _configmap(m, "tandem-batch").update(
            TANDEM_GATEWAY_RPC_ADDRESS="tcp://tandem-gateway:8000"
        ),
        "TANDEM_GATEWAY_RPC_ADDRESS is tcp://tandem-gateway:8000: lines must go to",
    ),
    "gateway not forwarding to the batch service": (
        lambda m: _configmap(m, "tandem-gateway").pop("TANDEM_BATCH_ADDRESS"),
        "TANDEM_BATCH_ADDRESS is None, not the batch Service",
    ),
    "scraped on another port": (
        lambda m: m["decode.yaml"][0]["spec"]["template"]["metadata"]["annotations"].update(
            {"prometheus.io/port": "8000"}
        ),
        "decode.yaml: annotation prometheus.io/port is '8000', not '9100'",
    ),
    "gateway grace past the kill": (
        lambda m: _configmap(m, "tandem-gateway").update(TANDEM_SHUTDOWN_GRACE_S="30"),
        "gateway.yaml: container gateway: needs 40 s to stop (preStop 5 s, shutdown_grace_s 30 s,",
    ),
    "gateway pod killed at once": (
        lambda m: m["gateway.yaml"][0]["spec"]["template"]["spec"].update(
            terminationGracePeriodSeconds=5
        ),
        "more than its pod's terminationGracePeriodSeconds 5",
    ),
    "gateway grace period unsaid": (
        lambda m: m["gateway.yaml"][0]["spec"]["template"]["spec"].pop(
            "terminationGracePeriodSeconds"
        ),
        "its pod sets no terminationGracePeriodSeconds",
    ),
    "gateway without its preStop sleep": (
        lambda m: _container(m, "gateway.yaml").pop("lifecycle"),
        "has no preStop sleep, so it closes its socket while still an endpoint",
    ),
    "file not listed": (
        lambda m: m[KUSTOMIZATION][0]["resources"].remove("hpa.yaml"),
        "kustomization.yaml does not list hpa.yaml",
    ),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_mutated_manifest_is_reported(manifests, mutation):
    mutate, expected = MUTATIONS[mutation]
    mutated = copy.deepcopy(manifests)
    mutate(mutated)
    problems = all_problems(mutated)
    assert any(expected in problem for problem in problems), problems


def test_every_role_reads_the_curvezmq_secret(manifests):
    for name, deployment in by_name(manifests, "Deployment").items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        refs = [s["secretRef"] for s in container.get("envFrom", []) if "secretRef" in s]
        assert {"name": "tandem-curve", "optional": True} in refs, name


def worker_context_problems(manifests: Manifests) -> list[str]:
    """A worker's KV cache must hold the model's whole context at float32, what TANDEM_DTYPE
    `auto` runs on a CPU without bfloat16 arithmetic: the scheduler admits a prompt that fits a
    decode worker, and a prefill worker whose pool is smaller then refuses it for good."""
    configmaps = {
        name: doc.get("data", {}) for name, doc in by_name(manifests, "ConfigMap").items()
    }
    problems = []
    for filename, deployment in resources(manifests, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            if container["command"][1:] not in (["prefill"], ["decode"]):
                continue
            environ, _ = container_environ(container, configmaps)
            config = config_from_args(WorkerConfig, environ={**environ, "TANDEM_DTYPE": "float32"})
            directory, _ = resolve_model_dir(config.model)
            model = ModelConfig.from_hf(AutoConfig.from_pretrained(directory))
            blocks = num_blocks_for_budget(
                model, config.block_size, torch.float32, config.kv_cache_bytes
            )
            if blocks * config.block_size < model.context_len:
                problems.append(
                    f"{filename}: {container['name']}'s KV cache holds "
                    f"{blocks * config.block_size} tokens at float32, less than the model's "
                    f"context of {model.context_len}"
                )
    return problems


def test_every_worker_holds_the_models_whole_context(manifests):
    assert worker_context_problems(manifests) == []
