"""The deployment files: Dockerfile, Dockerfile.gpu, deploy/docker/entrypoint.sh, docker-compose.yml,
Prometheus, Grafana.

Checked here without a container engine or GPU, with the tools their runtimes use (hadolint, the
compose-spec schema, promtool), the dashboard's and alerts' queries against the metrics the server exports;
the entrypoint script runs outside a container in tests/e2e/test_docker_entrypoint.py, and both images are
built and run with podman in tests/container/ (the slow tier).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from service.metrics import METRIC_NAMES, metrics
from tests.tools import require_tool

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile.gpu"
CPU_DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT = ROOT / "deploy/docker/entrypoint.sh"
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS_CONFIG = ROOT / "deploy/prometheus/prometheus.yml"
ALERTS = ROOT / "deploy/prometheus/alerts.yml"
GRAFANA = ROOT / "deploy/grafana"
DASHBOARD = GRAFANA / "dashboards/vision-serve.json"

# The console scripts (vision-serve, compile-trt) of the environment running the tests.
# Names in queries that are not vision-serve's: Prometheus' own per-target series.
PROMETHEUS_SERIES = {"up"}
# The routes the server answers without a key (spec: GET /health, /ready, /metrics).
PROBE_ROUTES = {"/health", "/ready", "/metrics"}


# ---- what the server exports ---------------------------------------------------------------------


def exported_series() -> set[str]:
    """Every series name a scrape can hold: METRIC_NAMES, plus _bucket/_sum/_count for the histograms."""
    histograms = {family.name for family in metrics().registry.collect() if family.type == "histogram"}
    assert histograms, "service.metrics defines no histogram: the stage and batch-size histograms are gone?"
    names = set(METRIC_NAMES)
    for name in histograms:
        assert name in names, f"histogram {name} is missing from service.metrics.METRIC_NAMES"
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def metric_names_in(expr: str) -> set[str]:
    """The vision-serve metric names a PromQL expression uses (our metrics share the prefix)."""
    return set(re.findall(r"\bvision_serve_[a-z0-9_]+\b", expr))


def check_query_names(where: str, expr: str, allowed: set[str]) -> None:
    used = metric_names_in(expr)
    assert used or any(re.search(rf"\b{name}\b", expr) for name in PROMETHEUS_SERIES), f"{where}: no metric in {expr!r}"
    unknown = used - allowed
    assert not unknown, f"{where}: {sorted(unknown)} are not metrics the server exports (service.metrics)"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) for every query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def grafana_to_promql(expr: str) -> str:
    """Grafana fills $__rate_interval in before the query reaches Prometheus."""
    return expr.replace("$__rate_interval", "1m")


# ---- Dockerfile ------------------------------------------------------------------------------------


def dockerfile_instructions(dockerfile: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(
        r"\\\n", " ", "\n".join(line for line in dockerfile.read_text().splitlines() if not line.startswith("#"))
    )
    return [tuple(line.strip().split(None, 1)) for line in joined.splitlines() if line.strip()]  # type: ignore[misc]


def instruction(name: str, dockerfile: Path = DOCKERFILE) -> list[str]:
    return [args for op, args in dockerfile_instructions(dockerfile) if op == name]


def dockerfile_healthcheck(dockerfile: Path = DOCKERFILE) -> list[str]:
    (args,) = instruction("HEALTHCHECK", dockerfile)
    return json.loads(args.split(" CMD ", 1)[1])


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, CPU_DOCKERFILE], ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path, tmp_path: Path) -> None:
    hadolint = require_tool("hadolint")
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    # The control: this hadolint really lints (an unpinned base image and a root user fail).
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install -y curl\n")
    assert subprocess.run([hadolint, str(bad)], capture_output=True, timeout=60).returncode != 0


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, CPU_DOCKERFILE], ids=lambda p: p.name)
def test_dockerfile_runs_the_entrypoint_as_a_fixed_non_root_user_with_state_on_a_volume(dockerfile: Path) -> None:
    (entrypoint,) = instruction("ENTRYPOINT", dockerfile)
    (script,) = json.loads(entrypoint)
    assert script == "/opt/vision-serve/deploy/docker/entrypoint.sh"
    copies = " ".join(instruction("COPY", dockerfile))
    assert "deploy/docker/entrypoint.sh" in copies
    # COPY keeps the file mode: the script must be executable in the checkout (and so in git).
    assert os.access(ENTRYPOINT, os.X_OK), f"{ENTRYPOINT} is not executable (chmod +x, and commit the mode)"

    (user,) = instruction("USER", dockerfile)
    args = dict(a.split("=", 1) for op, a in dockerfile_instructions(dockerfile) if op == "ARG" and "=" in a)
    uid = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], user).split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, f"USER {user}: a numeric non-root UID (runAsNonRoot checks it)"

    (volume,) = instruction("VOLUME", dockerfile)
    (volume_path,) = json.loads(volume)
    env = " ".join(instruction("ENV", dockerfile))
    assert f"TORCH_HOME={volume_path}/" in env, "the torch hub cache (weights) belongs on the volume"
    assert "VISION_SERVE_HOST=0.0.0.0" in env and "VISION_SERVE_LOG_FORMAT=json" in env
    assert instruction("STOPSIGNAL", dockerfile) == ["SIGTERM"]
    # The base is an ARG, so that CI builds on a base made here and users on theirs.
    (base,) = instruction("FROM", dockerfile)
    assert base == "${BASE_IMAGE}" and "BASE_IMAGE" in args, base


def test_build_context_is_an_allowlist_of_what_the_dockerfiles_copy() -> None:
    """A checkout's .venv and artifacts are GBs: .dockerignore lets through only what COPY names."""
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    rules = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert rules[0] == "*", "the context starts empty; each copied path is let through by a ! rule"
    allowed = [rule[1:].rstrip("/") for rule in rules if rule.startswith("!")]
    for dockerfile in (DOCKERFILE, CPU_DOCKERFILE):
        for args in instruction("COPY", dockerfile):
            for source in args.split()[:-1]:
                if source.startswith("--"):
                    continue
                assert any(source == a or source.startswith(a + "/") for a in allowed), (
                    f"{dockerfile.name} copies {source}, which .dockerignore keeps out of the context: add !{source}"
                )


