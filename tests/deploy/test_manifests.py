"""deploy/: every Kubernetes manifest against its vendored JSON schema (strict: unknown fields
fail), the manifests against each other and against the worker's real settings, the compose
file's structure, and the Dockerfiles' shape. Nothing here needs Docker or a cluster."""

from __future__ import annotations

import argparse
import base64
import copy
import dataclasses
import json
import os
import re
import tomllib
from pathlib import Path

import dockerfile
import jsonschema
import pytest
import yaml
from pydantic import BaseModel
from referencing import Registry, Resource

from loadtest.loadgen import add_arguments
from worker.service.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMAS = DEPLOY / "schemas"
K8S_SCHEMAS = SCHEMAS / "kubernetes" / "v1.31.0-strict"
PREFIX = "MINI_INFER_"
# MINI_INFER_* variables that are not worker settings (read by engine.loader).
NON_SETTINGS_ENV = {"MINI_INFER_CACHE_DIR"}


def load_manifests() -> dict[str, dict]:
    """kind -> document, over every manifest file (one document each)."""
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in docs, f"two {doc['kind']} documents"
            docs[doc["kind"]] = doc
    return docs


MANIFESTS = load_manifests()


def schema_file(doc: dict) -> Path:
    """kubernetes-validate's file naming: `<kind>-<group>-<version>.json`, core group omitted."""
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", doc["apiVersion"])
    name = f"{doc['kind'].lower()}-{group_version}.json"
    return (SCHEMAS / "keda" if doc["apiVersion"].startswith("keda.sh/") else K8S_SCHEMAS) / name


def validator_for(doc: dict) -> jsonschema.Validator:
    schema = json.loads(schema_file(doc).read_text())
    definitions = json.loads((K8S_SCHEMAS / "_definitions.json").read_text())
    registry = Registry().with_resources(
        [(definitions["$id"], Resource.from_contents(definitions))]
    )
    return jsonschema.Draft202012Validator(schema, registry=registry)


def errors_of(doc: dict) -> list[str]:
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator_for(doc).iter_errors(doc)
    ]


# --- schema validation ------------------------------------------------------------------------


def test_the_kinds_the_issue_asks_for_are_there() -> None:
    assert set(MANIFESTS) == {
        "ConfigMap", "Secret", "Deployment", "PodDisruptionBudget", "ScaledObject",
        "TriggerAuthentication",
    }  # fmt: skip


@pytest.mark.parametrize("kind", sorted(MANIFESTS))
def test_manifest_matches_its_schema(kind: str) -> None:
    assert errors_of(MANIFESTS[kind]) == []


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        ("Deployment", ["spec", "template", "spec", "containers", 0, "livenessProbes"], {}),
        ("Deployment", ["spec", "replicas"], "two"),
        ("PodDisruptionBudget", ["spec", "maxUnavailable"], [1]),
        ("ConfigMap", ["data", "MINI_INFER_KAFKA__NUM_PARTITIONS"], 12),  # must be a string
        ("ScaledObject", ["spec", "triggers", 0, "metadata", "lagThreshold"], 32),
        ("ScaledObject", ["spec", "maxReplicas"], 12),
        ("TriggerAuthentication", ["spec", "secretTargetRef", 0, "secret"], "x"),
    ],
)
def test_the_schemas_reject_mistakes(kind: str, path: list, value) -> None:
    """The vendored schemas are strict: a misspelt field or a wrong type fails."""
    doc = copy.deepcopy(MANIFESTS[kind])
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert errors_of(doc)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


# --- the manifests against the worker's settings ----------------------------------------------


def _field_types(model) -> dict[str, object]:
    if isinstance(model, type) and issubclass(model, BaseModel):
        return {name: f.annotation for name, f in model.model_fields.items()}
    if dataclasses.is_dataclass(model):
        return {f.name: f.type for f in dataclasses.fields(model)}
    return {}


def is_setting(env_name: str) -> bool:
    """Does `MINI_INFER_A__B` name a field of WorkerSettings (group `a`, field `b`)?"""
    model: object = WorkerSettings
    for part in env_name.removeprefix(PREFIX).lower().split("__"):
        fields = _field_types(model)
        if part not in fields:
            return False
        model = fields[part]  # a group's class; a leaf's type, which has no fields
    return True


