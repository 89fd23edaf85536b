"""A repository served on demand under a memory budget, for real (issue 62): three copies of
EfficientNet-Lite0 and a budget that holds one (``--memory-budget-mib 1``: a budget below one model
serves one at a time). A request for a model that is not resident loads it (its answer's
Server-Timing and gRPC parameters say how long it waited), the least recently used idle model is
evicted, requests for every model at once are all answered, and with ``--model-control explicit`` a
load over the budget is refused (nothing evicted, as Triton does).
"""

from __future__ import annotations

import shutil
import threading
from collections import Counter

import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as triton_grpc
from prometheus_client.parser import text_string_to_metric_families

from service.client.launcher import ServerProcess, free_port
from tests.conftest import inference_workers

pytestmark = pytest.mark.slow

MODELS = ("a", "b", "c")
ADMIN_KEY = "admin-key-for-on-demand-tests-01"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def repository(tmp_path_factory, lite0_eager_artifact):
    root = tmp_path_factory.mktemp("on-demand-repository")
    for name in MODELS:
        shutil.copytree(lite0_eager_artifact, root / name / "1")
    return root


def serve(repository, log_dir, *extra: str) -> ServerProcess:
    args = ["--model-repository", str(repository), "--memory-budget-mib", "1", "--workers-per-device", "1"]
    args += ["--request-timeout-s", "60", *extra]
    return ServerProcess(args, log_path=log_dir / "server.log", env={"VISION_SERVE_ADMIN_API_KEY": ADMIN_KEY})


@pytest.fixture(scope="module")
def grpc_port():
    return free_port()


@pytest.fixture(scope="module")
def server(repository, grpc_port, tmp_path_factory):
    with serve(repository, tmp_path_factory.mktemp("log"), "--grpc-port", str(grpc_port)) as running:
        yield running
        family = psutil.Process(running.process.pid).children(recursive=True)
        assert running.stop() == 0
        survivors = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not survivors, [p.cmdline() for p in survivors]


def predict(server, image: bytes, model: str) -> httpx.Response:
    return httpx.post(f"{server.url}/predict?model={model}", content=image, timeout=120)


def resident(server) -> set[str]:
    """The models whose versions serve now, by the OIP model-ready endpoint."""
    return {m for m in MODELS if httpx.get(f"{server.url}/v2/models/{m}/ready", timeout=10).status_code == 200}


def counter(server, name: str, model: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text)
    return sum(
        sample.value
        for family in families
        for sample in family.samples
        if sample.name == name and sample.labels.get("model") == model
    )


def load_ms(response: httpx.Response) -> float | None:
    """The ``model_load`` entry of the answer's Server-Timing, None when it has none."""
    for entry in response.headers["server-timing"].split(","):
        name, _, duration = entry.strip().partition(";dur=")
        if name == "model_load":
            return float(duration)
    return None


def test_a_model_not_resident_loads_on_its_request_and_evicts_the_idle_one(server, coffee_jpeg) -> None:
    before = resident(server)
    assert len(before) == 1, before  # the budget holds one: the others wait in the repository
    (current,) = before
    other = next(m for m in MODELS if m not in before)
    first = predict(server, coffee_jpeg, current)
    assert first.status_code == 200 and load_ms(first) is None  # resident: no wait
    evictions = counter(server, "vision_serve_model_evictions_total", current)

    answer = predict(server, coffee_jpeg, other)
    assert answer.status_code == 200, answer.text
    assert load_ms(answer) is not None and load_ms(answer) > 0  # it waited for its load, and says so
    assert answer.json()["predictions"][0]["label"] == first.json()["predictions"][0]["label"]  # the same weights
    assert resident(server) == {other}  # the idle one made room
    assert counter(server, "vision_serve_model_evictions_total", current) == evictions + 1
    assert counter(server, "vision_serve_model_loads_on_demand_total", other) >= 1

    again = predict(server, coffee_jpeg, other)  # resident now: as fast as any resident model
    assert again.status_code == 200 and load_ms(again) is None
    assert len(inference_workers(server)) == 1  # every model in the one shared worker process


def test_an_explicit_load_over_the_budget_is_refused_and_evicts_nothing(repository, tmp_path_factory) -> None:
    # The repository API is explicit mode's; there, the budget refuses a load instead of evicting.
    with serve(repository, tmp_path_factory.mktemp("log"), "--model-control", "explicit") as explicit:
        unload = httpx.post(f"{explicit.url}/v2/repository/models/b/unload", headers=ADMIN, timeout=120)
        assert unload.status_code == 200, unload.text
        load = httpx.post(f"{explicit.url}/v2/repository/models/b/load", headers=ADMIN, timeout=120)
        assert load.status_code == 400 and "--memory-budget-mib" in load.json()["error"], load.text
        index = httpx.post(f"{explicit.url}/v2/repository/index", headers=ADMIN, timeout=30).json()
        assert {e["name"]: e["state"] for e in index} == {"a": "READY", "b": "UNAVAILABLE", "c": "READY"}
        assert {e["reason"] for e in index if e["name"] == "b"} == {"unloaded"}


def test_grpc_says_how_long_a_call_waited_for_its_model(server, grpc_port, coffee_jpeg) -> None:
    parked = next(m for m in MODELS if m not in resident(server))
    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        tensor = triton_grpc.InferInput("IMAGE", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([coffee_jpeg], dtype=np.object_))
        result = client.infer(parked, [tensor], client_timeout=120)
        waited = result.get_response().parameters["model_load_ms"].double_param
        assert waited > 0
        again = client.infer(parked, [tensor], client_timeout=120)
        assert "model_load_ms" not in again.get_response().parameters
    finally:
        client.close()


def test_requests_for_every_model_at_once_are_all_answered(server, coffee_jpeg) -> None:
    # One resident at a time: each model's stream waits for the one before it to go idle, then
    # evicts it. Nothing fails on the way.
    statuses: Counter[int] = Counter()
    labels: set[str] = set()
    lock = threading.Lock()

    def stream(model: str) -> None:
        for _ in range(4):
            response = predict(server, coffee_jpeg, model)
            with lock:
                statuses[response.status_code] += 1
                if response.status_code == 200:
                    labels.add(response.json()["predictions"][0]["label"])

    threads = [threading.Thread(target=stream, args=(m,)) for m in MODELS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == {200: 4 * len(MODELS)}, statuses
    assert len(labels) == 1  # every model answered, with the same weights