# ---- docker-compose.yml ----------------------------------------------------------------------------


def test_compose_file_matches_the_compose_spec(tmp_path: Path) -> None:
    checker = require_tool("check-jsonschema")
    command = [checker, "--builtin-schema", "vendor.compose-spec"]
    result = subprocess.run([*command, str(COMPOSE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    # The control: a misspelt key fails the schema.
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE.read_text().replace("stop_grace_period:", "stop_grace_periode:"))
    assert subprocess.run([*command, str(bad)], capture_output=True, timeout=60).returncode != 0


def mounts(service: dict) -> dict[str, str]:
    """{container path: volume name or host path} of a service's short-syntax volumes."""
    return {entry.split(":")[1]: entry.split(":")[0] for entry in service.get("volumes", [])}


def seconds(duration: str) -> float:
    units = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))


def test_compose_wires_the_gpu_volume_stop_and_monitoring() -> None:
    spec = compose()
    services = spec["services"]
    serve = services["vision-serve"]
    assert (ROOT / serve["build"]["context"] / serve["build"]["dockerfile"]).resolve() == DOCKERFILE
    devices = serve["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device["capabilities"] for device in devices)
    assert serve["init"] is True, "an init as PID 1 forwards SIGTERM and reaps orphans"
    # The grace period covers a request admitted just before SIGTERM (the request timeout) and the workers' stop.
    timeout = float(serve["environment"].get("VISION_SERVE_REQUEST_TIMEOUT_S", 30))
    assert seconds(serve["stop_grace_period"]) >= timeout + 10
    assert serve.get("stop_signal", "SIGTERM") == "SIGTERM"

    # The artifact is compiled onto the named volume, where the image keeps its state.
    (volume_path,) = json.loads(instruction("VOLUME")[0])
    assert mounts(serve)[volume_path] in spec["volumes"], "the artifacts need a named volume"
    assert serve["environment"]["VISION_SERVE_ARTIFACT"].startswith(volume_path + "/")
    compile_args = shlex.split(serve["environment"]["VISION_SERVE_COMPILE_ARGS"])
    from compile.cli import build_parser

    parsed = build_parser().parse_args(compile_args)  # compile-trt accepts them (SystemExit otherwise)
    assert parsed.batch[2] >= int(serve["environment"].get("VISION_SERVE_MAX_BATCH_SIZE", 32))

    # Every file a service mounts from the repository exists, and the configs meet where they point.
    for name, service in services.items():
        for source in mounts(service).values():
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is missing"
    prometheus = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == "vision-serve"]
    (target,) = job["static_configs"][0]["targets"]
    assert target == f"vision-serve:{serve['ports'][0].split(':')[-1]}"
    assert job.get("metrics_path", "/metrics") in PROBE_ROUTES

    grafana_mounts = {source: target for target, source in mounts(services["grafana"]).items()}
    (datasource,) = yaml.safe_load(next((GRAFANA / "provisioning/datasources").glob("*.yml")).read_text())[
        "datasources"
    ]
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in services
    (provider,) = yaml.safe_load(next((GRAFANA / "provisioning/dashboards").glob("*.yml")).read_text())["providers"]
    assert grafana_mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert grafana_mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


