"""deploy/kubernetes/: every overlay validated offline against the Kubernetes schemas, and the
numbers that must agree checked against each other and against the service itself."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from app.metrics import Metrics
from app.settings import Settings
from tests.deploy.kustomize import Manifest, build, pod_spec

KUBERNETES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = ["base", "gpu", "queue-depth"]
# The oldest Kubernetes these files claim to work on, and the newest schemas at hand.
VERSIONS = ["1.29", "1.37"]
# Seconds the process may need after the drain ends: the batch worker finishes its current
# forward pass and uvicorn closes the connections.
EXIT_MARGIN = 5


def rendered(overlay: str) -> dict[str, Manifest]:
    return {manifest["kind"]: manifest for manifest in build(KUBERNETES / overlay)}


def container(manifests: dict[str, Manifest]) -> dict[str, Any]:
    spec = pod_spec(manifests["Deployment"])
    assert spec is not None
    (only,) = spec["containers"]
    result: dict[str, Any] = only
    return result


def env(manifests: dict[str, Manifest]) -> dict[str, str]:
    values = {item["name"]: item["value"] for item in container(manifests)["env"]}
    names = [item["name"] for item in container(manifests)["env"]]
    assert len(names) == len(set(names)), f"a variable is set twice: {names}"
    return values


def setting(manifests: dict[str, Manifest], name: str) -> str:
    """The value the service will see: the manifest's EMBED_ variable, else its default."""
    default = Settings.model_fields[name].default
    return env(manifests).get(f"EMBED_{name.upper()}", str(default))


def cpu_cores(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_every_manifest_file_is_part_of_an_overlay() -> None:
    """A file no kustomization lists would escape the checks below."""
    listed: set[Path] = set()
    for kustomization in KUBERNETES.rglob("kustomization.yaml"):
        for resource in yaml.safe_load(kustomization.read_text()).get("resources", []):
            listed.add((kustomization.parent / resource).resolve())
    manifests = {
        path.resolve()
        for path in KUBERNETES.rglob("*.yaml")
        if path.name != "kustomization.yaml" and "apiVersion" in path.read_text()
    }
    assert manifests - listed == set()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_validate_against_the_kubernetes_schemas(overlay: str, version: str) -> None:
    manifests = build(KUBERNETES / overlay)
    assert {m["kind"] for m in manifests} == {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    }
    for manifest in manifests:
        # strict: an unknown or misspelt field is an error, not silently dropped.
        kubernetes_validate.validate(manifest, version, strict=True)


def test_the_validator_rejects_a_misspelt_field() -> None:
    deployment = rendered("base")["Deployment"]
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_covers_prestop_drain_and_exit(overlay: str) -> None:
    manifests = rendered(overlay)
    spec = pod_spec(manifests["Deployment"])
    assert spec is not None
    command = container(manifests)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    grace = float(setting(manifests, "shutdown_grace"))
    timeout = float(setting(manifests, "request_timeout"))
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + grace + EXIT_MARGIN
    # Every accepted request gets its answer (or its 504) within the drain.
    assert timeout <= grace
    # The pause lets the endpoint removal reach the proxies; too short to matter otherwise.
    assert pre_stop >= 3


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_the_services_paths_and_port(overlay: str) -> None:
    manifests = rendered(overlay)
    main = container(manifests)
    ports = {port["name"]: port["containerPort"] for port in main["ports"]}
    assert ports == {"http": int(setting(manifests, "port"))}
    for probe in ("startupProbe", "readinessProbe"):
        assert main[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # Liveness must not be /health: it is 503 while loading and draining, and a liveness
    # failure restarts the container in the middle of both.
    assert main["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    startup = main["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # time to load
    service = manifests["Service"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    annotations = manifests["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["http"])
    assert annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_pick_the_deployments_pods(overlay: str) -> None:
    manifests = rendered(overlay)
    labels = manifests["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert manifests["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert manifests["Service"]["spec"]["selector"].items() <= labels.items()
    pdb = manifests["PodDisruptionBudget"]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["minAvailable"] < manifests["Deployment"]["spec"]["replicas"]
    target = manifests["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "embedding-server")
    assert manifests["HorizontalPodAutoscaler"]["spec"]["minReplicas"] >= pdb["minAvailable"] + 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_threads_match_the_cpu_request(overlay: str) -> None:
    manifests = rendered(overlay)
    threads = int(env(manifests)["EMBED_THREADS"])
    requested = cpu_cores(container(manifests)["resources"]["requests"]["cpu"])
    # More torch threads than reserved CPUs oversubscribes them; fewer leaves them idle.
    assert threads == math.floor(requested)
    assert "cpu" not in container(manifests)["resources"].get("limits", {})


def test_the_gpu_overlay_asks_for_a_gpu_and_uses_it() -> None:
    manifests = rendered("gpu")
    main = container(manifests)
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env(manifests)["EMBED_DEVICES"] == "cuda"
    assert Settings(devices=env(manifests)["EMBED_DEVICES"]).devices == ["cuda"]
    assert main["image"] == "embedding-server:cuda"
    assert int(env(manifests)["EMBED_MAX_BATCH_TOKENS"]) >= 1
    # The image it names is built with the CUDA torch through this build argument.
    dockerfile = (KUBERNETES.parents[1] / "Dockerfile").read_text()
    assert "ARG TORCH_INDEX_URL=" in dockerfile
    assert "TORCH_INDEX_URL=" in (KUBERNETES / "gpu" / "kustomization.yaml").read_text()
    cpu = rendered("base")
    assert "nvidia.com/gpu" not in container(cpu)["resources"].get("limits", {})


def test_the_queue_depth_autoscaler_reads_a_metric_the_service_exports() -> None:
    hpa = rendered("queue-depth")["HorizontalPodAutoscaler"]["spec"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "External"
    name = metric["external"]["metric"]["name"]
    exported = {family.name for family in Metrics().registry.collect()}
    assert name in exported
    assert name == "embed_queue_depth"
    adapter = yaml.safe_load(
        (KUBERNETES / "queue-depth" / "prometheus-adapter-values.yaml").read_text()
    )
    (rule,) = adapter["rules"]["external"]
    assert rule["seriesQuery"].startswith(name + "{")
    assert rule["name"]["as"] == name
    pod_labels = rendered("queue-depth")["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert metric["external"]["metric"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # Scale out while more than about one full batch waits per replica.
    average = float(metric["external"]["target"]["averageValue"])
    assert 1 <= average <= 4 * Settings.model_fields["max_batch_inputs"].default
