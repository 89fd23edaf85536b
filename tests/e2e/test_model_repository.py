"""A model repository served for real: two models side by side with their own labels, Triton's
repository API through ``tritonclient`` (HTTP and gRPC), a version swap during a live stream of
requests, a failed load that leaves the old version serving, and the admin key.

The repository holds compile-trt artifacts as a user would make them: EfficientNet-Lite0 with
ImageNet weights as ``lite`` (versions 1 and 2, and a corrupt 3) and the fine-tuned four-class model
of tests/finetuned.py as ``pets``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from service.client.launcher import ServerProcess, free_port
from tests.conftest import compile_eager, inference_workers
from tests.finetuned import LABELS, make_finetuned
from tests.worker_hold import in_flight, wait_until

# Two compiles, a fine-tune, one server and about five loads of 10-20 s each on 2 cores.
pytestmark = pytest.mark.slow

ADMIN_KEY = "admin-key-for-tests-0123"
API_KEY = "inference-key-for-tests-4567"
INFERENCE = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def headers(which: dict) -> dict:
    """A fresh copy: tritonclient adds its own headers to the dict it is given."""
    return dict(which)


@pytest.fixture(scope="module")
def repository(tmp_path_factory, lite0_eager_artifact):
    root = tmp_path_factory.mktemp("repository")
    finetuned = make_finetuned(tmp_path_factory.mktemp("finetuned"))
    for version in (1, 2):
        shutil.copytree(lite0_eager_artifact, root / "lite" / str(version))
    corrupt = root / "lite" / "3"
    shutil.copytree(root / "lite" / "1", corrupt)
    engine = corrupt / "state_dict.pt"
    engine.write_bytes(engine.read_bytes()[: engine.stat().st_size // 4])  # a truncated copy
    (root / "lite" / "config.toml").write_text("version_policy = {specific = [1]}\nmax_batch_size = 8\n")
    compile_eager(
        root / "pets" / "1",
        "--model",
        "efficientnet-lite0",
        "--weights",
        str(finetuned.weights),
        "--labels",
        str(finetuned.labels),
    )
    return root, finetuned


@pytest.fixture(scope="module")
def server(repository, tmp_path_factory):
    root, _ = repository
    grpc_port = free_port()
    args = ["--model-repository", str(root), "--model-control", "explicit", "--default-model", "lite"]
    args += ["--grpc-port", str(grpc_port), "--request-timeout-s", "120"]
    env = {"VISION_SERVE_ADMIN_API_KEY": ADMIN_KEY, "VISION_SERVE_API_KEY": API_KEY}
    with ServerProcess(args, log_path=tmp_path_factory.mktemp("log") / "server.log", env=env) as running:
        running.grpc_url = f"127.0.0.1:{grpc_port}"
        yield running
        # Workers started by loads (and restarted) are the server's to stop: SIGTERM leaves none.
        family = psutil.Process(running.process.pid).children(recursive=True)
        assert running.stop() == 0
        survivors = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not survivors, [p.cmdline() for p in survivors]


def predict(server, image: bytes, query: str = "") -> httpx.Response:
    return httpx.post(
        f"{server.url}/predict{query}", content=image, headers={**INFERENCE, "Content-Type": "image/jpeg"}, timeout=120
    )


def version_config(version: int) -> str:
    return json.dumps({"version_policy": {"specific": {"versions": [version]}}})


def test_two_models_answer_side_by_side_with_their_own_labels(server, repository, coffee_jpeg) -> None:
    _, finetuned = repository
    for image, expected in finetuned.held_back:
        answer = predict(server, image, "?model=pets").json()
        assert answer["predictions"][0]["label"] == expected and answer["model"] == "pets"
        assert {p["label"] for p in answer["predictions"]} <= set(LABELS)
    answer = predict(server, coffee_jpeg).json()  # the default model
    assert answer["predictions"][0]["label"] == "espresso" and (answer["model"], answer["model_version"]) == (
        "lite",
        "1",
    )
    assert predict(server, coffee_jpeg, "?model=birds").status_code == 404

    client = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    for name, image, expected in (("pets", *finetuned.held_back[0]), ("lite", coffee_jpeg, "espresso")):
        tensor = triton_http.InferInput("IMAGE", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([image], dtype=np.object_), binary_data=True)
        result = client.infer(name, [tensor], headers=headers(INFERENCE))
        assert result.as_numpy("LABELS")[0][0].decode() == expected
        assert result.get_response()["model_version"] == "1"
    info = httpx.get(f"{server.url}/info", headers=headers(INFERENCE), timeout=10).json()
    assert sorted((m["name"], m["version"]) for m in info["models"]) == [("lite", 1), ("pets", 1)]
    assert info["model"]["model"] == "lite"
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'vision_serve_model_images_total{code="200",model="pets",version="1"}' in metrics
    assert 'vision_serve_model_ready{model="lite",version="1"} 1.0' in metrics


def test_the_repository_api_needs_the_admin_key_and_never_the_inference_key(server) -> None:
    index = f"{server.url}/v2/repository/index"
    for sent in ({}, INFERENCE, {"X-API-Key": ADMIN_KEY + "x"}):
        refused = httpx.post(index, headers=sent, timeout=10)
        assert refused.status_code == 401 and "admin key" in refused.json()["error"]
        load = httpx.post(f"{server.url}/v2/repository/models/lite/unload", headers=sent, timeout=10)
        assert load.status_code == 401
    assert httpx.post(index, headers={"X-API-Key": ADMIN_KEY}, timeout=10).status_code == 200
    grpc_client = triton_grpc.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
        grpc_client.get_model_repository_index(headers={"x-api-key": API_KEY})


def test_tritonclient_indexes_unloads_and_loads_over_http_and_grpc(server, repository) -> None:
    _, finetuned = repository
    image, expected = finetuned.held_back[0]
    http_client = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    grpc_client = triton_grpc.InferenceServerClient(server.grpc_url)
    index = http_client.get_model_repository_index(headers=headers(ADMIN))
    assert {(m["name"], m["version"], m["state"]) for m in index} == {("lite", "1", "READY"), ("pets", "1", "READY")}

    grpc_client.unload_model("pets", headers={"x-api-key": ADMIN_KEY})
    assert predict(server, image, "?model=pets").status_code == 404
    with pytest.raises(InferenceServerException, match="NOT_FOUND"):
        grpc_client.is_model_ready("pets", headers={"x-api-key": API_KEY})
    listed = grpc_client.get_model_repository_index(headers={"x-api-key": ADMIN_KEY}, as_json=True)["models"]
    assert {"name": "pets", "state": "UNAVAILABLE", "reason": "unloaded"} in listed

    http_client.load_model("pets", headers=headers(ADMIN))
    assert predict(server, image, "?model=pets").json()["predictions"][0]["label"] == expected
    assert grpc_client.is_model_ready("pets", headers={"x-api-key": API_KEY})


class Stream:
    """Clients that classify without pause until stopped, keeping every outcome."""

    def __init__(self, server, image: bytes, clients: int = 4) -> None:
        self.server, self.image = server, image
        self.outcomes: list[tuple[int | str, str]] = []  # (status or error, model_version)
        self.sent_at: list[float] = []  # time.monotonic() when each outcome's request was sent
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def _run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    response = client.post(
                        f"{self.server.url}/predict?model=lite",
                        content=self.image,
                        headers={**INFERENCE, "Content-Type": "image/jpeg"},
                    )
                    version = response.json().get("model_version", "") if response.status_code == 200 else ""
                    outcome = (response.status_code, version)
                except httpx.HTTPError as exc:
                    outcome = (repr(exc), "")
                self.sent_at.append(sent)  # the two lists stay in step: this thread appends both
                self.outcomes.append(outcome)

    def __enter__(self) -> Stream:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(180)


def test_a_swap_during_a_live_stream_fails_no_request(server, coffee_jpeg) -> None:
    client = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=600)
    with Stream(server, coffee_jpeg) as stream:
        client.load_model("lite", config=version_config(2), headers=headers(ADMIN))
        first_returned = time.monotonic()
        client.load_model("lite", config=version_config(1), headers=headers(ADMIN))
        second_returned = time.monotonic()
        while sum(sent > second_returned for sent in list(stream.sent_at)) < 8:
            threading.Event().wait(0.1)
    statuses = Counter(status for status, _ in stream.outcomes)
    assert statuses == {200: len(stream.outcomes)}, statuses
    assert {version for _, version in stream.outcomes} == {"1", "2"}
    # Once a load call returned, every request sent after it goes to its version (those sent before
    # may still finish on the old one). Judged by send time: the order in which the clients' threads
    # record their answers says nothing on a busy machine.
    sent_and_version = [(sent, version) for sent, (_, version) in zip(stream.sent_at, stream.outcomes, strict=True)]
    assert "2" in {version for sent, version in sent_and_version if first_returned < sent < second_returned}
    assert {version for sent, version in sent_and_version if sent > second_returned} == {"1"}


def test_a_failed_load_leaves_the_old_version_serving(server, coffee_jpeg) -> None:
    client = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=600)
    with Stream(server, coffee_jpeg, clients=2) as stream:
        with pytest.raises(InferenceServerException, match="version 3 could not be loaded") as caught:
            client.load_model("lite", config=version_config(3), headers=headers(ADMIN))
        assert "still serve" in str(caught.value)
    assert stream.outcomes and all(outcome == (200, "1") for outcome in stream.outcomes)
    index = client.get_model_repository_index(headers=headers(ADMIN))
    assert {(m["name"], m["version"]) for m in index if m["state"] == "READY"} >= {("lite", "1")}
    with pytest.raises(InferenceServerException, match="version\\(s\\) 9"):
        client.load_model("lite", config=version_config(9), headers=headers(ADMIN))  # refused before any worker starts


def test_the_upload_page_offers_the_models_and_classifies_with_the_chosen_one(browser, server, repository) -> None:
    _, finetuned = repository
    image, expected = finetuned.held_back[0]
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(f"{server.url}/")
        page.click("#key-box summary")
        page.fill("#api-key", API_KEY)
        page.dispatch_event("#api-key", "change")  # the models are listed once /info answers with the key
        page.wait_for_selector("#model-row:not([hidden])")
        assert page.locator("#model option").all_inner_texts() == ["lite", "pets"]
        assert page.input_value("#model") == "lite"  # the default model
        page.select_option("#model", "pets")
        page.set_input_files("#file", files=[{"name": "crop.jpg", "mimeType": "image/jpeg", "buffer": image}])
        page.wait_for_selector("#predictions .prediction")
        assert page.locator("#predictions .prediction .label").first.inner_text() == expected
    finally:
        context.close()


def ready_workers(server) -> set[str]:
    return set(httpx.get(f"{server.url}/ready", timeout=10).json()["workers"])


def test_a_worker_started_by_a_load_is_restarted_when_it_dies(server, repository, coffee_jpeg) -> None:
    """The load's new pets worker is a slot in the worker process that holds lite's (shared
    processes): killing the processes after the load restarts every worker they held, the new one too."""
    _, finetuned = repository
    before = ready_workers(server)
    triton_http.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=600).load_model(
        "pets", headers=headers(ADMIN)
    )
    deadline = time.monotonic() + 60
    while True:  # the old pets worker drains and exits; the new one serves
        workers = ready_workers(server)
        if len(workers) == len(before) and workers != before:
            break
        assert time.monotonic() < deadline, (before, workers)
        time.sleep(0.25)
    for process in inference_workers(server):
        process.kill()
    image, expected = finetuned.held_back[0]
    deadline = time.monotonic() + 120
    # /ready alone would not do: until the restarter sees the deaths, the table still says ready.
    while not (
        restarted(server)
        and server_ready(server)
        and predict(server, image, "?model=pets").status_code == 200
        and predict(server, coffee_jpeg).status_code == 200
    ):
        assert time.monotonic() < deadline, "the killed workers were not restarted"
        time.sleep(0.25)
    assert ready_workers(server) == workers, "restarted with the same worker ids"
    assert predict(server, image, "?model=pets").json()["predictions"][0]["label"] == expected
    assert predict(server, coffee_jpeg).json()["predictions"][0]["label"] == "espresso"


# How long the unload is watched while its workers are held: far longer than it takes to stop a worker
# (SIGTERM, then SIGKILL 5 s later), far shorter than the drain deadline (--request-timeout-s 120).
UNLOAD_WATCH_S = 10.0
SIGNALS_THAT_END = (signal.SIGTERM, signal.SIGKILL)


@contextlib.contextmanager
def held(pids: list[int]) -> Iterator[None]:
    """These processes stopped (SIGSTOP) for the block, resumed after it (those still there)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def told_to_end(pid: int) -> bool:
    """Whether a held process was sent SIGTERM or SIGKILL (pending until it runs again), or is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").strip().startswith(("Z", "X")):
        return True
    pending = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    return any(pending & (1 << (number - 1)) for number in SIGNALS_THAT_END)


def test_a_request_in_flight_during_an_unload_gets_its_answer(server, repository) -> None:
    """An unload drains its model's workers: a request they hold when it is called still gets its 200,
    and the call returns once they answered it. The existing unload test sees only that the workers are
    gone, which they also are when terminated. The workers are held (SIGSTOP) while the request is
    queued and the unload takes the model out of the routing table, so that the request is unanswered
    when the unload reaches them, whatever the machine's speed; a worker stopped instead of drained is
    told so then (its SIGTERM waits while it is held). No event marks a drain's wait: it is watched for
    UNLOAD_WATCH_S."""
    _, finetuned = repository
    image, expected = finetuned.held_back[0]
    admin = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=600)
    workers = [process.pid for process in inference_workers(server)]
    calls = ThreadPoolExecutor(2)
    try:
        with held(workers):
            answer = calls.submit(predict, server, image, "?model=pets")
            wait_until(lambda: in_flight(server.url) >= 1, "the pets request is admitted")
            unload = f"{server.url}/v2/repository/models/pets/unload"
            unloaded = calls.submit(httpx.post, unload, headers=ADMIN, timeout=300)
            ready = f"{server.url}/v2/models/pets/ready"
            wait_until(lambda: httpx.get(ready, timeout=10).status_code == 404, "pets is out of the routing table")
            deadline = time.monotonic() + UNLOAD_WATCH_S
            while time.monotonic() < deadline and not unloaded.done():
                assert not any(told_to_end(pid) for pid in workers), "a worker holding a request was stopped"
                time.sleep(0.05)
            assert not unloaded.done(), "the unload returned while its worker still held a request"
        response = answer.result(timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "pets" and response.json()["predictions"][0]["label"] == expected
        assert unloaded.result(timeout=120).status_code == 200  # once the drained worker is gone
    finally:
        calls.shutdown(wait=False)
    assert predict(server, image, "?model=pets").status_code == 404
    admin.load_model("pets", headers=headers(ADMIN))  # as the other tests expect it
    assert predict(server, image, "?model=pets").json()["predictions"][0]["label"] == expected


def restarted(server) -> bool:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    counts = [
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("vision_serve_worker_restarts_total")
    ]
    return bool(counts) and counts[0] >= 1


def server_ready(server) -> bool:
    try:
        return httpx.get(f"{server.url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