def test_healthchecks_probe_routes_the_server_answers_without_a_key() -> None:
    checks = [(path.name, dockerfile_healthcheck(path)) for path in (DOCKERFILE, CPU_DOCKERFILE)]
    for where, command in [*checks, ("compose", compose_healthcheck())]:
        paths = set(re.findall(r"https?://[^/'\"]+(/[\w/]*)", " ".join(command)))
        assert paths and paths <= PROBE_ROUTES, f"{where} HEALTHCHECK probes {paths}"


def compose_healthcheck() -> list[str]:
    test = compose()["services"]["vision-serve"]["healthcheck"]["test"]
    assert test[0] == "CMD", "exec form: the image has no need for a shell in the probe"
    return test[1:]


# ---- Prometheus --------------------------------------------------------------------------------------


def test_prometheus_config_and_alert_rules_pass_promtool() -> None:
    promtool = require_tool("promtool")
    for command in (["check", "config", str(PROMETHEUS_CONFIG)], ["check", "rules", str(ALERTS)]):
        result = subprocess.run([promtool, *command], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    assert "alerts.yml" in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["rule_files"]


def test_alert_rules_use_only_exported_metrics() -> None:
    allowed = exported_series()
    rules = alert_rules()
    assert rules
    for rule in rules:
        check_query_names(f"alert {rule['alert']}", rule["expr"], allowed)


# Synthetic series per alert (promtool's expanding notation: 'a+bxN'), the time it fires at, and what
# its templates render to. The healthy box below fires none of them.
INSTANCE = {"job": "vision-serve", "instance": "vision-serve:8000"}
FIRING = {
    "VisionServeDown": ([("up", "0x20")], "6m", INSTANCE, {"instance": "vision-serve:8000"}),
    "VisionServeNotReady": (
        [
            ('vision_serve_workers{state="ready"}', "0x20"),
            ('vision_serve_workers{state="starting"}', "1x20"),
            ("up", "1x20"),
        ],
        "6m",
        {"instance": "vision-serve:8000"},
        {"instance": "vision-serve:8000"},
    ),
    "VisionServeErrorRatioHigh": (
        [
            ('vision_serve_requests_total{code="200"}', "0+80x20"),
            ('vision_serve_requests_total{code="503"}', "0+20x20"),
        ],
        "12m",
        {},
        {"value_percentage": "20%"},
    ),
    "VisionServeLatencyP99High": (
        [
            ('vision_serve_stage_duration_seconds_bucket{stage="total",le="1"}', "0x30"),
            ('vision_serve_stage_duration_seconds_bucket{stage="total",le="2"}', "0+100x30"),
            ('vision_serve_stage_duration_seconds_bucket{stage="total",le="+Inf"}', "0+100x30"),
        ],
        "17m",
        {},
        {"value_duration": "1.99s"},
    ),
    "VisionServeSaturated": (
        [("vision_serve_requests_in_flight", "240x10"), ("vision_serve_requests_in_flight_limit", "256x10")],
        "3m",
        {"instance": "vision-serve:8000"},
        {"instance": "vision-serve:8000", "value_percentage": "93.75%"},
    ),
    "VisionServeRequestsExpiring": ([("vision_serve_requests_expired_total", "0+6x20")], "12m", {}, {}),
    "VisionServeWorkerRestarted": (
        [("vision_serve_worker_restarts_total", "0 0 1 1 1")],
        "3m",
        INSTANCE,
        {"instance": "vision-serve:8000"},
    ),
    "VisionServeGpuMemoryHigh": (
        [
            ('vision_serve_gpu_memory_used_bytes{device="cuda:0"}', "78000000000x20"),
            ('vision_serve_gpu_memory_total_bytes{device="cuda:0"}', "80000000000x20"),
        ],
        "12m",
        {"instance": "vision-serve:8000", "device": "cuda:0"},
        {"device": "cuda:0", "value_percentage": "97.5%"},
    ),
}
HEALTHY = [
    ("up", "1x30"),
    ('vision_serve_workers{state="ready"}', "1x30"),
    ('vision_serve_requests_total{code="200"}', "0+600x30"),
    ('vision_serve_requests_total{code="503"}', "0+1x30"),
    ('vision_serve_stage_duration_seconds_bucket{stage="total",le="0.05"}', "0+600x30"),
    ('vision_serve_stage_duration_seconds_bucket{stage="total",le="+Inf"}', "0+601x30"),
    ("vision_serve_requests_in_flight", "12x30"),
    ("vision_serve_requests_in_flight_limit", "256x30"),
    ("vision_serve_requests_expired_total", "0x30"),
    ("vision_serve_worker_restarts_total", "0x30"),
    ('vision_serve_gpu_memory_used_bytes{device="cuda:0"}', "40000000000x30"),
    ('vision_serve_gpu_memory_total_bytes{device="cuda:0"}', "80000000000x30"),
]


def series(name: str) -> str:
    """Adds the scrape's job and instance labels to a series selector."""
    labels = ",".join(f'{k}="{v}"' for k, v in INSTANCE.items())
    return f"{name[:-1]},{labels}}}" if name.endswith("}") else f"{name}{{{labels}}}"


def render(template: str, labels: dict[str, str], values: dict[str, str]) -> str:
    """The few Go-template forms alerts.yml uses, as Prometheus renders them."""
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], template)
    text = text.replace("{{ $value | humanizePercentage }}", values.get("value_percentage", "?"))
    return text.replace("{{ $value | humanizeDuration }}", values.get("value_duration", "?"))


