"""deploy/k8s: the manifests render, are valid Kubernetes objects, and agree with the server they run.

No cluster: objects are validated against the Kubernetes JSON schemas (kubernetes-validate, strict:
an unknown field fails), and the checks below read the server's own settings code, metric names and
defaults, so a change on either side that breaks the other fails here.
"""

from __future__ import annotations

import copy
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
from service import _defaults, metrics
from service.settings import CONFIG_ENV, ServeSettings, env_var, read_config_file, resolve_settings
from tests.tools import kustomize, kustomize_overlay, require_tool
from tests.unit.test_deploy_files import instruction

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
MONITORING = K8S / "monitoring"
PER_POD_CACHE = K8S / "components" / "per-pod-cache"
CPU_COMPONENT = K8S / "components" / "cpu"
KEDA_COMPONENT = K8S / "components" / "keda"
# KEDA's ScaledObject CRD schema (a custom resource: kubernetes-validate has no schema for it).
KEDA_SCHEMA = KEDA_COMPONENT / "schema" / "scaledobject-v2.20.2.json"
SERVICE_MONITOR = K8S / "prometheus-operator" / "servicemonitor.yaml"
# Objects outside every kustomization, deployed by hand; validated all the same.
STANDALONE = (K8S / "secret.example.yaml", SERVICE_MONITOR)

# The oldest Kubernetes the manifests are for (HPA behavior, PDB unhealthyPodEvictionPolicy and
# the rest exist there) and a recent one, to catch a field that was removed since.
K8S_VERSIONS = ("1.30", "1.33")

# VISION_SERVE_* variables that are not server settings: the config file's path (read by the
# server's CLI) and compile-trt's flags (read by the image's entrypoint).
NON_SETTING_ENV = {CONFIG_ENV, "VISION_SERVE_COMPILE_ARGS"}
IMAGE_UID = 10001  # the non-root user of Dockerfile.gpu's image

# A first start compiles the TensorRT artifact (several minutes, more on a small GPU or behind another
# pod's compile) and then loads and warms the model; the startup probe must wait at least this long
# (the image's HEALTHCHECK start period) before the kubelet restarts the container, or a slow compile,
# cut short and restarted from zero, would loop forever.
FIRST_START_BUDGET_S = 1800
# A pod whose worker is restarting must leave the Service within this many seconds.
READINESS_REACTION_MAX_S = 10
# Liveness must not restart a busy server that answers slowly for a moment.
LIVENESS_TOLERANCE_MIN_S = 30
# Below this the HPA removes pods a returning load needs again, minutes before a new one is ready.
SCALE_DOWN_STABILIZATION_MIN_S = 300
# LitServe 0.2.19 gives each inference worker this long to stop (litserve/server.py,
# _perform_graceful_shutdown: iw.join(timeout=5)) after the HTTP servers have drained.
LITSERVE_WORKER_JOIN_S = 5


def load_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def load_one(path: Path) -> dict:
    (doc,) = load_docs(path)
    return doc


def kustomization(directory: Path) -> dict:
    return load_one(directory / "kustomization.yaml")


def resource_files(directory: Path) -> list[Path]:
    return [directory / name for name in kustomization(directory)["resources"]]


def deployment() -> dict:
    return load_one(K8S / "deployment.yaml")


def pod_spec() -> dict:
    return deployment()["spec"]["template"]["spec"]


def container() -> dict:
    (only,) = pod_spec()["containers"]
    return only


def literal_env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in container()["env"] if "value" in e}


def config_file() -> Path:
    """The TOML file kustomize's configMapGenerator turns into the pods' config ConfigMap."""
    (generator,) = kustomization(K8S)["configMapGenerator"]
    (name,) = generator["files"]
    return K8S / name


def resolved_settings(environ: dict[str, str] | None = None) -> ServeSettings:
    """The settings a pod's server resolves: its config file under the Deployment's env vars."""
    environ = literal_env() if environ is None else environ
    return resolve_settings({}, environ, str(config_file())).settings


def mount_path(volume_name: str) -> str:
    (mount,) = [m for m in container()["volumeMounts"] if m["name"] == volume_name]
    return mount["mountPath"]


