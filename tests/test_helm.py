"""deploy/helm/plexrl, rendered by the real `helm template`: `helm lint` passes, kubeconform
accepts every manifest against the strict Kubernetes schemas of the pinned versions,
every PLEXRL_* name a container sets is a setting its service reads, and the chart keeps
what docs/deploy.md promises (schedulers and gateways several, the state-store several
only over an object store, GPU groups, probes, scraping, secrets).

Helm, kubeconform and the schemas come from scripts/helm.sh (.plexrl/bin,
.plexrl/kube-schemas). Without them the tests are skipped, except under CI=true, where
scripts/test.sh must have run it and their absence fails."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

from plexrl.settings import GatewaySettings, SchedulerSettings, StateStoreSettings, WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "plexrl"
FULL_VALUES = CHART / "ci" / "full-values.yaml"
HELM = Path(os.environ.get("PLEXRL_HELM", ROOT / ".plexrl" / "bin" / "helm"))
KUBECONFORM = Path(os.environ.get("PLEXRL_KUBECONFORM", ROOT / ".plexrl" / "bin" / "kubeconform"))
SCHEMAS = Path(os.environ.get("PLEXRL_KUBE_SCHEMAS", ROOT / ".plexrl" / "kube-schemas"))
# Keep in step with scripts/helm.sh (KUBE_VERSIONS) and Chart.yaml's kubeVersion.
KUBE_VERSIONS = ("1.29.0", "1.37.0")

# `plexrl serve <what>` → the settings class that process reads.
SETTINGS: dict[str, type[BaseSettings]] = {
    "gateway": GatewaySettings,
    "scheduler": SchedulerSettings,
    "gpu-worker": WorkerSettings,
    "state-store": StateStoreSettings,
}
# Names outside PLEXRL_* that a container may set, and who reads them.
FOREIGN_ENV = {
    "OTEL_SERVICE_NAME": "OpenTelemetry SDK",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "OpenTelemetry SDK",
    "HF_HOME": "huggingface_hub (the tokenizers' cache)",
    "POD_IP": "the chart (PLEXRL_SCHEDULER_ADVERTISE_URL is built from it)",
}
# The values every render needs (the chart refuses to render without a token and keys).
REQUIRED = ["--set", "secrets.serviceToken=test-token", "--set", "secrets.apiKeys=tml-test=t"]
CASES = {"defaults": REQUIRED, "full": ["-f", str(FULL_VALUES)]}


def _tool(path: Path, what: str) -> Path:
    if not path.exists():
        reason = f"{what} not found at {path}: run scripts/helm.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI must run it before pytest)")
        pytest.skip(reason)
    return path


@pytest.fixture(scope="module")
def helm() -> Path:
    return _tool(HELM, "helm")


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm), *args], capture_output=True, text=True, timeout=120, check=False
    )


def template(helm: Path, *args: str) -> str:
    result = run_helm(helm, "template", "plexrl", str(CHART), "--namespace", "plexrl", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def render(helm: Path, *args: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(template(helm, *args)) if doc]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> list[str]:
    return CASES[request.param]


@pytest.fixture(scope="module")
def manifests(helm: Path, case: list[str]) -> list[dict[str, Any]]:
    return render(helm, *case)


def env_names(settings: type[BaseSettings]) -> set[str]:
    prefix = str(settings.model_config.get("env_prefix", ""))
    return {(prefix + name).upper() for name in settings.model_fields}


def workloads(docs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield from (d for d in docs if d["kind"] in ("Deployment", "StatefulSet"))


def component(doc: dict[str, Any]) -> str:
    return str(doc["metadata"]["labels"]["app.kubernetes.io/component"])


def served(container: dict[str, Any]) -> str | None:
    command = container.get("command") or []
    return str(command[2]) if command[:2] == ["plexrl", "serve"] else None


def main_container(doc: dict[str, Any]) -> dict[str, Any]:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return dict(container)


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def find(docs: list[dict[str, Any]], kind: str, part: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and component(d) == part]
    return doc


def test_helm_lint_passes_strict(helm: Path, case: list[str]) -> None:
    result = run_helm(
        helm, "lint", "--strict", "--kube-version", KUBE_VERSIONS[0], str(CHART), *case
    )
    assert result.returncode == 0, result.stdout + result.stderr


def kubeconform(folder: Path, *args: str, stdin: str) -> subprocess.CompletedProcess[str]:
    """kubeconform over `stdin`, strict, against the schemas in `folder` alone (no URL)."""
    tool = _tool(KUBECONFORM, "kubeconform")
    location = f"{folder}/{{{{.ResourceKind}}}}{{{{.KindSuffix}}}}.json"
    return subprocess.run(
        [str(tool), "-strict", "-schema-location", location, *args, "-"],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_kubeconform_accepts_every_manifest_strictly(helm: Path, kube_version: str) -> None:
    folder = _tool(SCHEMAS / f"v{kube_version}-strict", f"Kubernetes {kube_version} schemas")
    # Both renders in one run (kubeconform compiles each kind's schema once a run), each
    # for that version (what .Capabilities and Chart.yaml's kubeVersion see).
    rendered = "\n---\n".join(
        template(helm, *args, "--kube-version", kube_version) for args in CASES.values()
    )
    result = kubeconform(folder, "-summary", "-output", "json", stdin=rendered)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout)["summary"]
    count = sum(1 for doc in yaml.safe_load_all(rendered) if doc)
    # Nothing skipped for want of a schema: every object was checked.
    assert summary == {"valid": count, "invalid": 0, "errors": 0, "skipped": 0}, summary


def test_kubeconform_refuses_an_unknown_field(helm: Path) -> None:
    """The schemas are strict: a misspelt field is an error, not ignored."""
    folder = _tool(SCHEMAS / f"v{KUBE_VERSIONS[0]}-strict", "schemas")
    bad = template(helm, *REQUIRED).replace("terminationGracePeriodSeconds:", "terminationGrace:")
    result = kubeconform(folder, stdin=bad)
    assert result.returncode != 0 and "terminationGrace" in result.stdout, result.stdout


def test_every_env_name_is_a_setting_its_service_reads(manifests: list[dict[str, Any]]) -> None:
    every = set().union(*(env_names(s) for s in SETTINGS.values()))
    checked = set()
    for doc in workloads(manifests):
        spec = doc["spec"]["template"]["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            what = served(container)
            allowed = env_names(SETTINGS[what]) if what else every
            names = set(env_of(container))
            unknown = {n for n in names if n.startswith("PLEXRL_")} - allowed
            assert not unknown, f"{doc['metadata']['name']}/{container['name']} sets {unknown}"
            foreign = {n for n in names if not n.startswith("PLEXRL_")} - set(FOREIGN_ENV)
            assert not foreign, f"{container['name']} sets {foreign}, which nothing here reads"
            if what:
                checked.add(what)
    assert checked == set(SETTINGS), checked


def test_settings_maps_become_plexrl_variables(helm: Path) -> None:
    docs = render(helm, *CASES["full"])
    scheduler = env_of(main_container(find(docs, "Deployment", "scheduler")))
    assert scheduler["PLEXRL_POLICY"]["value"] == "fifo"
    assert scheduler["PLEXRL_WORKER_TIMEOUT_S"]["value"] == "10"
    assert scheduler["PLEXRL_FAIR_SHARE"]["value"] == "false"
    worker = env_of(main_container(find(docs, "StatefulSet", "gpu-worker")))
    # Large byte counts stay integers (not 6.442450944e+10).
    assert worker["PLEXRL_WORKER_DEVICE_BYTES"]["value"] == "64424509440"
    assert worker["PLEXRL_WORKER_THREADS"]["value"] == "8"
    # Traces: the endpoint and the share of calls traced, on every service alike.
    for doc in workloads(docs):
        env = env_of(main_container(doc))
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"].endswith(":4318"), doc
        assert env["PLEXRL_TRACE_RATIO"]["value"] == "0.1", doc
    plain = env_of(main_container(find(render(helm, *REQUIRED), "Deployment", "scheduler")))
    assert "PLEXRL_TRACE_RATIO" not in plain and "OTEL_EXPORTER_OTLP_ENDPOINT" not in plain


def test_each_service_listens_on_its_port_and_probes_healthz_there(
    manifests: list[dict[str, Any]],
) -> None:
    for doc in workloads(manifests):
        container = main_container(doc)
        what = served(container)
        assert what is not None
        env = env_of(container)
        prefix = {"gpu-worker": "WORKER", "state-store": "STATE_STORE"}.get(what, what.upper())
        port = int(env[f"PLEXRL_{prefix}_PORT"]["value"])
        assert env[f"PLEXRL_{prefix}_HOST"]["value"] == "0.0.0.0", what
        assert container["ports"] == [{"name": "http", "containerPort": port}], what
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, what
        annotations = doc["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(port)
        assert annotations["prometheus.io/path"] == "/metrics"
        (service,) = [
            d for d in manifests if d["kind"] == "Service" and component(d) == component(doc)
        ]
        assert service["spec"]["ports"][0]["port"] == port, what


def test_urls_between_services_name_the_rendered_services(
    manifests: list[dict[str, Any]],
) -> None:
    services = {
        (d["metadata"]["name"], p["port"])
        for d in manifests
        if d["kind"] == "Service"
        for p in d["spec"]["ports"]
    }
    gateway = env_of(main_container(find(manifests, "Deployment", "gateway")))
    for name in ("PLEXRL_STATE_STORE_URL", "PLEXRL_SCHEDULER_URL"):
        host, port = gateway[name]["value"].removeprefix("http://").split(":")
        assert (host, int(port)) in services, name


def test_every_component_has_a_disruption_budget_over_its_pods(
    manifests: list[dict[str, Any]],
) -> None:
    budgets = {component(d): d for d in manifests if d["kind"] == "PodDisruptionBudget"}
    for doc in workloads(manifests):
        selector = budgets[component(doc)]["spec"]["selector"]["matchLabels"]
        assert selector == doc["spec"]["selector"]["matchLabels"]
        assert selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()


def test_secrets_are_referenced_never_inlined(manifests: list[dict[str, Any]]) -> None:
    for doc in workloads(manifests):
        env = env_of(main_container(doc))
        token = env["PLEXRL_SERVICE_TOKEN"]
        assert "value" not in token and token["valueFrom"]["secretKeyRef"]["key"] == "service-token"
    gateway = env_of(main_container(find(manifests, "Deployment", "gateway")))
    assert gateway["PLEXRL_API_KEYS"]["valueFrom"]["secretKeyRef"]["key"] == "api-keys"


def test_an_existing_secret_is_used_instead_of_a_rendered_one(helm: Path) -> None:
    docs = render(helm, *CASES["full"])
    assert not [d for d in docs if d["kind"] == "Secret"]
    for doc in workloads(docs):
        env = env_of(main_container(doc))
        assert env["PLEXRL_SERVICE_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "plexrl-secrets"
        assert env["PLEXRL_REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == "plexrl-redis"
    (secret,) = [d for d in render(helm, *REQUIRED) if d["kind"] == "Secret"]
    assert secret["stringData"] == {"service-token": "test-token", "api-keys": "tml-test=t"}


def test_refuses_to_render_without_a_token_or_keys(helm: Path) -> None:
    result = run_helm(helm, "template", "plexrl", str(CHART), "--set", "secrets.apiKeys=k=t")
    assert result.returncode != 0 and "secrets.serviceToken is required" in result.stderr
    result = run_helm(helm, "template", "plexrl", str(CHART), "--set", "secrets.serviceToken=t")
    assert result.returncode != 0 and "secrets.apiKeys is required" in result.stderr


def test_several_schedulers_each_advertising_its_pod_for_the_lease(helm: Path) -> None:
    defaults = find(render(helm, *REQUIRED), "Deployment", "scheduler")
    assert defaults["spec"]["replicas"] == 2
    assert defaults["spec"]["strategy"] == {"type": "RollingUpdate"}
    full = find(render(helm, *CASES["full"]), "Deployment", "scheduler")
    assert full["spec"]["replicas"] == 3
    env = env_of(main_container(full))
    assert env["PLEXRL_SCHEDULER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PLEXRL_SCHEDULER_ADVERTISE_URL"]["value"] == "http://$(POD_IP):8100"
    assert env["PLEXRL_LEADER_LEASE_S"]["value"] == "6"
    # The variable it is built from comes first (Kubernetes expands only earlier ones).
    names = [e["name"] for e in main_container(full)["env"]]
    assert names.index("POD_IP") < names.index("PLEXRL_SCHEDULER_ADVERTISE_URL")
    budget = find(render(helm, *REQUIRED), "PodDisruptionBudget", "scheduler")
    assert budget["spec"]["maxUnavailable"] == 1
    result = run_helm(
        helm, "template", "plexrl", str(CHART), *REQUIRED, "--set", "scheduler.replicas=0"
    )
    assert result.returncode != 0 and "one leads" in result.stderr


def test_gateways_are_interchangeable_behind_their_service(
    manifests: list[dict[str, Any]],
) -> None:
    service = find(manifests, "Service", "gateway")
    assert "sessionAffinity" not in service["spec"]
    assert find(manifests, "Deployment", "gateway")["spec"]["replicas"] >= 2


def test_replication_and_sentinels_reach_every_service(helm: Path) -> None:
    for doc in workloads(render(helm, *CASES["full"])):
        env = env_of(main_container(doc))
        assert env["PLEXRL_KAFKA_REPLICATION_FACTOR"]["value"] == "3"
        assert env["PLEXRL_KAFKA_MIN_INSYNC_REPLICAS"]["value"] == "2"
        assert env["PLEXRL_REDIS_SENTINELS"]["value"].count(":26379") == 3
        assert env["PLEXRL_REDIS_WAIT_REPLICAS"]["value"] == "1"
    for doc in workloads(render(helm, *REQUIRED)):
        env = env_of(main_container(doc))
        assert env["PLEXRL_KAFKA_REPLICATION_FACTOR"]["value"] == "1"
        assert "PLEXRL_REDIS_SENTINELS" not in env


def test_kafka_tls_and_sasl_reach_every_service(helm: Path) -> None:
    for doc in workloads(render(helm, *CASES["full"])):
        container = main_container(doc)
        env = env_of(container)
        assert env["PLEXRL_KAFKA_SECURITY_PROTOCOL"]["value"] == "SASL_SSL"
        assert env["PLEXRL_KAFKA_SSL_CAFILE"]["value"] == "/etc/plexrl/kafka-tls/ca.pem"
        assert env["PLEXRL_KAFKA_SSL_KEYFILE"]["value"] == "/etc/plexrl/kafka-tls/client.key"
        user = env["PLEXRL_KAFKA_SASL_USERNAME"]["valueFrom"]["secretKeyRef"]
        assert user == {"name": "plexrl-kafka-user", "key": "username"}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["kafka-tls"]["mountPath"] == "/etc/plexrl/kafka-tls"
        assert mounts["kafka-tls"]["readOnly"] is True
        volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
        assert volumes["kafka-tls"]["secret"]["secretName"] == "plexrl-kafka-tls"
    for doc in workloads(render(helm, *REQUIRED)):
        env = env_of(main_container(doc))
        assert not any(name.startswith(("PLEXRL_KAFKA_S",)) for name in env), env.keys()
        volumes = doc["spec"]["template"]["spec"].get("volumes", [])
        assert "kafka-tls" not in {v["name"] for v in volumes}


def test_a_sasl_protocol_without_its_secret_is_refused(helm: Path) -> None:
    args = ("template", "plexrl", str(CHART), *REQUIRED, "--set", "kafka.securityProtocol=SASL_SSL")
    result = run_helm(helm, *args)
    assert result.returncode != 0 and "kafka.sasl.existingSecret is required" in result.stderr


def test_state_store_replicas_share_an_object_store_and_need_one(helm: Path) -> None:
    store = find(render(helm, *CASES["full"]), "StatefulSet", "state-store")
    assert store["spec"]["replicas"] == 2 and "volumeClaimTemplates" not in store["spec"]
    env = env_of(main_container(store))
    assert env["PLEXRL_STATE_STORE_S3_ENDPOINT"]["value"].startswith("https://")
    assert env["PLEXRL_STATE_STORE_S3_PREFIX"]["value"] == "cluster-a/"
    for key in ("PLEXRL_STATE_STORE_S3_ACCESS_KEY", "PLEXRL_STATE_STORE_S3_SECRET_KEY"):
        assert env[key]["valueFrom"]["secretKeyRef"]["name"] == "plexrl-s3"
    assert env["PLEXRL_STATE_STORE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "PLEXRL_STATE_STORE_DIR" not in env
    result = run_helm(
        helm, "template", "plexrl", str(CHART), *REQUIRED, "--set", "stateStore.replicas=2"
    )
    assert result.returncode != 0 and "needs stateStore.objectStore.endpoint" in result.stderr


def test_worker_groups_are_a_statefulset_of_gpu_pods(helm: Path) -> None:
    docs = render(helm, *CASES["full"])
    workers = find(docs, "StatefulSet", "gpu-worker")
    assert workers["spec"]["replicas"] == 4
    container = main_container(workers)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = env_of(container)
    assert env["PLEXRL_WORKER_DEVICE"]["value"] == "cuda"
    # The pod's stable name is the worker's id, so a restarted pod comes back as itself.
    assert env["PLEXRL_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert workers["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    cpu = main_container(
        find(
            render(helm, *REQUIRED, "--set", "gpuWorker.gpusPerRank=0"), "StatefulSet", "gpu-worker"
        )
    )
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert env_of(cpu)["PLEXRL_WORKER_DEVICE"]["value"] == "cpu"


def test_a_multi_rank_group_runs_its_ranks_in_one_pod_one_gpu_each(helm: Path) -> None:
    workers = find(
        render(helm, *REQUIRED, "--set", "gpuWorker.ranksPerGroup=4"), "StatefulSet", "gpu-worker"
    )
    container = main_container(workers)
    assert env_of(container)["PLEXRL_WORKER_RANKS"]["value"] == "4"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    result = run_helm(
        helm,
        "template",
        "plexrl",
        str(CHART),
        *REQUIRED,
        "--set",
        "gpuWorker.ranksPerGroup=2",
        "--set",
        "gpuWorker.gpusPerRank=2",
    )
    assert result.returncode != 0 and "each rank runs on one GPU" in result.stderr


def test_state_store_keeps_its_blobs_on_a_claim(helm: Path) -> None:
    store = find(render(helm, *REQUIRED), "StatefulSet", "state-store")
    assert store["spec"]["replicas"] == 1
    container = main_container(store)
    blob_dir = env_of(container)["PLEXRL_STATE_STORE_DIR"]["value"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == blob_dir]
    claims = {c["metadata"]["name"] for c in store["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims


def test_models_come_from_the_claim_or_the_tiny_builder(helm: Path) -> None:
    defaults = find(render(helm, *REQUIRED), "StatefulSet", "gpu-worker")["spec"]["template"]
    (init,) = defaults["spec"]["initContainers"]
    assert init["command"][:3] == ["plexrl", "model", "init-tiny"]
    full = find(render(helm, *CASES["full"]), "StatefulSet", "gpu-worker")["spec"]["template"]
    assert "initContainers" not in full["spec"]
    (volume,) = [v for v in full["spec"]["volumes"] if v["name"] == "models"]
    assert volume["persistentVolumeClaim"]["claimName"] == "plexrl-models"
