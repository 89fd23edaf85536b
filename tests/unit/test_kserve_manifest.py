"""deploy/kserve: the InferenceService is valid for KServe, the pod it makes is valid for Kubernetes, and both
agree with the server they run.

No cluster. The InferenceService is a custom resource: it is checked against KServe's own CRD schema
(deploy/kserve/schema/, extracted from kserve/kserve by schema/extract_schema.py) with unknown fields
rejected, as `kubectl apply` does by default. The pod KServe builds from spec.predictor, and the HPA,
are checked with kubernetes-validate (strict) as tests/unit/test_k8s_manifests.py does for deploy/k8s. The
other checks read the server's settings, compile-trt's flags and the deploy/k8s files they must match.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import subprocess
from dataclasses import fields
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from compile import cli as compile_cli
from service import _defaults
from service.settings import ServeSettings, env_var, resolve_settings
from tests.tools import require_tool

ROOT = Path(__file__).resolve().parents[2]
KSERVE = ROOT / "deploy" / "kserve"
K8S = ROOT / "deploy" / "k8s"
SCHEMA_DIR = KSERVE / "schema"

# The oldest KServe the manifest is for (RawDeployment with every container port on the Service, the
# "external" autoscaler class, predictor deploymentStrategy) and the newest release, 0.20.
KSERVE_VERSIONS = ("v0.13.0", "v0.20.0")
K8S_VERSIONS = ("1.30", "1.33")  # as tests/test_k8s_manifests.py

# KServe's conventions for a custom predictor (pkg/constants/constants.go).
KSERVE_CONTAINER = "kserve-container"  # InferenceServiceContainerName
HTTP_PORT = 8080  # InferenceServiceDefaultHttpPort: the port KServe and Knative expect HTTP on
RAW_DEPLOYMENT_MODES = ("RawDeployment", "Standard")  # "Standard" from 0.16; 0.13-0.15 know only the first
KSERVE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # IsvcNameFmt, checked by KServe's webhook
# The Open Inference Protocol's health endpoints.
V2_LIVE, V2_READY = "/v2/health/live", "/v2/health/ready"

# spec.predictor fields that KServe reads itself (ComponentExtensionSpec and PredictorSpec's own); every
# other field is the predictor pod's PodSpec, which KServe copies into the Deployment it creates.
EXTENSION_FIELDS = {
    *("minReplicas", "maxReplicas", "scaleTarget", "scaleMetric", "scaleMetricType", "autoScaling"),
    *("containerConcurrency", "timeout", "canaryTrafficPercent", "logger", "batcher"),
    *("labels", "annotations", "deploymentStrategy", "name", "storageUris", "storageContainerName"),
}
# VISION_SERVE_* variables that are not server settings: compile-trt's flags, read by the entrypoint.
NON_SETTING_ENV = {"VISION_SERVE_COMPILE_ARGS"}
# As tests/test_k8s_manifests.py: the startup probe waits out a first compile (the image's HEALTHCHECK
# start period), readiness reacts within 10 s, liveness tolerates 30 s without an answer.
FIRST_START_BUDGET_S = 1800
READINESS_REACTION_MAX_S = 10
LIVENESS_TOLERANCE_MIN_S = 30
LITSERVE_WORKER_JOIN_S = 5  # LitServe 0.2.19's join timeout per inference worker at shutdown


def load_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def load_one(path: Path) -> dict:
    (doc,) = load_docs(path)
    return doc


def kustomization() -> dict:
    return load_one(KSERVE / "kustomization.yaml")


def isvc() -> dict:
    return load_one(KSERVE / "inferenceservice.yaml")


def predictor() -> dict:
    return isvc()["spec"]["predictor"]


def container() -> dict:
    (only,) = predictor()["containers"]
    return only


def literal_env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in container()["env"] if "value" in e}


def resolved_settings() -> ServeSettings:
    """What the pod's server resolves: its env vars over the defaults (no config file here)."""
    return resolve_settings({}, literal_env(), None).settings


def ports() -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container()["ports"]}


def compile_args():
    env = literal_env()
    # As deploy/docker/entrypoint.sh runs compile-trt: the flags split on whitespace, then --output.
    argv = [*env["VISION_SERVE_COMPILE_ARGS"].split(), "--output", env[env_var("artifact")]]
    try:
        return compile_cli.settings_from_args(compile_cli.build_parser().parse_args(argv))
    except SystemExit:
        pytest.fail(f"compile-trt rejects {argv} (see its usage error above)")


@functools.cache
def kserve_schema(version: str) -> dict:
    return json.loads((SCHEMA_DIR / f"inferenceservice-{version}.json").read_text())


