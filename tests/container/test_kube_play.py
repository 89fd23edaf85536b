"""The Kubernetes Deployment's pod, run: `podman kube play` of deploy/k8s rendered by kustomize with its CPU
component (deploy/k8s/components/cpu: the CPU image, no GPU), from an overlay as a user's would be.

No kubelet here, so what it would do is done by hand, and said: each probe's request is sent to the pod
as the kubelet sends it (podman 4 runs none of them: it turns the liveness probe into a healthcheck that
needs curl and a numeric port), and the emptyDir volumes are made as the kubelet makes them
(world-writable; podman would make root-owned named volumes). The HPA, Service and PDB are not run."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from benchmarks.harness.podman import Build, podman
from tests.conftest import CAT_LABELS
from tests.tools import kustomize_overlay
from tests.worker_hold import wait_until

ROOT = Path(__file__).resolve().parents[2]


def rendered(image: str, folder: Path) -> list[dict]:
    """deploy/k8s with the CPU component and ``image``, from an overlay in ``folder``, as a user's would be."""
    name, tag = image.rsplit(":", 1)
    images = [{"name": "vision-serve-cpu", "newName": name, "newTag": tag}]
    return kustomize_overlay(folder, ROOT / "deploy/k8s", [ROOT / "deploy/k8s/components/cpu"], images)


def unique_to_this_run(documents: list[dict], prefix: str) -> tuple[dict, dict]:
    """(Deployment, ConfigMap) as rendered, but for names unique to this run: the Deployment, its claim and
    its emptyDir volumes (podman makes those named volumes, shared by name across pods)."""
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    (config_map,) = [d for d in documents if d["kind"] == "ConfigMap"]
    deployment["metadata"]["name"] = prefix
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    renamed = {}
    for volume in pod["volumes"]:
        if "persistentVolumeClaim" in volume:
            volume["persistentVolumeClaim"]["claimName"] = f"{prefix}-cache"
        elif "emptyDir" in volume:
            renamed[volume["name"]] = volume["name"] = f"{prefix}-{volume['name']}"
    for mount in container["volumeMounts"]:
        mount["name"] = renamed.get(mount["name"], mount["name"])
    return deployment, config_map


def probe_url(probe: dict, container: dict, address: str) -> str:
    """The URL the kubelet would GET for an httpGet probe, its named port resolved."""
    port = probe["httpGet"]["port"]
    if isinstance(port, str):
        (port,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return f"http://{address}:{port}{probe['httpGet']['path']}"


@pytest.fixture(scope="module")
def pod(cpu_image: Build, run_id: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, str, str]]:
    """(Deployment, pod address, container name) of the played Deployment; taken down afterwards."""
    if os.geteuid() != 0:
        pytest.skip("a rootless pod's address is not reachable from the host: run the container tier as root")
    prefix = f"vs-test-{run_id}-kube"
    folder = tmp_path_factory.mktemp("kube")
    deployment, config_map = unique_to_this_run(rendered(cpu_image.reference, folder), prefix)
    (folder / "deployment.yaml").write_text(yaml.safe_dump(deployment))
    (folder / "configmap.yaml").write_text(yaml.safe_dump(config_map))
    empty_dirs = [v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"] if "emptyDir" in v]
    for name in empty_dirs:  # the kubelet's emptyDir: empty, world-writable
        podman("volume", "create", "--opt", "type=tmpfs", "--opt", "device=tmpfs", "--opt", "o=mode=1777", name)
    try:
        podman("kube", "play", "--configmap", str(folder / "configmap.yaml"), str(folder / "deployment.yaml"))
        pod_name = f"{prefix}-pod-0"
        infra = podman("pod", "inspect", pod_name, "--format", "{{.InfraContainerID}}").strip()
        networks = json.loads(podman("inspect", infra, "--format", "{{json .NetworkSettings.Networks}}"))
        (address,) = [network["IPAddress"] for network in networks.values() if network.get("IPAddress")]
        yield deployment, address, f"{pod_name}-vision-serve"
    finally:
        podman("kube", "down", str(folder / "deployment.yaml"), check=False, timeout=180)
        for name in [*empty_dirs, f"{prefix}-cache", config_map["metadata"]["name"]]:
            podman("volume", "rm", "--force", name, check=False)


def answers_200(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_deployments_pod_passes_its_probes_and_answers_predict(
    pod: tuple[dict, str, str], chelsea_jpeg: bytes
) -> None:
    deployment, address, container_name = pod
    (spec,) = deployment["spec"]["template"]["spec"]["containers"]
    startup = spec["startupProbe"]
    # The startup probe's own budget: periodSeconds x failureThreshold (30 minutes) covers a first compile.
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    wait_until(lambda: answers_200(probe_url(startup, spec, address)), "the startup probe passes", timeout=budget)
    for probe in ("readinessProbe", "livenessProbe"):
        url = probe_url(spec[probe], spec, address)
        wait_until(lambda url=url: answers_200(url), f"the {probe} passes", timeout=120)

    port = spec["ports"][0]["containerPort"]
    response = httpx.post(f"http://{address}:{port}/predict", content=chelsea_jpeg, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["predictions"][0]["label"] in CAT_LABELS

    # The pod's securityContext took effect: its user, a read-only root, no capabilities.
    inspected = json.loads(podman("inspect", container_name))[0]
    run_as = deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert inspected["Config"]["User"].split(":")[0] == str(run_as)
    assert inspected["HostConfig"]["ReadonlyRootfs"] is True
    assert not inspected["EffectiveCaps"], inspected["EffectiveCaps"]
    # The server read the ConfigMap's vision-serve.toml (VISION_SERVE_CONFIG): its settings are in force.
    settings = podman("exec", container_name, "vision-serve", "--print-config")
    assert "/etc/vision-serve/vision-serve.toml" in settings, settings[-2000:]