def worker_env() -> dict[str, str]:
    """What the worker container sees: the ConfigMap, the Secret, and the Deployment's `env`
    (a fieldRef stands in as a pod name)."""
    container = MANIFESTS["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    env = dict(MANIFESTS["ConfigMap"]["data"])
    env.update(MANIFESTS["Secret"]["stringData"])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", "mini-infer-worker-5d8f7c9b4-x2k8q")
    return env


@pytest.fixture(name="settings")
def settings_fixture(monkeypatch) -> WorkerSettings:
    """WorkerSettings as the worker would build them from the manifests' environment."""
    for name in list(os.environ):
        if name.upper().startswith(PREFIX):
            monkeypatch.delenv(name)
    for name, value in worker_env().items():
        if name.startswith(PREFIX):
            monkeypatch.setenv(name, value)
    return WorkerSettings()


def test_every_mini_infer_variable_is_a_real_setting() -> None:
    unknown = [
        name
        for name in worker_env()
        if name.startswith(PREFIX) and name not in NON_SETTINGS_ENV and not is_setting(name)
    ]
    assert unknown == []
    assert not is_setting("MINI_INFER_KAFKA__BOOTSTRAP_SERVER")  # the check can fail


def test_settings_from_the_manifests_validate(settings: WorkerSettings) -> None:
    assert settings.kafka.security_protocol == "SASL_SSL"
    assert settings.kafka.sasl_username and settings.kafka.sasl_password is not None
    assert settings.worker_id is not None


def _container() -> dict:
    return MANIFESTS["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def _probe_port(probe: dict, container: dict) -> int:
    port = probe["httpGet"]["port"]
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def test_probes_hit_the_health_endpoints_on_the_health_port(settings: WorkerSettings) -> None:
    container = _container()
    assert settings.observability.health_port is not None
    worker_source = "\n".join(p.read_text() for p in (ROOT / "worker").rglob("*.py"))
    for probe_name, path in (
        ("livenessProbe", "/healthz"),
        ("startupProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        probe = container[probe_name]
        assert probe["httpGet"]["path"] == path
        assert _probe_port(probe, container) == settings.observability.health_port
        assert f'"{path}"' in worker_source, f"the worker serves no {path}"
    annotations = MANIFESTS["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == settings.observability.health_port


def test_grace_period_covers_the_workers_drain(settings: WorkerSettings) -> None:
    """The kubelet kills at terminationGracePeriodSeconds; the worker needs its drain grace,
    then up to the consumer's stop timeout to commit and leave the group."""
    pod = MANIFESTS["Deployment"]["spec"]["template"]["spec"]
    needed_s = settings.shutdown_grace_s + settings.kafka.consumer_stop_timeout_s
    assert pod["terminationGracePeriodSeconds"] >= needed_s
    default = WorkerSettings.model_fields["shutdown_grace_s"].default
    assert settings.shutdown_grace_s == default  # the ConfigMap restates the default


def test_resources_and_threads(settings: WorkerSettings) -> None:
    resources = _container()["resources"]
    assert resources["requests"] == resources["limits"]  # Guaranteed QoS
    assert settings.engine.num_threads == int(resources["limits"]["cpu"])
    memory_gib = float(resources["limits"]["memory"].removesuffix("Gi"))
    assert settings.engine.kv_cache_memory_bytes < memory_gib * (1 << 30) / 2


def test_pod_runs_as_the_images_non_root_user() -> None:
    pod = MANIFESTS["Deployment"]["spec"]["template"]["spec"]
    user = re.search(r"^USER (\d+)", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == int(user.group(1)) != 0


def test_references_between_manifests_resolve(settings: WorkerSettings) -> None:
    deployment, pdb = MANIFESTS["Deployment"], MANIFESTS["PodDisruptionBudget"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    sources = _container()["envFrom"]
    assert {s["configMapRef"]["name"] for s in sources if "configMapRef" in s} == {
        MANIFESTS["ConfigMap"]["metadata"]["name"]
    }
    assert {s["secretRef"]["name"] for s in sources if "secretRef" in s} == {
        MANIFESTS["Secret"]["metadata"]["name"]
    }
    secret = MANIFESTS["Secret"]
    for ref in MANIFESTS["TriggerAuthentication"]["spec"]["secretTargetRef"]:
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]


def test_keda_scales_the_worker_group_within_the_partitions(settings: WorkerSettings) -> None:
    spec = MANIFESTS["ScaledObject"]["spec"]
    assert spec["scaleTargetRef"]["name"] == MANIFESTS["Deployment"]["metadata"]["name"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "kafka"
    meta = trigger["metadata"]
    assert meta["consumerGroup"] == settings.kafka.group_id
    # No topic: KEDA sums the lag of every topic the group consumes, i.e. of all urgency lanes.
    assert "topic" not in meta and len(settings.kafka.request_topics) == 3
    assert meta["bootstrapServers"] == settings.kafka.bootstrap_servers
    assert meta["allowIdleConsumers"] == "false"
    # Replicas beyond the partition count would idle.
    assert spec["minReplicaCount"] <= spec["maxReplicaCount"] <= settings.kafka.num_partitions
    assert (
        trigger["authenticationRef"]["name"]
        == (MANIFESTS["TriggerAuthentication"]["metadata"]["name"])
    )


# --- compose ----------------------------------------------------------------------------------

COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
WORKERS = ("worker-1", "worker-2")


def test_compose_matches_the_compose_specification() -> None:
    schema = json.loads((SCHEMAS / "compose" / "compose-spec.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    assert [e.message for e in validator.iter_errors(COMPOSE)] == []
    broken = copy.deepcopy(COMPOSE)
    broken["services"]["kafka"]["healthchek"] = broken["services"]["kafka"].pop("healthcheck")
    assert list(validator.iter_errors(broken))  # the schema catches a misspelt key


def test_compose_services() -> None:
    assert set(SERVICES) == {
        "kafka", "topics", "worker-1", "worker-2", "loadgen", "otel-collector", "prometheus",
    }  # fmt: skip


def test_compose_kafka_is_kraft_on_the_official_image() -> None:
    kafka = SERVICES["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    env = kafka["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    node_id = env["KAFKA_NODE_ID"]
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{node_id}@kafka:9093"
    assert "CONTROLLER" in env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    assert not any("ZOOKEEPER" in name for name in env)
    padded = env["CLUSTER_ID"] + "=" * (-len(env["CLUSTER_ID"]) % 4)
    assert len(base64.urlsafe_b64decode(padded)) == 16  # what KRaft requires of a cluster id
    assert "test" in kafka["healthcheck"]


def test_compose_topics_job_creates_the_workers_topics() -> None:
    topics = SERVICES["topics"]
    assert topics["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert topics["restart"] == "no"
    script = "\n".join(topics["command"])
    defaults = WorkerSettings.model_fields["kafka"].default_factory()
    for name in (defaults.request_topic, defaults.control_topic, defaults.dlq_topic):
        assert f"{name}:" in script


def test_compose_workers() -> None:
    for name in WORKERS:
        worker = SERVICES[name]
        env = worker["environment"]
        assert env["MINI_INFER_KAFKA__BOOTSTRAP_SERVERS"] == "kafka:9092"
        assert all(is_setting(k) for k in env if k.startswith(PREFIX))
        port = env["MINI_INFER_OBSERVABILITY__HEALTH_PORT"]
        assert f"127.0.0.1:{port}/readyz" in " ".join(worker["healthcheck"]["test"])
        assert worker["depends_on"]["topics"]["condition"] == "service_completed_successfully"
        grace_s = float(env["MINI_INFER_SHUTDOWN_GRACE_S"])
        assert int(worker["stop_grace_period"].removesuffix("s")) > grace_s
    ids = {SERVICES[n]["environment"]["MINI_INFER_WORKER_ID"] for n in WORKERS}
    assert len(ids) == len(WORKERS)


def test_compose_loadgen_is_a_one_shot_job_after_the_workers() -> None:
    loadgen = SERVICES["loadgen"]
    assert loadgen["restart"] == "no"
    assert loadgen["entrypoint"][:2] == ["mini-infer", "loadtest"]
    assert {n: d["condition"] for n, d in loadgen["depends_on"].items()} == {
        n: "service_healthy" for n in WORKERS
    }
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.parse_args(loadgen["entrypoint"][2:] + loadgen["command"])  # its flags exist


def _mounted_config(service: str) -> dict:
    (mount,) = [v for v in SERVICES[service]["volumes"] if v.startswith("./")]
    return yaml.safe_load((DEPLOY / mount.split(":")[0]).read_text())


def test_prometheus_scrapes_every_workers_metrics() -> None:
    config = _mounted_config("prometheus")
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "mini-infer-worker"]
    assert job["metrics_path"] == "/metrics"
    targets = {t for group in job["static_configs"] for t in group["targets"]}
    assert targets == {
        f"{n}:{SERVICES[n]['environment']['MINI_INFER_OBSERVABILITY__HEALTH_PORT']}"
        for n in WORKERS
    }


def test_otel_collector_pipelines_are_wired() -> None:
    config = _mounted_config("otel-collector")
    pipelines = config["service"]["pipelines"]
    assert {"metrics", "traces"} <= set(pipelines)
    for pipeline in pipelines.values():
        assert set(pipeline["receivers"]) <= set(config["receivers"])
        assert set(pipeline.get("processors", [])) <= set(config["processors"])
        assert set(pipeline["exporters"]) <= set(config["exporters"])
    assert "otlp" in config["receivers"]
    # The workers speak OTLP/HTTP (opentelemetry-exporter-otlp-proto-http).
    environment = SERVICES["worker-1"]["environment"]
    assert environment["MINI_INFER_OBSERVABILITY__TRACE_EXPORTER"] == "otlp"
    endpoint = environment["MINI_INFER_OBSERVABILITY__OTLP_ENDPOINT"]
    http = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert endpoint.rsplit(":", 1)[1] == http.rsplit(":", 1)[1]


# --- Dockerfiles ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_shape(name: str) -> None:
    """Parsed by BuildKit's own parser (the `dockerfile` package), so a syntax error fails too."""
    commands = dockerfile.parse_file(str(DEPLOY / name))
    by_cmd: dict[str, list] = {}
    for command in commands:
        by_cmd.setdefault(command.cmd.upper(), []).append(command)
    stages = [
        c.value[2] for c in by_cmd["FROM"] if len(c.value) == 3 and c.value[1].upper() == "AS"
    ]
    assert stages == ["build", "model", "runtime"]
    (user,) = by_cmd["USER"]
    assert int(user.value[0].split(":")[0]) != 0
    (healthcheck,) = by_cmd["HEALTHCHECK"]
    assert healthcheck.value[0] == "CMD" and "/healthz" in " ".join(healthcheck.value)
    assert [c.value for c in by_cmd["EXPOSE"]] == [("8080",)]
    env = {k: v for c in by_cmd["ENV"] for k, v in zip(c.value[::2], c.value[1::2], strict=True)}
    assert env["MINI_INFER_OBSERVABILITY__HEALTH_PORT"] == "8080"
    assert by_cmd["ENTRYPOINT"][0].value == ("mini-infer",)
    assert by_cmd["STOPSIGNAL"][0].value == ("SIGTERM",)
    runs = " ".join(c.value[0] for c in by_cmd["RUN"])
    assert "mini-infer fetch-model" in runs and "BAKE_MODEL" in runs
    # torch as pyproject.toml pins it.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (pin,) = [d for d in project["optional-dependencies"]["serve"] if d.startswith("torch==")]
    args = dict(c.value[0].split("=", 1) for c in by_cmd["ARG"] if "=" in c.value[0])
    assert args["TORCH_VERSION"] == pin.removeprefix("torch==")
    for copy_command in by_cmd["COPY"]:
        if not any(flag.startswith("--from=") for flag in copy_command.flags):
            for source in copy_command.value[:-1]:
                assert (ROOT / source).exists(), source