def kserve_errors(doc: dict, version: str) -> list[str]:
    validator = jsonschema.Draft7Validator(kserve_schema(version))
    return [
        f"{'.'.join(map(str, error.absolute_path)) or '(root)'}: {error.message}"
        for error in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


def kubernetes_errors(docs: list[dict], version: str) -> list[str]:
    errors = []
    for doc in docs:
        where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{where}: {exc.message}")
    return errors


def predictor_deployment(service: dict) -> dict:
    """The Deployment KServe's raw mode creates for the predictor (reconcilers/deployment): the
    predictor's pod spec, its labels and annotations on the pods, its deploymentStrategy."""
    spec = service["spec"]["predictor"]
    name = f"{service['metadata']['name']}-predictor"
    selector = {"app": f"isvc.{name}"}
    pod_spec = {key: value for key, value in spec.items() if key not in EXTENSION_FIELDS}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": {**spec.get("labels", {}), **selector}},
        "spec": {
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {
                    "labels": {**spec.get("labels", {}), **selector},
                    "annotations": {**service["metadata"].get("annotations", {}), **spec.get("annotations", {})},
                },
                "spec": pod_spec,
            },
        },
    }
    if "deploymentStrategy" in spec:
        deployment["spec"]["strategy"] = spec["deploymentStrategy"]
    return deployment


