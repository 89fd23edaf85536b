"""The benchmark machinery against real servers and models: the load generator against a Lite0 server
on loopback (closed and open loop, client processes, its CLI), the per-process script and the ceiling.
"""

from __future__ import annotations

import functools
import itertools
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from benchmarks.ceiling import measure_ceiling
from benchmarks.gpu.suite import ANSWERS_BAD_INPUTS
from benchmarks.harness.answered import next_change, steady_rate
from benchmarks.pipeline_check import answer_groups, check_photos, check_under_load, compare, references
from compile.model_request import ModelRequest
from compile.sample_photos import CAT_LABELS
from service.client.launcher import ServerProcess
from service.tune.images import read_images
from service.tune.loadgen import CONSTANT, LoadClients, LoadSpec, oip_images, run_load
from service.worker.engine import load_eager
from tests.bad_inputs import bad_inputs

LITE = ["--model", "efficientnet-lite0", "--max-batch-size", "4", "--log-level", "warning"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(LITE, log_path=tmp_path_factory.mktemp("server") / "server.log") as running:
        yield running


def test_closed_loop_reports_latency_batches_and_the_server_breakdown(server, images_dir) -> None:
    images = read_images(images_dir)
    result = run_load(f"{server.url}/predict", images, LoadSpec(24, concurrency=4, warmup_requests=4))
    summary = result.summary()
    assert summary["requests"] == 24 and summary["ok"] == 24 and summary["statuses"] == {"200": 24}
    assert summary["throughput_rps"] > 0
    latency = summary["latency_ms"]
    assert 0 < latency["p50"] <= latency["p95"] <= latency["p99"] <= latency["max"]
    assert sum(summary["batch_sizes"].values()) == 24 and max(map(int, summary["batch_sizes"])) <= 4
    for sample in result.samples:
        parts = sample.timings_ms
        assert set(parts) == {"queue", "preprocess", "inference", "postprocess", "total"}
        # The server's total covers its parts (one clock per process: allow a millisecond of skew)...
        assert parts["total"] + 1.0 >= parts["queue"] + parts["preprocess"] + parts["inference"]
        # ...and the client waited at least as long as the server worked.
        assert sample.latency_ms + 1.0 >= parts["total"]
    assert set(summary["server_ms_median"]) == {"queue", "preprocess", "inference", "postprocess", "total", "other"}


def test_open_loop_keeps_its_schedule_and_counts_errors_by_status(server, images_dir) -> None:
    images = [*read_images(images_dir)[:2], b"not an image at all"]
    result = run_load(f"{server.url}/predict", images, LoadSpec(12, mode="open", rate=8.0, arrivals=CONSTANT))
    summary = result.summary()
    assert summary["statuses"] == {"200": 8, "415": 4}
    assert summary["errors"] == 4 and summary["ok"] == 8
    samples = sorted(result.samples, key=lambda s: s.sent_s)
    assert [round(s.sent_s, 3) for s in samples] == [round(i / 8, 3) for i in range(12)]  # the schedule
    # What was actually sent: each at its time, not all at once nor drifting (a loose bound for a busy
    # machine, far below the 125 ms spacing it checks).
    actual = [s.sent_s + s.lag_ms / 1e3 for s in samples]
    assert all(0 <= s.lag_ms < 60 for s in samples), [round(s.lag_ms, 1) for s in samples]
    assert all(0.06 < b - a < 0.19 for a, b in itertools.pairwise(actual)), actual
    assert summary["send_lag_ms_max"] == max(s.lag_ms for s in samples)


@pytest.mark.slow
def test_client_processes_split_the_load_without_losing_requests(server, images_dir) -> None:
    images = read_images(images_dir)[:2]
    # Fewer requests than processes: the extra process is dropped instead of failing on 0 requests.
    result = run_load(f"{server.url}/predict", images, LoadSpec(3, concurrency=4), processes=4)
    assert result.summary()["statuses"] == {"200": 3}
    # A constant stream split over 2 processes stays evenly spaced: process 1 starts half a gap later.
    spec = LoadSpec(6, mode="open", rate=6.0, arrivals=CONSTANT)
    samples = run_load(f"{server.url}/predict", images, spec, processes=2).samples
    # Each process's clock starts on its own: their actual send times interleave by the half gap.
    sent = sorted(s.sent_s + s.lag_ms / 1e3 for s in samples)
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert len(sent) == 6 and all(0.08 < gap < 0.25 for gap in gaps), gaps


def test_answers_under_load_match_each_photo_alone_and_bad_jpegs_fail_alone(server) -> None:
    """The headline's answers check (benchmarks/pipeline_check.py) on a real server: every photo gets
    its own answer whatever batch it shared with bad JPEGs, and the check sees a mixed-up answer."""
    photos = check_photos(12)
    bad = [item for item in bad_inputs() if item.name in ANSWERS_BAD_INPUTS]
    found = check_under_load(f"{server.url}/predict", photos, bad, requests=64, concurrency=8, tolerance=1e-3)
    assert found["passed"] and found["differing"] == 0 and found["ok"] == 60
    assert found["bad_sent"] == 4 and found["bad_statuses"] == {"400": 4} and not found["bad_wrongly_answered"]
    assert found["mean_batch"] > 1  # the photos shared batches (max 4 here) with each other and the bad ones
    # The same answers against a reference whose photos are swapped: the check must see it.
    reference = references(f"{server.url}/predict", photos)
    assert answer_groups(reference, 1e-3) >= 10  # Lite0's real weights tell (nearly) every photo apart
    swapped = {**reference, 0: reference[1], 1: reference[0]}
    answers = [reference[0], reference[1]]
    assert compare(answers, swapped, 1e-3)["differing"] == 2


def test_load_clients_carry_many_runs_and_open_inference_protocol_bodies(server, images_dir) -> None:
    images = read_images(images_dir)[:2]
    infer = f"{server.url}/v2/models/efficientnet-lite0/infer"
    with LoadClients(2) as clients:
        predict = run_load(f"{server.url}/predict", images, LoadSpec(8, concurrency=2), processes=2, clients=clients)
        oip = run_load(infer, images, LoadSpec(4, concurrency=2), processes=2,
                       encode=functools.partial(oip_images, count=3), clients=clients)  # fmt: skip
    assert predict.summary()["statuses"] == {"200": 8} and oip.summary()["statuses"] == {"200": 4}


def test_loadgen_cli_writes_its_json(server, images_dir, tmp_path) -> None:
    output = tmp_path / "run.json"
    command = [sys.executable, "-m", "service.tune.loadgen", "--url", f"{server.url}/predict", "--images",
               str(images_dir), "--requests", "6", "--concurrency", "2", "--output", str(output)]  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert "closed loop, concurrency 2: 6/6 ok" in completed.stdout
    record = json.loads(output.read_text())
    assert record["summary"]["ok"] == 6 and len(record["samples"]) == 6


def test_steady_rate_counts_what_the_server_answered_between_two_answers(server, images_dir) -> None:
    photo = read_images(images_dir)[0]
    with pytest.raises(TimeoutError, match="answered no image"):  # no load: no change to time from
        next_change(server.url, timeout_s=0.3)
    answered_at: list[float] = []
    statuses: set[int] = set()
    stop = threading.Event()

    def client() -> None:  # one request at a time: each answer is a batch of one
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                response = http.post(f"{server.url}/predict", content=photo, headers={"content-type": "image/jpeg"})
                # Checked by the test, not here: a failed assert in a thread would only be printed.
                statuses.add(response.status_code)
                answered_at.append(time.monotonic())

    load = threading.Thread(target=client)
    load.start()
    try:
        rate = steady_rate(server.url, 2.0, timeout_s=30)
    finally:
        stop.set()
        load.join()
    assert statuses == {200}
    assert rate.ended - rate.began >= 2.0
    # The client saw the same answers in that time, give or take those at its two edges (the server
    # counts an answer a moment before its client has it; each poll is 50 ms apart).
    seen = sum(rate.began < at <= rate.ended for at in answered_at)
    assert rate.images > 4 and abs(seen - rate.images) <= 3, (seen, rate)
    assert rate.images_per_s == pytest.approx(rate.images / (rate.ended - rate.began))


def test_per_process_script_classifies_a_real_photo(images_dir) -> None:
    command = [sys.executable, "-m", "benchmarks.per_process_classify", str(images_dir / "chelsea-landscape.jpg"),
               "--model", "efficientnet-lite0", "--weights", "imagenet"]  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    top5 = json.loads(completed.stdout.strip().splitlines()[-1])
    assert len(top5) == 5 and top5[0]["label"] in CAT_LABELS


def test_ceiling_times_the_served_model(images_dir) -> None:
    cpu = torch.device("cpu")
    served = load_eager(ModelRequest("efficientnet-lite0"), "imagenet", cpu)
    record = measure_ceiling(served, read_images(images_dir)[:3], [1, 2], cpu, repeats=1)
    assert record["engine"] == "torch-eager-fp32"
    for batch in ("1", "2"):
        numbers = record["batches"][batch]
        assert numbers["model_ms"] > 0 and numbers["preprocess_ms"] > 0
        assert numbers["model_img_per_s"] == pytest.approx(int(batch) * 1e3 / numbers["model_ms"])