def volume(name: str) -> dict:
    (found,) = [v for v in pod_spec()["volumes"] if v["name"] == name]
    return found


def schema_errors(docs: list[dict], version: str) -> list[str]:
    errors = []
    for doc in docs:
        where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:  # an unknown kind is an error too
            errors.append(f"{where}: {exc.message}")
    return errors


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for doc in docs:
        kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


# ---- schemas and rendering -------------------------------------------------------------------------


def test_every_yaml_file_is_deployed_or_known():
    """A manifest that no kustomization lists and no test knows of would go unvalidated."""
    known = {*STANDALONE}
    for directory in (K8S, MONITORING, PER_POD_CACHE, CPU_COMPONENT, KEDA_COMPONENT):
        spec = kustomization(directory)
        known.add(directory / "kustomization.yaml")
        known.update(directory / name for name in spec.get("resources", []))
        known.update(directory / p["path"] for p in spec.get("patches", []) if "path" in p)
    found = {*K8S.rglob("*.yaml"), *K8S.rglob("*.yml")}
    assert found - known == set()
    assert known - found == set()


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifest_files_are_valid_kubernetes_objects(version):
    """Each file as written, without kubectl: what CI checks even where kustomize is missing."""
    paths = [*resource_files(K8S), *resource_files(MONITORING), K8S / "secret.example.yaml"]
    docs = [doc for path in paths for doc in load_docs(path)]
    assert len(docs) == len(paths)  # one object per file, none empty
    assert schema_errors(docs, version) == []


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kustomize_builds_valid_objects(version):
    docs = kustomize(K8S)
    assert schema_errors(docs, version) == []
    kinds = by_kind(docs)
    assert set(kinds) == {
        *("Namespace", "ConfigMap", "PersistentVolumeClaim", "Deployment"),
        *("Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"),
    }
    (namespace,) = kinds["Namespace"]
    assert {doc["metadata"].get("namespace") for doc in docs if doc["kind"] != "Namespace"} == {
        namespace["metadata"]["name"]
    }
    (rendered,) = kinds["Deployment"]
    spec = rendered["spec"]["template"]["spec"]
    (image,) = {c["image"] for c in spec["containers"]}
    (entry,) = kustomization(K8S)["images"]
    assert image == f"{entry['newName']}:{entry['newTag']}"
    # The generated ConfigMap's name carries a content hash; the volume must follow it.
    (config_map,) = kinds["ConfigMap"]
    assert config_file().name in config_map["data"]
    claims = {doc["metadata"]["name"] for doc in kinds["PersistentVolumeClaim"]}
    for item in spec["volumes"]:
        if "configMap" in item:
            assert item["configMap"]["name"] == config_map["metadata"]["name"]
        if "persistentVolumeClaim" in item:
            assert item["persistentVolumeClaim"]["claimName"] in claims


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_per_pod_cache_component_replaces_the_shared_volume(version, tmp_path):
    docs = kustomize_overlay(tmp_path / "overlay", K8S, [PER_POD_CACHE])
    assert schema_errors(docs, version) == []
    kinds = by_kind(docs)
    assert "PersistentVolumeClaim" not in kinds
    (rendered,) = kinds["Deployment"]
    (cache,) = [v for v in rendered["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache"]
    assert set(cache) == {"name", "emptyDir"}


def dockerfile_env(dockerfile: Path) -> dict[str, str]:
    """The ENV defaults a Dockerfile sets (``KEY=value`` pairs, quotes removed)."""
    pairs = [re.findall(r'(\w+)=("[^"]*"|\S+)', args) for args in instruction("ENV", dockerfile)]
    return {key: value.strip('"') for found in pairs for key, value in found}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_cpu_component_runs_the_cpu_images_own_default_artifact_without_a_gpu(version, tmp_path):
    image = {"name": "vision-serve-cpu", "newName": "registry.example.com/vision-serve-cpu", "newTag": "0.1.0"}
    docs = kustomize_overlay(tmp_path / "overlay", K8S, [CPU_COMPONENT], images=[image])
    assert schema_errors(docs, version) == []
    (rendered,) = by_kind(docs)["Deployment"]
    pod = rendered["spec"]["template"]["spec"]
    (serve,) = pod["containers"]
    assert serve["image"] == "registry.example.com/vision-serve-cpu:0.1.0"
    assert "nvidia.com/gpu" not in serve["resources"].get("limits", {}) and "tolerations" not in pod
    env = {e["name"]: e.get("value") for e in serve["env"]}
    image_env = dockerfile_env(K8S.parents[1] / "Dockerfile")
    for name in ("VISION_SERVE_ARTIFACT", "VISION_SERVE_COMPILE_ARGS"):
        assert env[name] == image_env[name], f"{name}: the component and the CPU image's default disagree"
    compile_cli.build_parser().parse_args(env["VISION_SERVE_COMPILE_ARGS"].split())  # compile-trt takes them
    # Only the GPU-specific parts changed: probes, security context and volumes are the base's.
    (base,) = [d for d in kustomize(K8S) if d["kind"] == "Deployment"]
    (base_serve,) = base["spec"]["template"]["spec"]["containers"]
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "securityContext", "volumeMounts"):
        assert serve[key] == base_serve[key], key


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_monitoring_kustomization_builds_valid_objects(version):
    docs = kustomize(MONITORING)
    assert schema_errors(docs, version) == []
    assert sorted(doc["kind"] for doc in docs) == ["ConfigMap", "ConfigMap"]


