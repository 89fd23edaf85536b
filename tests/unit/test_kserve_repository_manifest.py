"""deploy/kserve/repository: the InferenceService that serves a model repository downloaded by KServe's
storage initializer is valid for KServe, the pod it makes is valid for Kubernetes, and both agree with
the server they run (its flags, its settings, the entrypoint of the image).

No cluster, as tests/unit/test_kserve_manifest.py, whose schema checks and pod construction this reuses.
"""

from __future__ import annotations

import subprocess
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from service import _defaults
from service.cli import build_parser, settings_from_args
from service.settings import ServeSettings, env_var
from tests.tools import require_tool
from tests.unit.test_kserve_manifest import (
    HTTP_PORT,
    K8S_VERSIONS,
    KSERVE_CONTAINER,
    KSERVE_NAME,
    KSERVE_VERSIONS,
    LITSERVE_WORKER_JOIN_S,
    RAW_DEPLOYMENT_MODES,
    READINESS_REACTION_MAX_S,
    V2_LIVE,
    V2_READY,
    kserve_errors,
    kubernetes_errors,
    load_one,
    predictor_deployment,
)

ROOT = Path(__file__).resolve().parents[2]
KSERVE = ROOT / "deploy" / "kserve"
REPOSITORY = KSERVE / "repository"
K8S = ROOT / "deploy" / "k8s"

# KServe's conventions for a custom predictor's storage (pkg/constants/constants.go): the env var it reads
# the URI from, where its storage initializer puts the files, and the volume it adds for them.
STORAGE_URI_ENV = "STORAGE_URI"  # CustomSpecStorageUriEnvVarKey
MODEL_MOUNT_PATH = "/mnt/models"  # DefaultModelLocalMountPath
PROVISION_VOLUME = "kserve-provision-location"  # StorageInitializerVolumeName
STORAGE_SCHEMES = ("s3://", "gs://", "pvc://", "https://", "hdfs://", "webhdfs://")
# What a model load may take, besides the deadline of the requests held while stopping.
MODEL_LOAD_BUDGET_S = 600
PLACEHOLDER_ADMIN_KEY = "admin-key-from-the-secret"  # the Secret's value, unknown here


def kustomization() -> dict:
    return load_one(REPOSITORY / "kustomization.yaml")


def isvc() -> dict:
    return load_one(REPOSITORY / "inferenceservice.yaml")


def predictor() -> dict:
    return isvc()["spec"]["predictor"]


def container() -> dict:
    (only,) = predictor()["containers"]
    return only


def env_entries() -> dict[str, dict]:
    return {e["name"]: e for e in container()["env"]}


def literal_env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in container()["env"] if "value" in e}


def resolved_settings(admin_key: str = PLACEHOLDER_ADMIN_KEY) -> ServeSettings:
    """What the pod's server resolves: the container's args as vision-serve flags (the image's
    entrypoint passes flags through), over its env vars, the admin key standing in for the Secret's."""
    environ = {**literal_env(), env_var("admin_api_key"): admin_key} if admin_key else literal_env()
    return settings_from_args(build_parser().parse_args(container()["args"]), environ)


def ports() -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container()["ports"]}


# ---- files and schemas -------------------------------------------------------------------------------


def test_every_file_is_deployed():
    known = {REPOSITORY / "kustomization.yaml", *(REPOSITORY / name for name in kustomization()["resources"])}
    assert {*REPOSITORY.glob("*.yaml"), *REPOSITORY.glob("*.yml")} == known