def kustomize() -> list[dict]:
    kubectl = require_tool("kubectl")
    done = subprocess.run([kubectl, "kustomize", str(KSERVE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


# ---- files and schemas -------------------------------------------------------------------------------


def test_every_file_is_deployed_or_known():
    """A manifest no kustomization lists would go unvalidated; a schema no test uses is dead weight."""
    known = {KSERVE / "kustomization.yaml", *(KSERVE / name for name in kustomization()["resources"])}
    assert {*KSERVE.glob("*.yaml"), *KSERVE.glob("*.yml")} == known
    schemas = {path.name for path in SCHEMA_DIR.glob("*.json")}
    assert schemas == {f"inferenceservice-{version}.json" for version in KSERVE_VERSIONS}


@pytest.mark.parametrize("version", KSERVE_VERSIONS)
def test_schema_says_where_it_came_from(version):
    schema = kserve_schema(version)
    source = schema["$comment"]
    assert f"github.com/kserve/kserve {version} (commit " in source
    assert re.search(r"\(commit [0-9a-f]{40}\)", source)
    assert "serving.kserve.io_inferenceservices.yaml" in source
    # Strict, as kubectl apply's default field validation: unknown fields are errors, not pruned.
    assert schema["additionalProperties"] is False
    container_schema = schema["properties"]["spec"]["properties"]["predictor"]["properties"]["containers"]["items"]
    assert container_schema["additionalProperties"] is False
    assert {"name", "image", "ports", "env", "readinessProbe"} <= set(container_schema["properties"])


@pytest.mark.parametrize("version", KSERVE_VERSIONS)
def test_inference_service_is_valid_for_kserve(version):
    service = isvc()
    assert (service["apiVersion"], service["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    assert kserve_errors(service, version) == []


def set_path(doc: dict, path: tuple, value) -> dict:
    broken = copy.deepcopy(doc)
    target = broken
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return broken


CONTAINER = ("spec", "predictor", "containers", 0)
# A change to the manifest -> what the schema's error must name.
BROKEN = {
    # A typo'd field: the API server would drop it silently without strict validation.
    "unknown container field": ((*CONTAINER, "livenesProbe"), {"httpGet": {"path": V2_LIVE}}, "'livenesProbe'"),
    # protocolVersion is a field of KServe's runtimes (predictor.model), not of a custom predictor.
    "runtime field on a custom predictor": (("spec", "predictor", "protocolVersion"), "v2", "'protocolVersion'"),
    "wrong type": (("spec", "predictor", "terminationGracePeriodSeconds"), "75", "not of type 'integer'"),
    "port as a string": ((*CONTAINER, "ports", 0, "containerPort"), "8080", "not of type 'integer'"),
    "env entry without a name": ((*CONTAINER, "env", 0), {"value": "v2"}, "'name' is a required property"),
    "no predictor": (("spec",), {}, "'predictor' is a required property"),
}


@pytest.mark.parametrize("version", KSERVE_VERSIONS)
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_kserve_schema_rejects_a_broken_manifest(version, case):
    path, value, expected = BROKEN[case]
    errors = kserve_errors(set_path(isvc(), path, value), version)
    assert len(errors) == 1, errors
    assert expected in errors[0]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_predictor_pod_and_hpa_are_valid_kubernetes_objects(version):
    """spec.predictor minus KServe's own fields must be a PodSpec (strict: a field left over is an error)."""
    docs = [predictor_deployment(isvc()), load_one(KSERVE / "hpa.yaml")]
    assert kubernetes_errors(docs, version) == []
    broken = predictor_deployment(set_path(isvc(), (*CONTAINER, "readinessProbe", "httpGet", "port"), [8080]))
    assert kubernetes_errors([broken], version) != []


def test_kustomize_renders_valid_objects():
    docs = kustomize()
    kinds = {doc["kind"]: doc for doc in docs}
    assert sorted(kinds) == ["HorizontalPodAutoscaler", "InferenceService"]
    assert {doc["metadata"]["namespace"] for doc in docs} == {kustomization()["namespace"]}
    assert kustomization()["namespace"] == load_one(K8S / "namespace.yaml")["metadata"]["name"]
    rendered = kinds["InferenceService"]
    for version in KSERVE_VERSIONS:
        assert kserve_errors(rendered, version) == []
    (entry,) = kustomization()["images"]
    (c,) = rendered["spec"]["predictor"]["containers"]
    assert c["image"] == f"{entry['newName']}:{entry['newTag']}"
    # The same image as deploy/k8s.
    (k8s_entry,) = load_one(K8S / "kustomization.yaml")["images"]
    assert entry == k8s_entry


# ---- KServe's side -----------------------------------------------------------------------------------


def test_custom_predictor_in_raw_deployment_mode():
    service = isvc()
    annotations = service["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] in RAW_DEPLOYMENT_MODES
    # KServe's own HPA would scale on CPU and fight hpa.yaml.
    assert annotations["serving.kserve.io/autoscalerClass"] == "external"
    assert KSERVE_NAME.match(service["metadata"]["name"])
    spec = predictor()
    assert container()["name"] == KSERVE_CONTAINER
    assert not {"model", "sklearn", "triton", "pytorch", "workerSpec"} & set(spec)
    # The protocol marker of a custom predictor (KServe's PROTOCOL env var; its webhook allows v1, v2).
    assert literal_env()["PROTOCOL"] == "v2"


def test_hpa_scales_the_predictor_deployment_as_deploy_k8s_does():
    hpa = load_one(KSERVE / "hpa.yaml")
    target = hpa["spec"]["scaleTargetRef"]
    # KServe names the predictor's Deployment <InferenceService>-predictor (constants.PredictorServiceName).
    assert target == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{isvc()['metadata']['name']}-predictor"}
    # One autoscaling design: deploy/k8s/hpa.yaml's metric, target and behaviour, which its tests derive.
    k8s_hpa = load_one(K8S / "hpa.yaml")["spec"]
    for key in ("minReplicas", "maxReplicas", "metrics", "behavior"):
        assert hpa["spec"][key] == k8s_hpa[key], key
    (metric,) = hpa["spec"]["metrics"]
    settings = resolved_settings()
    assert settings.max_batch_size <= float(metric["pods"]["target"]["averageValue"]) < settings.max_queue


def test_prometheus_annotations_reach_the_pod_and_name_the_http_port():
    annotations = predictor()["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(ports()["http"])
    assert annotations["prometheus.io/path"] == "/metrics"
    # Otherwise KServe's webhook may rewrite prometheus.io/port to its queue-proxy port.
    assert annotations["serving.kserve.io/enable-prometheus-scraping"] == "false"


def parse_quantity(text: str | int) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti)?", str(text))
    assert match, f"unexpected quantity {text!r}"
    scale = {None: 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[match.group(2)]
    return float(match.group(1)) * scale


def test_resources_leave_nothing_to_kserve_defaults():
    """KServe's webhook fills an absent cpu/memory request or limit with 1 CPU / 2Gi: a 1-CPU limit under
    a 4-CPU request would make every pod invalid."""
    resources = container()["resources"]
    for kind in ("cpu", "memory"):
        request, limit = resources["requests"][kind], resources["limits"][kind]
        assert parse_quantity(request) <= parse_quantity(limit), kind
    assert resources["limits"]["nvidia.com/gpu"] == 1


# ---- the server's side --------------------------------------------------------------------------------


def test_env_holds_only_real_settings():
    setting_env = {env_var(f.name) for f in fields(ServeSettings)}
    names = {e["name"] for e in container()["env"]}
    unknown = {name for name in names if name.startswith(_defaults.ENV_PREFIX)} - setting_env - NON_SETTING_ENV
    assert unknown == set(), "not vision-serve settings (see service/settings.py)"
    settings = resolved_settings()  # runs the settings' own validation
    assert settings.host in ("0.0.0.0", "::"), "KServe's Service cannot reach a server on loopback"
    assert settings.log_format == "json"


def test_ports_are_kserves_and_the_servers():
    assert list(ports()) == ["http", "grpc"], "HTTP first: KServe's Service and Ingress route port 80 to it"
    settings = resolved_settings()
    assert ports()["http"] == HTTP_PORT == settings.port
    # The server's gRPC endpoint is off unless its port is set. (KServe marks a port named *grpc* or
    # *h2c* as HTTP/2.)
    assert settings.grpc_port == ports()["grpc"] != ports()["http"]
    assert {p.get("protocol", "TCP") for p in container()["ports"]} == {"TCP"}
    # A Service of the namespace named vision-serve would set VISION_SERVE_PORT=tcp://... in the pod.
    assert predictor()["enableServiceLinks"] is False


def test_probes_use_the_v2_health_endpoints_on_the_http_port():
    c = container()
    probes = {kind: c[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {kind: probe["port"] for kind, probe in probes.items()} == dict.fromkeys(probes, HTTP_PORT)
    assert probes["readinessProbe"]["path"] == V2_READY
    assert probes["livenessProbe"]["path"] == V2_LIVE
    assert probes["startupProbe"]["path"] in (V2_LIVE, V2_READY)

    def window_s(probe: dict) -> int:
        return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)

    assert window_s(c["startupProbe"]) >= FIRST_START_BUDGET_S
    assert window_s(c["readinessProbe"]) <= READINESS_REACTION_MAX_S
    assert window_s(c["livenessProbe"]) >= LIVENESS_TOLERANCE_MIN_S
    for kind in probes:
        assert c[kind].get("timeoutSeconds", 1) < c[kind].get("periodSeconds", 10)


def test_server_has_the_routes_kserve_and_the_probes_call():
    from fastapi import FastAPI

    from service.http.base.infer_paths import is_infer_path
    from service.http.oip.routes import add_oip_routes

    app = FastAPI()
    add_oip_routes(app, None, server_version="0", ready=lambda: True, model_ready=bool, table=dict)
    paths = {route.path for route in app.routes}
    model = isvc()["metadata"]["name"]
    assert {V2_LIVE, V2_READY, "/v2", "/v2/models/{name}", "/v2/models/{name}/ready"} <= paths
    assert is_infer_path(f"/v2/models/{model}/infer")


def test_model_name_is_the_compiled_model_and_the_inference_service_name():
    """KServe takes the InferenceService's name as the model's (status.url, InferenceGraph's
    /v2/models/{name}/infer); the server serves the model the artifact was compiled from."""
    model = compile_args().model
    assert isvc()["metadata"]["name"] == model
    if env_var("model") in literal_env():
        assert literal_env()[env_var("model")] == model
    assert model in Path(literal_env()[env_var("artifact")]).name
    # The README's examples call that model.
    readme = (KSERVE / "README.md").read_text()
    assert f"/v2/models/{model}/infer" in readme
    assert set(re.findall(r"/v2/models/([a-z0-9_-]+)", readme)) == {model}


def test_artifact_is_on_the_shared_cache_and_covers_the_served_batch():
    mounts = {m["name"]: m["mountPath"] for m in container()["volumeMounts"]}
    volumes = {v["name"]: v for v in predictor()["volumes"]}
    assert Path(mounts["cache"]) in Path(literal_env()[env_var("artifact")]).parents
    # The claim deploy/k8s/pvc.yaml creates (README: applied into the namespace first).
    claim = load_one(K8S / "pvc.yaml")["metadata"]["name"]
    assert volumes["cache"]["persistentVolumeClaim"]["claimName"] == claim
    assert compile_args().batch[2] >= resolved_settings().max_batch_size
    assert "emptyDir" in volumes[next(n for n, path in mounts.items() if path == "/tmp")]
    assert volumes[next(n for n, path in mounts.items() if path == "/dev/shm")]["emptyDir"]["medium"] == "Memory"


def test_pod_is_deploy_k8s_pod_in_security_and_stopping():
    from service.supervisor.server import CHILD_STOP_TIMEOUT_S

    k8s_pod = load_one(K8S / "deployment.yaml")["spec"]["template"]["spec"]
    (k8s_container,) = k8s_pod["containers"]
    # The namespace enforces the "restricted" Pod Security Standard; so does this pod, as deploy/k8s's.
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


def test_deploy_k8s_service_does_not_select_the_predictor_pods():
    """Both deployed in one namespace, deploy/k8s's Service and PDB must keep to their own pods."""
    labels = predictor()["labels"]
    for path in (K8S / "service.yaml", K8S / "pdb.yaml"):
        doc = load_one(path)
        selector = doc["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert not selector.items() <= labels.items(), path.name
