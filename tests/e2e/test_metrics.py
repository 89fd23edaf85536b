"""/metrics on a real multi-process server: 2 inference workers and 2 HTTP processes on loopback.

A known mix of requests goes in; every scrape, whichever HTTP process answers it, must show the
same counts, summed over every process (prometheus_client's multiprocess mode). Then a worker is
killed: the counts it recorded must survive it and the restart must be counted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from service.client.launcher import ServerProcess
from service.metrics import METRIC_NAMES, MULTIPROC_ENV
from tests.conftest import CAT_LABELS, inference_workers
from tests.tools import require_tool

GOOD = 24
TRUNCATED = 3  # pass the HTTP process's header check, fail to decode in the worker: 400
NOT_IMAGES = 2  # rejected in the HTTP process before admission: 415


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} from a fresh connection (so either HTTP process may answer)."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def stage_count(samples: dict, stage: str) -> float:
    return value(samples, "vision_serve_stage_duration_seconds_count", stage=stage)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("metrics") / "server.log"
    args = ["--model", "efficientnet-lite0", "--workers-per-device", "2", "--max-batch-size", "4"]
    with ServerProcess([*args, "--log-format", "json"], log_path=log) as running:
        running.log_file = log
        yield running


def predict_pids(server) -> set[int]:
    """The HTTP processes that answered /predict, from the JSON access log."""
    lines = server.log_file.read_text().splitlines()
    return {json.loads(line)["pid"] for line in lines if '"service.access"' in line and '"/predict"' in line}


@dataclass
class Traffic:
    responses: list[httpx.Response]
    # Successful requests the server has answered in all, extra ones included: a test that sends more
    # adds them here, so the exact counts hold whatever order the tests run in.
    good: int


@pytest.fixture(scope="module")
def traffic(server, chelsea_jpeg, truncated_jpeg) -> Traffic:
    """The known mix, 8 at a time, each on its own connection; then, if one HTTP process happened to
    take it all, more good requests until both have answered, so the counts are sums over both."""

    def post(body: bytes) -> httpx.Response:
        return httpx.post(f"{server.url}/predict", content=body, headers={"Content-Type": "image/jpeg"}, timeout=60)

    bodies = [chelsea_jpeg] * GOOD + [truncated_jpeg] * TRUNCATED + [b"plain text, not an image"] * NOT_IMAGES
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(post, bodies))
    good = GOOD
    while len(predict_pids(server)) < 2 and good < GOOD + 200:
        assert post(chelsea_jpeg).status_code == 200
        good += 1
    return Traffic(responses, good)


def test_the_known_requests_got_the_expected_answers(traffic) -> None:
    codes = [r.status_code for r in traffic.responses]
    assert codes.count(200) == GOOD and codes.count(400) == TRUNCATED and codes.count(415) == NOT_IMAGES
    assert all(r.json()["predictions"][0]["label"] in CAT_LABELS for r in traffic.responses if r.status_code == 200)


def test_every_scrape_shows_the_same_counts_summed_over_all_processes(server, traffic) -> None:
    good = traffic.good
    scrapes = [scrape(server.url) for _ in range(6)]
    for samples in scrapes:
        assert value(samples, "vision_serve_requests_total", code="200") == good
        assert value(samples, "vision_serve_requests_total", code="400") == TRUNCATED
        assert value(samples, "vision_serve_requests_total", code="415") == NOT_IMAGES
        # Admitted requests (not the 415s, refused before the queue) pass through every worker stage
        # but inference, which only decodable images reach.
        admitted = good + TRUNCATED
        for stage in ("queue", "preprocess", "postprocess", "total"):
            assert stage_count(samples, stage) == admitted, stage
        assert stage_count(samples, "inference") == good
        assert value(samples, "vision_serve_images_total") == good
        assert value(samples, "vision_serve_batch_size_sum") == good
        assert 1 <= value(samples, "vision_serve_batch_size_count") <= good
        assert value(samples, "vision_serve_batch_size_bucket", le="4.0") == value(
            samples, "vision_serve_batch_size_count"
        )  # --max-batch-size 4
        assert value(samples, "vision_serve_requests_in_flight") == 0
        assert value(samples, "vision_serve_queue_depth") == 0
        assert value(samples, "vision_serve_requests_in_flight_limit") == 256
        assert value(samples, "vision_serve_workers", state="ready") == 2
        assert value(samples, "vision_serve_requests_expired_total") == 0
        info = [labels for (name, labels) in samples if name == "vision_serve_build_info"]
        assert len(info) == 1 and dict(info[0])["model"] == "efficientnet-lite0" and dict(info[0])["device"] == "cpu"
        # Stage sums are real durations: inference took time, and no stage exceeds the total.
        assert value(samples, "vision_serve_stage_duration_seconds_sum", stage="inference") > 0
        assert value(samples, "vision_serve_stage_duration_seconds_sum", stage="inference") < value(
            samples, "vision_serve_stage_duration_seconds_sum", stage="total"
        )


def test_both_http_processes_answered_and_were_summed(server, traffic) -> None:
    """Both HTTP processes answered, so the equal counts above are sums over processes."""
    assert len(predict_pids(server)) == 2, f"{traffic.good} good requests all went to one HTTP process"


def test_exposition_passes_promtool_and_names_every_metric(server, traffic) -> None:
    promtool = require_tool("promtool")
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    families = {family.name for family in text_string_to_metric_families(text)}
    gpu_only = {name for name in METRIC_NAMES if "_gpu_" in name}
    # The parser names counters without _total.
    exported = {name.removesuffix("_total") for name in METRIC_NAMES}
    assert exported - {n.removesuffix("_total") for n in gpu_only} <= families
    assert not gpu_only & families  # no GPU here: no GPU series rather than zeros


def test_access_log_lines_are_json_with_the_request_id(server, traffic, chelsea_jpeg) -> None:
    response = httpx.post(
        f"{server.url}/predict", content=chelsea_jpeg, headers={"X-Request-ID": "trace-abc.123"}, timeout=60
    )
    traffic.good += response.status_code == 200
    assert response.headers["X-Request-ID"] == "trace-abc.123"
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in server.log_file.read_text().splitlines() if line.startswith("{")]
        mine = [entry for entry in lines if entry.get("request_id") == "trace-abc.123"]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert mine and mine[0]["logger"] == "service.access" and mine[0]["status"] == 200
    assert mine[0]["message"].startswith("POST /predict 200")
    assert {"time", "level", "process", "pid", "duration_ms"} <= mine[0].keys()


def images_counted_by(counter_file: Path) -> float:
    """``vision_serve_images_total`` as one process's own multiprocess file holds it."""
    if not counter_file.exists():
        return 0.0
    values = MmapedDict(str(counter_file), read_mode=True)
    try:
        return sum(v for key, v, _ in values.read_all_values() if json.loads(key)[1] == "vision_serve_images_total")
    finally:
        values.close()