def test_alert_rules_fire_on_synthetic_series_and_stay_quiet_on_a_healthy_box(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    rules = {rule["alert"]: rule for rule in alert_rules()}
    assert set(rules) == set(FIRING), "every alert needs a case here"
    tests = []
    for name, (inputs, at, extra_labels, rendered) in FIRING.items():
        labels = {**extra_labels, **rules[name].get("labels", {})}
        annotations = {k: render(v, rendered, rendered) for k, v in rules[name].get("annotations", {}).items()}
        tests.append(
            {
                "interval": "1m",
                "input_series": [{"series": series(s), "values": v} for s, v in inputs],
                "alert_rule_test": [
                    {
                        "eval_time": at,
                        "alertname": name,
                        "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}],
                    }
                ],
            }
        )
    tests.append(
        {
            "interval": "1m",
            "input_series": [{"series": series(s), "values": v} for s, v in HEALTHY],
            "alert_rule_test": [{"eval_time": "25m", "alertname": name, "exp_alerts": []} for name in FIRING],
        }
    )
    unit = tmp_path / "alerts_test.yml"
    unit.write_text(json.dumps({"rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run([promtool, "test", "rules", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- Grafana -------------------------------------------------------------------------------------------


def test_dashboard_queries_parse_and_use_only_exported_metrics(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    allowed = exported_series()
    queries = dashboard_queries()
    for title, expr in queries:
        check_query_names(f"panel {title!r}", expr, allowed)
    # Every metric the server exports is on the dashboard somewhere.
    shown = {name for _, expr in queries for name in metric_names_in(expr)}
    missing = {name for name in METRIC_NAMES if not any(s == name or s.startswith(name + "_") for s in shown)}
    assert not missing, f"metrics with no panel: {sorted(missing)}"
    # promtool parses PromQL in recording rules: one rule per query.
    rules = [{"record": f"dashboard:query_{i}", "expr": grafana_to_promql(expr)} for i, (_, expr) in enumerate(queries)]
    rule_file = tmp_path / "dashboard_queries.yml"
    rule_file.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(rule_file)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_panels_use_the_provisioned_datasource_and_cover_the_issue() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    (datasource,) = yaml.safe_load(next((GRAFANA / "provisioning/datasources").glob("*.yml")).read_text())[
        "datasources"
    ]
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        for ref in [panel.get("datasource"), *(t.get("datasource") for t in panel.get("targets", []))]:
            assert ref == {"type": "prometheus", "uid": datasource["uid"]}, f"panel {panel['title']!r}: {ref}"
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
    exprs = " ".join(expr for _, expr in dashboard_queries())
    # What issue 7 asks the dashboard to show.
    assert "histogram_quantile(0.99" in exprs and "histogram_quantile(0.5" in exprs
    assert "sum by (code)" in exprs and "sum by (le, stage)" in exprs
    assert any(panel["type"] == "heatmap" for panel in panels)


# ---- deploy/docker/entrypoint.sh, run outside Docker -------------------------------------------------