# ---- the pod and the server it runs ------------------------------------------------------------


def test_env_and_config_file_hold_only_real_settings_each_once():
    setting_env = {env_var(f.name) for f in fields(ServeSettings)}
    env_names = {e["name"] for e in container()["env"]}
    unknown = {name for name in env_names if name.startswith(_defaults.ENV_PREFIX)} - setting_env - NON_SETTING_ENV
    assert unknown == set()
    from_file = read_config_file(config_file())  # raises on an unknown key or a value of the wrong type
    # One source of truth: a setting in both places would silently take the env var's value.
    assert {env_var(name) for name in from_file} & env_names == set()
    settings = resolved_settings()  # runs the settings' own validation
    assert settings.host in ("0.0.0.0", "::"), "the Service cannot reach a server on loopback"
    assert settings.log_format == "json"


def test_config_file_and_artifact_paths_are_on_their_volumes():
    env = literal_env()
    (generator,) = kustomization(K8S)["configMapGenerator"]
    assert volume("config")["configMap"]["name"] == generator["name"]
    assert env[CONFIG_ENV] == f"{mount_path('config')}/{config_file().name}"
    # Compiled into the cache volume, so it outlives the pod (and, shared, serves every pod).
    assert Path(mount_path("cache")) in Path(env[env_var("artifact")]).parents


def test_api_key_comes_from_an_optional_secret():
    (api_key,) = [e for e in container()["env"] if e["name"] == env_var("api_key")]
    assert "value" not in api_key, "a key written into a manifest is a leaked key"
    assert api_key["valueFrom"]["secretKeyRef"]["optional"] is True
    secret = load_one(K8S / "secret.example.yaml")
    ref = api_key["valueFrom"]["secretKeyRef"]
    assert secret["metadata"]["name"] == ref["name"]
    assert ref["key"] in secret["stringData"]


def service_link_env(service: dict) -> dict[str, str]:
    """The docker-link variables the kubelet gives a pod for a Service of its namespace."""
    prefix = service["metadata"]["name"].upper().replace("-", "_")
    ip = "10.0.0.1"
    env = {f"{prefix}_SERVICE_HOST": ip}
    for i, port in enumerate(service["spec"]["ports"]):
        number, proto = port["port"], port.get("protocol", "TCP")
        link = f"{prefix}_PORT_{number}_{proto}"
        env |= {link: f"{proto.lower()}://{ip}:{number}", f"{link}_PROTO": proto.lower()}
        env |= {f"{link}_PORT": str(number), f"{link}_ADDR": ip}
        env[f"{prefix}_SERVICE_PORT_{port['name'].upper()}"] = str(number)
        if i == 0:
            env |= {f"{prefix}_SERVICE_PORT": str(number), f"{prefix}_PORT": f"{proto.lower()}://{ip}:{number}"}
    return env