def test_a_killed_worker_keeps_its_counts_and_the_restart_is_counted(server, traffic, chelsea_jpeg) -> None:
    """The worker's own series (images, batch sizes: it counts them) must survive its SIGKILL exactly;
    its counter file stays in the multiprocess directory, and the main process counts the restart."""
    workers = inference_workers(server)
    assert len(workers) == 2
    directory = Path(workers[0].environ()[MULTIPROC_ENV])
    # A worker that ran images: its own file holds counts, which must not be lost with it.
    counted = [w for w in workers if images_counted_by(directory / f"counter_{w.pid}.db") > 0]
    assert counted, "neither worker counted images of its own"
    killed = counted[0]
    before = scrape(server.url)
    os.kill(killed.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    # The HTTP processes learn of the death from the routing table, a poll after the main process
    # counts the restart: a scrape may show the restart with both workers still ready. So first the
    # worker seen not ready, then ready again.
    seen_down = False
    while True:
        samples = scrape(server.url)
        ready = value(samples, "vision_serve_workers", state="ready")
        seen_down = seen_down or ready < 2
        if seen_down and ready == 2 and value(samples, "vision_serve_worker_restarts_total") == 1:
            break
        assert time.monotonic() < deadline, "the worker was not restarted"
        time.sleep(0.1)
    for name in ("vision_serve_images_total", "vision_serve_batch_size_count", "vision_serve_batch_size_sum"):
        assert value(samples, name) == value(before, name) > 0, name  # nothing served in between: equal
    assert images_counted_by(directory / f"counter_{killed.pid}.db") > 0
    # And the server still serves.
    response = httpx.post(f"{server.url}/predict", content=chelsea_jpeg, timeout=60)
    traffic.good += response.status_code == 200
    assert response.status_code == 200
