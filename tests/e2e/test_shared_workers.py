"""Many models in one worker process, for real (issue 62): a repository of EfficientNet-Lite0 copies
served by one shared worker process, a model with ``isolation = "process"`` in a process of its own,
loads and unloads of other models while two models take a steady stream of requests (none fails),
a model that fails to load beside healthy ones (only its load fails), and the shared process killed:
every model it held is loaded again in a new one.
"""

from __future__ import annotations

import shutil
import threading
from collections import Counter

import httpx
import psutil
import pytest

from service.client.launcher import ServerProcess
from tests.conftest import inference_workers
from tests.worker_hold import wait_until

pytestmark = pytest.mark.slow

ADMIN_KEY = "admin-key-for-shared-tests-0123"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SHARED = ("lite", "pets", "birds")


@pytest.fixture(scope="module")
def repository(tmp_path_factory, lite0_eager_artifact):
    root = tmp_path_factory.mktemp("shared-repository")
    for name in (*SHARED, "alone"):
        shutil.copytree(lite0_eager_artifact, root / name / "1")
    (root / "alone" / "config.toml").write_text('isolation = "process"\n')
    return root


@pytest.fixture(scope="module")
def server(repository, tmp_path_factory):
    args = ["--model-repository", str(repository), "--model-control", "explicit", "--workers-per-device", "1"]
    args += ["--request-timeout-s", "120"]
    env = {"VISION_SERVE_ADMIN_API_KEY": ADMIN_KEY}
    with ServerProcess(args, log_path=tmp_path_factory.mktemp("log") / "server.log", env=env) as running:
        yield running
        family = psutil.Process(running.process.pid).children(recursive=True)
        assert running.stop() == 0
        survivors = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not survivors, [p.cmdline() for p in survivors]


def predict(server, image: bytes, model: str) -> httpx.Response:
    return httpx.post(f"{server.url}/predict?model={model}", content=image, timeout=120)


def admin(server, path: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/repository/{path}", headers=ADMIN, timeout=600)


def test_the_shared_models_live_in_one_process_and_the_isolated_one_in_its_own(server, coffee_jpeg) -> None:
    assert len(inference_workers(server)) == 2, "one shared worker process, and the isolated model's"
    for name in (*SHARED, "alone"):
        answer = predict(server, coffee_jpeg, name).json()
        assert (answer["model"], answer["predictions"][0]["label"]) == (name, "espresso")


def test_loads_and_a_failed_load_beside_a_stream_of_requests_fail_none_of_them(
    server, repository, coffee_jpeg, chelsea_jpeg
) -> None:
    shared_pid = {p.pid for p in inference_workers(server)}
    answers: Counter = Counter()
    stop = threading.Event()

    def stream(model: str, image: bytes) -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                response = client.post(f"{server.url}/predict?model={model}", content=image)
                top = response.json()["predictions"][0]["label"] if response.status_code == 200 else ""
                answers[(model, response.status_code, top)] += 1

    clients = [threading.Thread(target=stream, args=args) for args in (("lite", coffee_jpeg), ("pets", chelsea_jpeg))]
    for client in clients:
        client.start()
    try:
        broken = repository / "broken" / "1"
        shutil.copytree(repository / "lite" / "1", broken)
        engine = broken / "state_dict.pt"
        engine.write_bytes(engine.read_bytes()[: engine.stat().st_size // 4])
        failed = admin(server, "models/broken/load")
        assert failed.status_code == 400 and "broken" in failed.json()["error"]
        shutil.copytree(repository / "lite" / "1", repository / "late" / "1")
        assert admin(server, "models/late/load").status_code == 200, "a model added while serving"
        assert predict(server, coffee_jpeg, "late").json()["predictions"][0]["label"] == "espresso"
        assert admin(server, "models/birds/unload").status_code == 200
        assert predict(server, coffee_jpeg, "birds").status_code == 404
        assert admin(server, "models/birds/load").status_code == 200
    finally:
        stop.set()
        for client in clients:
            client.join()
    assert all(code == 200 for _, code, _ in answers), answers
    assert {model for model, _, _ in answers} == {"lite", "pets"}, answers
    assert len(answers) == 2, f"each model answered its image the same way throughout: {answers}"
    assert {p.pid for p in inference_workers(server)} == shared_pid, "loads and unloads start no process"


def test_a_killed_shared_process_comes_back_with_every_model_it_held(server, coffee_jpeg) -> None:
    processes = inference_workers(server)
    before = {p.pid for p in processes}
    # The shared process runs a loop, a heartbeat and a socket thread per model: the most threads.
    shared = max(processes, key=lambda process: process.num_threads())
    served = sorted({entry["name"] for entry in admin(server, "index").json() if entry["state"] == "READY"})
    shared.kill()

    def all_answer() -> bool:
        # /ready alone would not do: until the restarter sees the death, the table still says ready.
        return all(predict(server, coffee_jpeg, name).status_code == 200 for name in served)

    wait_until(lambda: shared.pid not in {p.pid for p in inference_workers(server)}, "the killed process was reaped")
    wait_until(all_answer, "every model the killed process held answers again", timeout=180)
    after = {p.pid for p in inference_workers(server)}
    assert len(after) == 2 and len(after - before) == 1, "only the killed process was replaced"
    assert {"lite", "pets", "alone"} <= set(served)
    for name in served:
        answer = predict(server, coffee_jpeg, name)
        assert answer.status_code == 200 and answer.json()["predictions"][0]["label"] == "espresso", name