@pytest.mark.parametrize("version", KSERVE_VERSIONS)
def test_inference_service_is_valid_for_kserve(version):
    service = isvc()
    assert (service["apiVersion"], service["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    assert kserve_errors(service, version) == []


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_predictor_pod_is_a_valid_kubernetes_object(version):
    assert kubernetes_errors([predictor_deployment(isvc())], version) == []


def test_kustomize_renders_the_inference_service_with_the_image_of_deploy_kserve():
    kubectl = require_tool("kubectl")
    done = subprocess.run([kubectl, "kustomize", str(REPOSITORY)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (rendered,) = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    assert rendered["kind"] == "InferenceService"
    assert rendered["metadata"]["namespace"] == load_one(K8S / "namespace.yaml")["metadata"]["name"]
    for version in KSERVE_VERSIONS:
        assert kserve_errors(rendered, version) == []
    (entry,) = kustomization()["images"]
    assert entry == load_one(KSERVE / "kustomization.yaml")["images"][0]
    (c,) = rendered["spec"]["predictor"]["containers"]
    assert c["image"] == f"{entry['newName']}:{entry['newTag']}"


# ---- KServe's side -----------------------------------------------------------------------------------


def test_custom_predictor_in_raw_deployment_mode_with_no_kserve_autoscaler():
    service = isvc()
    annotations = service["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] in RAW_DEPLOYMENT_MODES
    assert annotations["serving.kserve.io/autoscalerClass"] == "external"
    assert KSERVE_NAME.match(service["metadata"]["name"])
    assert container()["name"] == KSERVE_CONTAINER
    assert not {"model", "sklearn", "triton", "pytorch", "workerSpec"} & set(predictor())
    assert literal_env()["PROTOCOL"] == "v2"
    # KServe splits traffic by canaryTrafficPercent in Serverless mode only; in raw mode it would do
    # nothing (the README's canary rollout switches the mode first).
    assert "canaryTrafficPercent" not in predictor()


def test_the_repository_comes_from_storage_uri_to_where_the_server_reads_it():
    """KServe's webhook adds the storage initializer for a custom predictor's STORAGE_URI and mounts
    its emptyDir at /mnt/models: the server's repository, and a path the pod must not mount itself."""
    uri = literal_env()[STORAGE_URI_ENV]
    assert uri.startswith(STORAGE_SCHEMES)
    assert resolved_settings().model_repository == MODEL_MOUNT_PATH
    assert all(m["mountPath"].rstrip("/") != MODEL_MOUNT_PATH for m in container()["volumeMounts"])
    assert PROVISION_VOLUME not in {v["name"] for v in predictor()["volumes"]}


def test_prometheus_annotations_name_the_http_port():
    annotations = predictor()["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(ports()["http"])
    assert annotations["prometheus.io/path"] == "/metrics"
    assert annotations["serving.kserve.io/enable-prometheus-scraping"] == "false"


# ---- the server's side --------------------------------------------------------------------------------


def test_the_entrypoint_serves_without_compiling():
    """Flags first: the image's entrypoint execs vision-serve with them. No VISION_SERVE_ARTIFACT: it
    would compile into that path first, and a repository server refuses --artifact."""
    assert container()["args"][0].startswith("-")
    names = set(env_entries())
    assert env_var("artifact") not in names and "VISION_SERVE_COMPILE_ARGS" not in names


def test_env_holds_only_real_settings_and_the_server_serves_the_repository_api():
    setting_env = {env_var(f.name) for f in fields(ServeSettings)}
    unknown = {name for name in env_entries() if name.startswith(_defaults.ENV_PREFIX)} - setting_env
    assert unknown == set(), "not vision-serve settings (see service/settings.py)"
    settings = resolved_settings()
    assert settings.model_control == "explicit"
    assert settings.host in ("0.0.0.0", "::")
    assert settings.log_format == "json"


def test_the_admin_key_comes_from_a_required_secret_of_its_own():
    with pytest.raises(ValueError, match="needs --admin-api-key"):
        resolved_settings(admin_key="")  # why the Secret is required: the server would not start
    admin = env_entries()[env_var("admin_api_key")]["valueFrom"]["secretKeyRef"]
    assert admin.get("optional", False) is False
    inference = env_entries()[env_var("api_key")]["valueFrom"]["secretKeyRef"]
    assert (admin["name"], admin["key"]) != (inference["name"], inference["key"])
    # The inference key's Secret is deploy/k8s's, as in ../inferenceservice.yaml.
    assert inference["name"] == load_one(K8S / "secret.example.yaml")["metadata"]["name"]
    readme = (KSERVE / "README.md").read_text()
    assert f"secret generic {admin['name']}" in readme and f"--from-literal={admin['key']}=" in readme


def test_ports_are_kserves_and_the_servers():
    assert list(ports()) == ["http", "grpc"], "HTTP first: KServe's Service and Ingress route port 80 to it"
    settings = resolved_settings()
    assert ports()["http"] == HTTP_PORT == settings.port
    assert settings.grpc_port == ports()["grpc"]
    assert predictor()["enableServiceLinks"] is False


def test_probes_use_the_v2_health_endpoints_on_the_http_port():
    c = container()
    probes = {kind: c[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {kind: probe["port"] for kind, probe in probes.items()} == dict.fromkeys(probes, HTTP_PORT)
    assert probes["readinessProbe"]["path"] == V2_READY
    assert probes["livenessProbe"]["path"] == V2_LIVE

    def window_s(probe: dict) -> int:
        return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)

    assert window_s(c["startupProbe"]) >= MODEL_LOAD_BUDGET_S
    assert window_s(c["readinessProbe"]) <= READINESS_REACTION_MAX_S


def test_pod_is_deploy_k8s_pod_in_security_and_stopping():
    from service.supervisor.server import CHILD_STOP_TIMEOUT_S

    k8s_pod = load_one(K8S / "deployment.yaml")["spec"]["template"]["spec"]
    (k8s_container,) = k8s_pod["containers"]
    assert predictor()["securityContext"] == k8s_pod["securityContext"]
    assert container()["securityContext"] == k8s_container["securityContext"]
    assert container()["lifecycle"] == k8s_container["lifecycle"]
    (pre_stop_s,) = [float(arg) for arg in container()["lifecycle"]["preStop"]["exec"]["command"][1:]]
    settings = resolved_settings()
    needed = (
        pre_stop_s
        + settings.request_timeout_s
        + LITSERVE_WORKER_JOIN_S * settings.workers_per_device
        + CHILD_STOP_TIMEOUT_S
    )
    assert predictor()["terminationGracePeriodSeconds"] >= needed


def test_the_pods_are_selected_by_nothing_else_and_by_the_readme_rollout():
    labels = predictor()["labels"]
    single = load_one(KSERVE / "inferenceservice.yaml")["spec"]["predictor"]["labels"]
    assert labels != single, "../inferenceservice.yaml's pods and these must be told apart"
    for path in (K8S / "service.yaml", K8S / "pdb.yaml"):
        selector = load_one(path)["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert not selector.items() <= labels.items(), path.name
    selector = ",".join(f"{key}={value}" for key, value in labels.items())
    assert f"-l {selector}" in (KSERVE / "README.md").read_text()