def test_service_links_cannot_override_settings():
    """Unless told not to, Kubernetes gives a pod <SERVICE>_PORT=tcp://... for each Service of its
    namespace: for the Service "vision-serve" that is VISION_SERVE_PORT, which the server reads as
    its --port. The container's own env wins over those."""
    env = literal_env()
    if pod_spec().get("enableServiceLinks", True):
        env = service_link_env(load_one(K8S / "service.yaml")) | env
    assert resolved_settings(env).port == int(literal_env().get(env_var("port"), _defaults.PORT))


def test_compile_args_are_compile_trt_flags_covering_the_served_batch():
    env = literal_env()
    # As deploy/docker/entrypoint.sh runs it: the flags split on whitespace, then --output.
    argv = [*env["VISION_SERVE_COMPILE_ARGS"].split(), "--output", env[env_var("artifact")]]
    try:
        args = compile_cli.build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"compile-trt rejects {argv} (see its usage error above)")
    compile_settings = compile_cli.settings_from_args(args)
    # A smaller engine would make the server clamp its batches below max_batch_size.
    assert compile_settings.batch[2] >= resolved_settings().max_batch_size


def test_probes_use_the_servers_endpoints_on_the_service_port():
    service = load_one(K8S / "service.yaml")
    (port,) = service["spec"]["ports"]
    (container_port,) = [p for p in container()["ports"] if p["name"] == port["targetPort"]]
    assert container_port["containerPort"] == resolved_settings().port
    probes = {kind: container()[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {kind: probe["port"] for kind, probe in probes.items()} == dict.fromkeys(probes, port["targetPort"])
    assert probes["readinessProbe"]["path"] == "/ready"
    assert probes["livenessProbe"]["path"] == "/health"
    assert probes["startupProbe"]["path"] in ("/health", "/ready")
    for path in ("/ready", "/health", "/metrics"):
        assert path in server_routes(), f"the server has no {path} route"
    annotations = deployment()["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(container_port["containerPort"])
    assert annotations["prometheus.io/path"] == "/metrics"


def server_routes() -> set[str]:
    """The paths the HTTP processes answer, as service/http/routes.py registers them on an app."""
    from fastapi import FastAPI

    from service.http.process import HttpFrontEnd
    from service.http.routes import register_routes
    from service.settings import ServeSettings
    from service.transport.channels import ChannelConfig

    frontend = HttpFrontEnd(ServeSettings(), ChannelConfig("unused", 1), [0], [0], "test")
    app = FastAPI()
    register_routes(app, frontend, "/predict", {})
    return {route.path for route in app.routes}


def probe_window_s(probe: dict) -> int:
    """How long a probe keeps failing before the kubelet acts (defaults as in the Kubernetes API)."""
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def test_probe_timings_allow_the_first_start_and_react_to_a_restarting_worker():
    c = container()
    assert probe_window_s(c["startupProbe"]) >= FIRST_START_BUDGET_S
    assert probe_window_s(c["readinessProbe"]) <= READINESS_REACTION_MAX_S
    assert probe_window_s(c["livenessProbe"]) >= LIVENESS_TOLERANCE_MIN_S
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[kind].get("timeoutSeconds", 1) < c[kind].get("periodSeconds", 10)


def test_grace_period_covers_prestop_drain_and_worker_stop():
    from service.supervisor.server import CHILD_STOP_TIMEOUT_S

    command = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    (pre_stop_s,) = [float(arg) for arg in command[1:]]
    assert pre_stop_s >= 5, "too short for the endpoint removal to reach kube-proxy and ingresses"
    settings = resolved_settings()
    # After the sleep, SIGTERM: the HTTP servers answer what they hold (no request lives longer than
    # its deadline), then LitServe stops each worker, then vision-serve reaps its children.
    needed = (
        pre_stop_s
        + settings.request_timeout_s
        + LITSERVE_WORKER_JOIN_S * settings.workers_per_device
        + CHILD_STOP_TIMEOUT_S
    )
    assert pod_spec()["terminationGracePeriodSeconds"] >= needed


def test_pod_is_non_root_read_only_and_gets_one_gpu():
    namespace = load_one(K8S / "namespace.yaml")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    pod_security = pod_spec()["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    assert pod_security["runAsUser"] == IMAGE_UID
    assert pod_security["seccompProfile"]["type"] == "RuntimeDefault"
    security = container()["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    if security.get("readOnlyRootFilesystem"):
        # The server's Prometheus multiprocess files and torch's caches go to the temp dir.
        assert "emptyDir" in volume(next(m["name"] for m in container()["volumeMounts"] if m["mountPath"] == "/tmp"))
    shm = next(m["name"] for m in container()["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert volume(shm)["emptyDir"]["medium"] == "Memory"
    assert container()["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_service_pdb_and_hpa_point_at_the_deployment():
    labels = deployment()["spec"]["template"]["metadata"]["labels"]
    assert deployment()["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = load_one(K8S / "service.yaml")
    assert service["spec"]["selector"].items() <= labels.items()
    pdb = load_one(K8S / "pdb.yaml")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    target = load_one(K8S / "hpa.yaml")["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", "vision-serve")
    assert deployment()["metadata"]["name"] == target["name"]
    # With an HPA, a replica count in the Deployment would be reset by every `kubectl apply`.
    assert "replicas" not in deployment()["spec"]


# ---- autoscaling signal: server -> Prometheus -> prometheus-adapter -> HPA ------------------------


def hpa_metric() -> dict:
    (metric,) = load_one(K8S / "hpa.yaml")["spec"]["metrics"]
    assert metric["type"] == "Pods"
    return metric["pods"]


def adapter_rules() -> list[dict]:
    config_map = load_one(MONITORING / "prometheus-adapter-rules.yaml")
    return yaml.safe_load(config_map["data"]["config.yaml"])["rules"]


def go_replacement(template: str) -> str:
    """A Go regexp replacement ($1, ${1}) as a Python one."""
    return re.sub(r"\$\{?(\w+)\}?", r"\\g<\1>", template)


def adapter_exposes(rule: dict, series: str) -> str | None:
    """The custom metric name a prometheus-adapter rule serves for a series, if it selects it."""
    selected = re.match(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{", rule["seriesQuery"])
    if not selected or selected.group(1) != series:
        return None
    naming = rule.get("name", {})
    matches = naming.get("matches") or "^(.*)$"
    replacement = go_replacement(naming.get("as") or "$1")
    found = re.search(matches, series)
    return found.expand(replacement) if found else None


def test_hpa_scales_on_an_exported_metric_that_the_adapter_serves_per_pod():
    metric = hpa_metric()
    name = metric["metric"]["name"]
    assert name in metrics.METRIC_NAMES
    serving = [rule for rule in adapter_rules() if adapter_exposes(rule, name) == name]
    assert len(serving) == 1, f"prometheus-adapter serves {name} from {len(serving)} rules"
    (rule,) = serving
    overrides = rule["resources"]["overrides"]
    assert {label: o["resource"] for label, o in overrides.items()} == {"namespace": "namespace", "pod": "pod"}
    for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
        assert placeholder in rule["metricsQuery"]


def test_hpa_target_lies_between_one_batch_and_load_shedding():
    target = hpa_metric()["target"]
    assert target["type"] == "AverageValue"
    per_pod = float(target["averageValue"])
    settings = resolved_settings()
    # Below one batch a pod could never fill its batches; at max_queue it sheds load (503) before
    # the HPA would add a pod.
    assert settings.max_batch_size <= per_pod < settings.max_queue


def test_hpa_behaviour_scales_up_fast_and_down_slowly():
    spec = load_one(K8S / "hpa.yaml")["spec"]
    assert 1 <= spec["minReplicas"] < spec["maxReplicas"]
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= SCALE_DOWN_STABILIZATION_MIN_S
    assert spec["behavior"]["scaleUp"]["stabilizationWindowSeconds"] < SCALE_DOWN_STABILIZATION_MIN_S


# ---- KEDA instead of prometheus-adapter + HPA (components/keda) -----------------------------------


def keda_errors(doc: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(json.loads(KEDA_SCHEMA.read_text()))
    return [
        f"{'.'.join(map(str, error.absolute_path)) or '(root)'}: {error.message}"
        for error in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


def scaled_object() -> dict:
    return load_one(KEDA_COMPONENT / "scaledobject.yaml")


def test_keda_schema_says_where_it_came_from():
    schema = json.loads(KEDA_SCHEMA.read_text())
    source = schema["$comment"]
    assert "github.com/kedacore/keda v2.20.2 (commit " in source
    assert re.search(r"\(commit [0-9a-f]{40}\)", source)
    assert "keda.sh_scaledobjects.yaml" in source
    # Strict, as kubectl apply's default field validation: unknown fields are errors, not pruned.
    assert schema["additionalProperties"] is False
    assert schema["properties"]["spec"]["additionalProperties"] is False
    assert {"scaleTargetRef", "triggers"} <= set(schema["properties"]["spec"]["required"])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_keda_component_replaces_the_hpa_with_an_equivalent_scaled_object(version, tmp_path):
    docs = kustomize_overlay(tmp_path / "overlay", K8S, [KEDA_COMPONENT])
    kinds = by_kind(docs)
    # KEDA makes its own HPA from the ScaledObject; a second one on the Deployment would fight it.
    assert "HorizontalPodAutoscaler" not in kinds
    (scaled,) = kinds.pop("ScaledObject")
    assert schema_errors([doc for kind in kinds.values() for doc in kind], version) == []
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert keda_errors(scaled) == []
    (rendered,) = kinds["Deployment"]
    assert scaled["metadata"]["namespace"] == rendered["metadata"]["namespace"]
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", "vision-serve")
    assert target["name"] == rendered["metadata"]["name"]
    # The same bounds, signal, target and behaviour as hpa.yaml: both scale at the same load.
    hpa = load_one(K8S / "hpa.yaml")["spec"]
    assert spec["minReplicaCount"] >= 1, "no scale to zero: nothing would hold requests while a pod starts"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (hpa["minReplicas"], hpa["maxReplicas"])
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["behavior"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    # AverageValue: KEDA's HPA divides the query's value by the pods, as the HPA's per-pod average.
    assert trigger.get("metricType", "AverageValue") == "AverageValue"
    metadata = trigger["metadata"]
    assert float(metadata["threshold"]) == float(hpa_metric()["target"]["averageValue"])
    assert re.fullmatch(r"https?://[^/\s]+(/\S*)?", metadata["serverAddress"])
    query = metadata["query"]
    name = hpa_metric()["metric"]["name"]
    assert re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?=\{)", query) == [name]
    assert query.startswith("sum("), "the query must total the pods' requests, which the HPA then averages"
    assert f'namespace="{rendered["metadata"]["namespace"]}"' in query
    # Averaged over the same window as prometheus-adapter's rule.
    (rule,) = [r for r in adapter_rules() if adapter_exposes(r, name)]
    assert re.search(r"avg_over_time\(.*\[(\w+)\]", query).group(1) == re.search(
        r"avg_over_time\(.*\[(\w+)\]", rule["metricsQuery"]
    ).group(1)


# A change to the ScaledObject -> what KEDA's schema's error must name.
KEDA_BROKEN = {
    "trigger without a type": (("spec", "triggers", 0, "type"), None, "'type' is a required property"),
    "unknown spec field": (("spec", "minReplicas"), 1, "'minReplicas'"),
    "replica count as a string": (("spec", "maxReplicaCount"), "8", "not of type 'integer'"),
    "no scale target": (("spec", "scaleTargetRef"), None, "'scaleTargetRef' is a required property"),
}


@pytest.mark.parametrize("case", sorted(KEDA_BROKEN))
def test_keda_schema_rejects_a_broken_scaled_object(case):
    path, value, expected = KEDA_BROKEN[case]
    broken = copy.deepcopy(scaled_object())
    target = broken
    for key in path[:-1]:
        target = target[key]
    if value is None:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    assert keda_errors(scaled_object()) == []
    errors = keda_errors(broken)
    assert len(errors) == 1, errors
    assert expected in errors[0]


# ---- Prometheus scrape config --------------------------------------------------------------------


def scrape_config() -> dict:
    config_map = load_one(MONITORING / "prometheus-scrape-config.yaml")
    return yaml.safe_load(config_map["data"]["prometheus.yml"])


def scrape_job() -> dict:
    (job,) = scrape_config()["scrape_configs"]
    return job


def test_scrape_config_passes_promtool(tmp_path):
    promtool = require_tool("promtool")
    config = scrape_config()
    (job,) = config["scrape_configs"]
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    # Debian's promtool (what CI installs) is built without Kubernetes discovery and rejects its
    # block; a static target stands in for it so that everything else, relabel regexes included, is
    # checked. The discovery block itself is checked just above.
    job["static_configs"] = [{"targets": ["10.0.0.1:8000"]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def relabel(labels: dict[str, str], configs: list[dict]) -> dict[str, str] | None:
    """Prometheus's relabelling (replace, keep, drop: what the job uses); None: target dropped."""
    labels = dict(labels)
    for config in configs:
        action = config.get("action", "replace")
        assert action in ("replace", "keep", "drop"), f"relabel() does not model {action}"
        value = config.get("separator", ";").join(labels.get(name, "") for name in config.get("source_labels", []))
        found = re.fullmatch(config.get("regex", "(.*)"), value)
        if (action == "keep" and not found) or (action == "drop" and found):
            return None
        if action == "replace" and found:
            result = found.expand(go_replacement(config.get("replacement", "$1")))
            if result:
                labels[config["target_label"]] = result
            else:
                labels.pop(config["target_label"], None)
    return labels


def discovered_target(pod_ip: str, annotations: dict[str, str]) -> dict[str, str]:
    """What kubernetes_sd role pod gives for the Deployment's pod (the labels the job reads)."""
    port = container()["ports"][0]["containerPort"]
    address = f"[{pod_ip}]:{port}" if ":" in pod_ip else f"{pod_ip}:{port}"
    labels = {
        "__address__": address,
        "__metrics_path__": "/metrics",
        "__meta_kubernetes_namespace": "vision-serve",
        "__meta_kubernetes_pod_name": "vision-serve-7d9f-abcde",
        "__meta_kubernetes_pod_ip": pod_ip,
        "__meta_kubernetes_pod_container_port_number": str(port),
    }
    for key, value in annotations.items():
        labels["__meta_kubernetes_pod_annotation_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
    return labels


@pytest.mark.parametrize(("pod_ip", "address"), [("10.4.2.7", "10.4.2.7:8000"), ("fd00::2a", "[fd00::2a]:8000")])
def test_scrape_job_scrapes_the_annotated_pod_with_the_labels_the_adapter_maps(pod_ip, address):
    annotations = deployment()["spec"]["template"]["metadata"]["annotations"]
    target = relabel(discovered_target(pod_ip, annotations), scrape_job()["relabel_configs"])
    assert target is not None, "the job drops the vision-serve pod"
    assert target["__address__"] == address
    assert target["__metrics_path__"] == annotations["prometheus.io/path"]
    (rule,) = [r for r in adapter_rules() if adapter_exposes(r, hpa_metric()["metric"]["name"])]
    for label in rule["resources"]["overrides"]:
        assert target[label], f"series lack the {label} label the adapter maps"
    unannotated = discovered_target(pod_ip, {})
    assert relabel(unannotated, scrape_job()["relabel_configs"]) is None


def test_service_monitor_scrapes_the_service_port():
    """No schema for the CRD here: the fields Prometheus-Operator needs, checked by hand."""
    monitor = load_one(SERVICE_MONITOR)
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    service = load_one(K8S / "service.yaml")
    assert monitor["metadata"]["namespace"] == kustomization(K8S)["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"}
