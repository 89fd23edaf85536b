"""The benchmark suite's own machinery without a model server: server-timing parsing, percentiles,
arrivals, load specs, plots, the target verdicts, the GPU suite's report, the images-per-request bodies.

The parts that drive a real Lite0 server are in tests/e2e/test_benchmarks_live.py; the benchmarks
themselves (minutes of ResNet-152) run by hand: ``python -m benchmarks.experiments all``.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from benchmarks.experiments import Target, agreement_inputs, targets, targets_markdown
from benchmarks.harness import plots
from benchmarks.harness.suite import markdown_table
from service.client.launcher import free_port
from service.tune.images import read_images, write_benchmark_images
from service.tune.loadgen import (
    CONSTANT,
    POISSON,
    LoadSpec,
    arrival_times,
    check_loopback,
    closed_loop,
    oip_images,
    parse_server_timing,
    percentile,
    run_load,
)


def test_parse_server_timing_reads_durations_and_skips_the_rest() -> None:
    header = 'queue;dur=1.5, preprocess;desc="PIL";dur=2, cache;desc=hit, inference;dur=abc, total;dur="4.25"'
    assert parse_server_timing(header) == {"queue": 1.5, "preprocess": 2.0, "total": 4.25}
    assert parse_server_timing(None) == {}
    assert parse_server_timing("") == {}


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 101))
    assert (percentile(values, 0.5), percentile(values, 0.95), percentile(values, 0.99)) == (50, 95, 99)
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN


def test_arrivals_constant_and_poisson() -> None:
    assert arrival_times(4, 2.0, CONSTANT, random.Random(0)) == [0.0, 0.5, 1.0, 1.5]
    times = arrival_times(4000, 50.0, POISSON, random.Random(1))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean (constant spacing would give 0).
    assert statistics.pstdev(gaps) == pytest.approx(1 / 50, rel=0.1)
    assert times == arrival_times(4000, 50.0, POISSON, random.Random(1))  # seeded: reproducible


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/predict", "http://localhost:1/x", "http://[::1]:80/p"])
def test_loopback_urls_are_accepted(url: str) -> None:
    check_loopback(url)


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000/predict", "https://example.com/predict", "http://0.0.0.0:1/"])
def test_other_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        check_loopback(url)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"requests": 0}, "requests"),
        ({"requests": 1, "concurrency": 0}, "concurrency"),
        ({"requests": 1, "mode": "open"}, "rate"),
        ({"requests": 1, "mode": "open", "rate": float("inf")}, "rate"),
        ({"requests": 1, "arrivals": "bursty"}, "arrivals"),
        ({"requests": 1, "max_seconds": 0}, "max_seconds"),
    ],
)
def test_load_spec_says_what_is_wrong(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoadSpec(**kwargs)


def test_read_images_explains_an_empty_folder(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"service\.tune\.images"):
        read_images(tmp_path)


def test_a_dead_server_counts_as_lost_not_as_a_crash(images_dir) -> None:
    url = f"http://127.0.0.1:{free_port()}/predict"
    result = run_load(url, read_images(images_dir)[:1], LoadSpec(3, concurrency=1))
    assert result.summary()["statuses"] == {"lost": 3}
    assert all(s.error and "ConnectError" in s.error for s in result.samples)


def test_agreement_inputs_are_distinct_variants(images_dir) -> None:
    photos = read_images(images_dir)[:2]
    variants = agreement_inputs(photos, 5)
    assert len(variants) == 10 and variants[0] == photos[0] and variants[5] == photos[1]
    assert len(set(variants)) == 10


def test_plots_write_png_files(tmp_path) -> None:
    written = [
        plots.throughput_vs_concurrency(
            {"a": [(1, 2.0), (8, 5.0)], "b": [(1, 1.0), (8, 3.0)]}, "t", tmp_path / "t.png"
        ),
        plots.latency_cdf({"a": [1.0, 2.0, 3.0], "empty": []}, "t", tmp_path / "c.png"),
        plots.batch_histogram({"a": {"1": 3, "8": 5}, "b": {"4": 2}}, "t", tmp_path / "b.png"),
    ]
    for path in written:
        assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 5000


def _run(rps: float, p50: float = 100.0) -> dict:
    return {"throughput_rps": rps, "latency_ms": {"p50": p50}}


def _efficiency(served: float, ceiling: float, c1_p50: float, model_b1: float) -> dict:
    return {
        "ratio": served / ceiling,
        "served_img_per_s": served,
        "ceiling_img_per_s": ceiling,
        "c1_ratio": c1_p50 / model_b1,
        "served_c1_p50_ms": c1_p50,
        "model_b1_ms": model_b1,
    }


def _records(
    served_fp32: float, served_bf16: float, ts_best: float, bf16_agreement: float, c1_ms: float, lite_agreement=1.0
):
    ceiling = {
        "efficiency": {
            "vision-serve eager fp32": _efficiency(served_fp32 * 0.9, 10.0, 105.0, 100.0),
            "vision-serve inductor fp32": _efficiency(served_fp32, 11.0, 95.0, 90.0),
            "vision-serve inductor bf16": _efficiency(served_bf16, 20.0, c1_ms, 50.0),
        }
    }
    runs = {
        "TorchServe batch 8": {1: _run(5.0), 32: _run(ts_best)},
        "TorchServe no batching": {1: _run(5.0), 32: _run(ts_best / 2)},
        "TorchServe batch 8, 1 worker": {1: _run(5.0), 32: _run(ts_best * 1.5)},  # tuned beyond the seed setup
        "vision-serve eager fp32": {1: _run(0, 105.0), 32: _run(served_fp32 * 0.9)},
        "vision-serve inductor fp32": {1: _run(0, 95.0), 32: _run(served_fp32)},
        "vision-serve inductor bf16": {1: _run(0, c1_ms), 32: _run(served_bf16)},
    }
    per_process = {"per_process": {"throughput_rps": 0.5}, "parallel": 2, "server": {"2": _run(6.0)}}
    agreement = {
        "resnet152": {
            "engines": {"inductor-bf16": {"top1_agreement": bf16_agreement}},
            "inputs": 240,
            "distinct_fp32_top1": 1,
        },
        "efficientnet-lite0": {
            "engines": {"eager-bf16": {"top1_agreement": lite_agreement}},
            "inputs": 240,
            "distinct_fp32_top1": 34,
        },
    }
    return ceiling, {"runs": runs}, per_process, {"agreement": agreement}


def test_targets_compute_each_ratio_and_verdict() -> None:
    found = {t.name: t for t in targets(*_records(10.6, 19.5, 7.0, 1.0, 56.0))}
    assert found["efficiency, vision-serve inductor fp32"].measured == pytest.approx(10.6 / 11.0)
    assert found["efficiency, vision-serve inductor fp32"].met
    assert found["vs TorchServe at fp32"].measured == pytest.approx(10.6 / 7.0) and found["vs TorchServe at fp32"].met
    fastest = found["vs TorchServe, fastest precision with top-1 agreement >= 99%"]
    assert fastest.measured == pytest.approx(19.5 / 7.0) and fastest.met
    assert fastest.detail.startswith("vision-serve inductor bf16")
    tuned = found["vs TorchServe at fp32 (extra: TorchServe tuned beyond the seed setup)"]
    assert tuned.measured == pytest.approx(10.6 / 10.5) and not tuned.met and "1 worker" in tuned.detail
    assert found["vs one process per image (same parallelism)"].measured == pytest.approx(12.0)
    latency = found["concurrency-1 latency, vision-serve inductor bf16"]
    assert latency.measured == pytest.approx(56.0 / 50.0) and latency.met
    seed_rows = [t for name, t in found.items() if "extra" not in name]
    assert all(t.met for t in seed_rows) and "NOT met" not in targets_markdown(seed_rows)


def test_targets_say_not_met_and_skip_a_precision_that_disagrees() -> None:
    found = {t.name: t for t in targets(*_records(9.0, 30.0, 7.0, 0.95, 60.0))}
    assert not found["efficiency, vision-serve inductor fp32"].met  # 9 / 11 < 0.95
    fastest = found["vs TorchServe, fastest precision with top-1 agreement >= 99%"]
    assert fastest.detail.startswith("vision-serve inductor fp32")  # 95 % agreement: bf16 does not qualify
    assert not found["concurrency-1 latency, vision-serve inductor bf16"].met  # 60 / 50 > 1.15
    assert "NOT met" in targets_markdown(list(found.values()))
    assert Target("x", 1.15, 1.2, "", lower_is_better=True).met is False


def test_a_precision_qualifies_only_if_the_real_weights_model_agrees_too() -> None:
    found = {t.name: t for t in targets(*_records(10.6, 19.5, 7.0, 1.0, 56.0, lite_agreement=0.979))}
    fastest = found["vs TorchServe, fastest precision with top-1 agreement >= 99%"]
    assert fastest.measured == pytest.approx(10.6 / 7.0)  # judged with fp32
    # ...and the detail says what bf16 would have given and why it does not count.
    assert "vision-serve inductor bf16 excluded: " in fastest.detail
    assert "efficientnet-lite0 eager-bf16 97.9% of 240 inputs (34 distinct fp32 top-1)" in fastest.detail


def test_markdown_table() -> None:
    assert markdown_table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"


def test_gpu_suite_report_tables_and_plots(tmp_path) -> None:
    """The GPU suite's report from a recorded run (the suite itself needs a GPU; CI has none)."""
    from benchmarks.gpu.suite import PARTIAL_RECORD, load_record, report

    def run(rps: float) -> dict:
        breakdown = {"queue": 1.0, "preprocess": 2.0, "pipeline_wait": 0.5, "inference": 3.0}
        return {**_run(rps, 12.0), "latency_ms": {"p50": 12.0, "p99": 30.0}, "batch_size_mean": 4.0,
                "batch_sizes": {"4": 10}, "server_ms_median": breakdown,
                "latencies_ms": [10.0, 12.0, 30.0]}  # fmt: skip

    record = {
        "machine": {"gpu": "NVIDIA H100"},
        "steps": {"compile": {"seconds": 100.0, "status": "ok"}, "preprocess": {"seconds": 5.0, "status": "failed: x"}},
        "sweeps": {"compiled": {1: run(80.0), 64: run(2000.0)}, "baseline": {1: run(40.0), 64: run(300.0)}},
        "poisson": {"compiled": {"50% of peak (1000 req/s)": run(990.0)}},
        "client_ceiling": {64: run(9000.0)},
        "variants": {"same, OIP, 32 images per request": {"images_per_request": 32, "runs": {2: run(100.0)}}},
        "depth": {"concurrency": 64, "rounds": [{2: run(2000.0), 1: run(1600.0)}, {2: run(2100.0), 1: run(1500.0)}],
                  "median_rps": {2: 2050.0, 1: 1550.0}, "ratio_2_to_1": 2050.0 / 1550.0},
        "model": "resnet152",
        "precision": "fp16",
    }  # fmt: skip
    # Saved and resumed by a later run (JSON makes the concurrency and depth keys strings).
    (tmp_path / PARTIAL_RECORD).write_text(json.dumps(record))
    fresh = {"machine": {"gpu": "NVIDIA H100"}, "model": "resnet152", "precision": "fp16"}
    md = report(load_record(tmp_path, resume=True, fresh=fresh), tmp_path)
    assert "| compiled | 64 | 2000.0 | 12.0 | 30.0 | 4.0 | 1.0 / 2.0 / 0.5 / 3.0 |" in md
    assert "| client ceiling: no-op server | 64 | 9000.0 | 12.0 | 30.0 |  |  |" in md
    assert "| same, OIP, 32 images per request | 2 | 3200.0 |" in md  # images, not requests, per second
    assert "| compiled, --pipeline-depth 1 (round 2) | 64 | 1500.0 |" in md
    assert "median of 2 alternating rounds: 2050.0 vs 1550.0 req/s (1.32x)" in md
    assert md.startswith("# GPU suite: resnet152 fp16 on NVIDIA H100")
    assert "| preprocess | 5 | failed: x |" in md
    with pytest.raises(ValueError, match="is for resnet152 fp16"):
        load_record(tmp_path, resume=True, fresh={**fresh, "precision": "bf16"})
    for name in ("gpu_suite-throughput.png", "gpu_suite-latency-cdf.png", "gpu_suite-batch-sizes.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG") and f"![{name}]({name})" in md


def test_engine_steps_take_the_compile_steps_artifact_or_fail_saying_why(tmp_path) -> None:
    """Only the compile step compiles: a later step without its artifact fails at once with the
    compile's status, instead of compiling again inside its own time cap."""
    from benchmarks.gpu.suite import StepFailed, compiled_artifact

    failed = {"steps": {"compile": {"status": "failed: compile-trt exited 3"}}, "compile": {"failed": "exit 3"}}
    with pytest.raises(StepFailed, match="the compile step's status is 'failed: compile-trt exited 3'"):
        compiled_artifact(failed)
    with pytest.raises(StepFailed, match="status is 'not run'"):
        compiled_artifact({"steps": {}})
    artifact = tmp_path / "artifact"
    with pytest.raises(StepFailed):  # recorded, but gone from this machine (a fresh one)
        compiled_artifact({"steps": {"compile": {"status": "ok"}}, "compile": {"artifact": str(artifact)}})
    artifact.mkdir()
    (artifact / "manifest.json").write_text("{}")
    assert compiled_artifact({"steps": {}, "compile": {"artifact": str(artifact)}}) == artifact


def test_gpu_suite_exits_1_when_a_step_it_was_asked_for_fails(tmp_path) -> None:
    """The GPU session judges a step by the suite's exit code: a failed step must not read as ok."""
    from benchmarks.gpu import suite as gpu_suite

    out = tmp_path / "out"
    argv = ["--dry-run", "--steps", "answers,ceiling", "--output-dir", str(out), "--work", str(tmp_path / "work")]
    assert gpu_suite.main(argv) == 1  # no compile step ran: nothing to serve
    record = json.loads((out / "gpu_suite.json").read_text())
    assert record["steps"]["ceiling"]["status"].startswith("failed: no compiled engine")
    assert "| answers | 0 | failed: no compiled engine" in (out / "gpu_suite.md").read_text()


def test_gpu_suite_resumes_a_saved_record_with_numeric_concurrencies() -> None:
    """A record read back from JSON (string keys) sorts and plots by concurrency, not as text."""
    from benchmarks.gpu.suite import _int_keys

    saved = json.loads(json.dumps({"sweeps": {"baseline": {1: {}, 64: {}, 256: {}}}}))
    assert max(saved["sweeps"]["baseline"]) == "64"  # what went wrong without the conversion
    assert max(_int_keys(saved["sweeps"]["baseline"])) == 256


def test_load_clients_serve_many_runs_without_importing_the_callers_main(tmp_path) -> None:
    """A sweep's client processes start once, and do not import the benchmark that runs them (its
    torch and matplotlib cost ~8 s per process and run on 2 cores)."""
    script = tmp_path / "bench_main.py"
    script.write_text(
        "import json, psutil, sys\n"
        "import xml.dom.minidom  # stands for the benchmark's heavy imports: nothing of the load generator needs it\n"
        "from service.tune.loadgen import LoadClients\n"
        "from tests.loadgen_probe import imported\n"
        "if __name__ == '__main__':\n"
        "    with LoadClients(2) as clients:\n"
        "        first = clients.map(imported, ['xml.dom.minidom'] * 4)\n"
        "        second = clients.map(imported, ['xml.dom.minidom'] * 4)\n"
        "        pids = [c.pid for c in psutil.Process().children() if 'resource_tracker' not in str(c.cmdline())]\n"
        "    print(json.dumps([pids, first, second]))\n"
    )
    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=repo,
                         env={**os.environ, "PYTHONPATH": str(repo)})  # fmt: skip
    assert run.returncode == 0, run.stderr
    pids, first, second = json.loads(run.stdout)
    assert len(pids) == 2 and {pid for pid, _ in first + second} <= set(pids)  # no process started per run
    assert not any(has for _, has in first + second), "a client process imported the caller's main module"


def test_noop_server_answers_every_request_of_the_load_generator(tmp_path) -> None:
    """The client-ceiling server: a real uvicorn on loopback, driven by the real load generator."""
    from benchmarks.peers.noop_server import noop_server

    images_dir = tmp_path / "images"
    write_benchmark_images(images_dir)
    with noop_server(workers=1) as url:
        result = run_load(url, read_images(images_dir), LoadSpec(60, concurrency=4, warmup_requests=4))
        answer = httpx.post(url, content=b"x" * 100_000).json()
    summary = result.summary()
    assert summary["statuses"] == {"200": 60} and summary["throughput_rps"] > 0
    assert [p["label"] for p in answer["predictions"]] == ["no-op"] * 5


def test_preprocess_parity_measures_backends_against_pillow() -> None:
    """The parity benchmark on the CPU: the torch backend decodes with libjpeg-turbo like Pillow, so
    bilinear stays within one uint8 level (the same bound as the backend tests)."""
    from benchmarks.preprocess_parity import SPECS, measure

    found = measure(torch.device("cpu"), ["torch"])
    assert set(found["torch"]) == set(SPECS)
    bilinear = found["torch"]["bilinear (resnet152)"]
    assert 0 < bilinear["max_levels"] <= 1.01 and bilinear["mean"] < 0.01


def test_the_triton_peer_skips_a_pyenv_shim_that_does_not_run(tmp_path, monkeypatch) -> None:
    import os

    from benchmarks.peers.triton_env import find_python

    shims = tmp_path / "shims"
    shims.mkdir()
    shim = shims / "python3.13"
    shim.write_text("#!/bin/sh\necho 'pyenv: python3.13: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    installed = tmp_path / "pyenv" / "versions" / "3.13.0" / "bin"
    installed.mkdir(parents=True)
    (installed / "python3.13").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", f"{shims}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    assert find_python("3.13") == str(installed / "python3.13")


def test_images_per_request_bodies_parse_as_the_server_parses_them() -> None:
    """The benchmark's 64-image bodies are what /predict and the OIP route accept (no server needed)."""
    import asyncio

    from starlette.requests import Request as StarletteRequest

    from benchmarks.images_per_request import multipart_request, oip_request, render, to_row
    from service.http.oip.json_request import parse_infer_body
    from service.http.predict.parsing import RequestLimits, read_predict_request

    oip = oip_request(b"\xff\xd8jpeg", 3, model="m")
    call = parse_infer_body(oip.body, oip.headers["Inference-Header-Content-Length"], 64)
    assert oip.path == "/v2/models/m/infer" and call.images == [b"\xff\xd8jpeg"] * 3

    form = multipart_request(b"\xff\xd8jpeg", 3)
    headers = [(k.lower().encode(), v.encode()) for k, v in form.headers.items()]

    async def receive() -> dict:
        return {"type": "http.request", "body": form.body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/predict", "headers": headers, "query_string": b""}
    parsed = asyncio.run(read_predict_request(StarletteRequest(scope, receive), RequestLimits()))
    assert parsed.many and parsed.images == [b"\xff\xd8jpeg"] * 3

    raw = {"duration_us": 2e6, "requests": 10, "p50_us": 1000, "p99_us": 2000, "non_2xx": 0, "socket_errors": 0}
    rows = [to_row("predict-1", 64, raw, cpu_s=1.0), to_row("predict-64", 1, raw, cpu_s=16.0)]
    assert rows[1].images_per_s == 320.0 and rows[1].server_cpu_ms_per_image == 25.0
    assert "`predict-64` x1: 64.00x the images per second, 0.25x the server CPU per image" in render(rows, 2.0)


def test_closed_loop_sends_each_index_once_with_at_most_its_clients_in_flight() -> None:
    import asyncio

    in_flight, most, sent = 0, 0, []

    async def send(index: int) -> int:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.001 * (index % 3))
        in_flight -= 1
        sent.append(index)
        return index * 10

    results = asyncio.run(closed_loop(send, 4, range(50)))
    assert sorted(sent) == list(range(50)) and sorted(results) == [i * 10 for i in range(50)]
    assert most == 4, "four clients, each one request at a time"


def test_closed_loop_stops_before_a_send_and_keeps_what_came_when_a_client_fails() -> None:
    import asyncio

    answered: list[int] = []

    async def send(index: int) -> int:
        await asyncio.sleep(0)
        return index

    asyncio.run(closed_loop(send, 2, range(1000), stop=lambda: len(answered) >= 7, into=answered))
    assert 7 <= len(answered) <= 8, "each client finishes the request it has in flight, then stops"

    async def failing(index: int) -> int:
        if index == 5:
            raise RuntimeError("client broke")
        await asyncio.sleep(0.01)
        return index

    kept: list[int] = []
    with pytest.raises(RuntimeError, match="client broke"):
        asyncio.run(closed_loop(failing, 3, itertools.count(), into=kept))
    assert kept and 5 not in kept, "what was answered before the failure is kept; no client outlives the loop"


def test_oip_images_builds_the_request_each_server_parses() -> None:
    from service.http.oip.json_request import read_infer_body

    body, headers = oip_images(b"\xff\xd8jpeg", 3)
    request = read_infer_body(body, headers["Inference-Header-Content-Length"])
    assert request.input.name == "IMAGE" and request.input.shape == [3]
    assert request.input.contents("BYTES") == [b"\xff\xd8jpeg"] * 3
    assert [(o.name, o.binary) for o in request.outputs] == [("LABELS", True)]

    body, headers = oip_images(b"abc", input_name="image", output_names=("a", "b"), shape=(1, 1), binary_outputs=False)
    header = json.loads(body[: int(headers["Inference-Header-Content-Length"])])
    assert header["inputs"][0]["name"] == "image" and header["inputs"][0]["shape"] == [1, 1]
    assert [o["parameters"]["binary_data"] for o in header["outputs"]] == [False, False]
    with pytest.raises(ValueError, match="holds 4 elements, not 3"):
        oip_images(b"abc", 3, shape=(2, 2))


def test_served_configs_name_their_artifact_by_backend_and_precision(tmp_path) -> None:
    from benchmarks.experiments import VISION_SERVE_CONFIGS, engine_label
    from benchmarks.harness.suite import Inputs

    inputs = Inputs("resnet152", tmp_path, tmp_path / "images", tmp_path / "w.pt")
    inputs.artifacts = {"inductor-fp32": tmp_path / "a", "onnx-fp32": tmp_path / "b"}
    by_label = {config.label: config for config in VISION_SERVE_CONFIGS}
    onnx = by_label["vision-serve onnx fp32"]
    args = onnx.args(inputs)
    assert args[args.index("--artifact") + 1] == str(tmp_path / "b") and engine_label(onnx) == "onnx-fp32"
    assert engine_label(by_label["vision-serve eager fp32"]) == "eager-fp32"


def test_precisions_a_backend_refuses_are_skipped_without_compiling(tmp_path, caplog) -> None:
    from benchmarks.harness.suite import prepare_inputs

    (tmp_path / "images").mkdir()
    torch.save({}, tmp_path / "resnet152-random-v2.pt")  # the weights file exists: nothing to build
    inputs = prepare_inputs("resnet152", tmp_path, "random", ["bf16"], ["onnx"])
    assert inputs.artifacts == {}
    assert "No onnx bf16 artifact" in caplog.text


def test_ceiling_clocks_stop_once_the_device_is_done_injected(monkeypatch) -> None:
    """A GPU runs kernels after the call that queued them returns: the ceiling's timed calls (model
    and preprocessing) synchronize the device before the clock stops. torch.cuda.synchronize is the
    boundary (no GPU here): recorded."""
    import torch

    from benchmarks.ceiling import until_device_done

    order: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append(("synchronize", str(device))))
    work = until_device_done(lambda: order.append("work") or "prepared", torch.device("cuda:1"))
    assert work() == "prepared" and order == ["work", ("synchronize", "cuda:1")]
    order.clear()
    assert until_device_done(lambda: order.append("work"), torch.device("cpu"))() is None and order == ["work"]


def _quantized_run(engine: str, batch: int, rps: float | None, p99: float = 100.0, round_: int = 1) -> dict:
    return {"engine": engine, "max_batch_size": batch, "round": round_, "throughput_rps": rps,
            "p50_ms": p99 / 2, "p99_ms": p99}  # fmt: skip


def test_quantized_best_batch_is_the_highest_median_and_the_ratio_is_to_the_baselines_best() -> None:
    """Medians over rounds per max batch; the best batch by img/s (a tie goes to the smaller batch);
    the ratio compares each engine's best with onnx-fp32's best, not batch by batch."""
    from benchmarks.quantized import best_batch, medians, summarize

    runs = [
        # onnx-fp32: best at 16 (median 12 over three rounds; round 3's 30 is an outlier the median drops)
        _quantized_run("onnx-fp32", 8, 10.0), _quantized_run("onnx-fp32", 8, 11.0, round_=2),
        _quantized_run("onnx-fp32", 16, 12.0, 200.0), _quantized_run("onnx-fp32", 16, 11.0, 300.0, 2),
        _quantized_run("onnx-fp32", 16, 30.0, 900.0, 3),
        # onnx-int8: best at 8; its 32 failed to serve and counts nowhere
        _quantized_run("onnx-int8", 8, 24.0, 80.0), _quantized_run("onnx-int8", 16, 18.0),
        _quantized_run("onnx-int8", 32, None),
        # a tie: the smaller max batch
        _quantized_run("inductor-bf16", 8, 15.0), _quantized_run("inductor-bf16", 32, 15.0),
    ]  # fmt: skip
    table = medians(runs)
    assert table["onnx-fp32"][16] == {"throughput_rps": 12.0, "p50_ms": 150.0, "p99_ms": 300.0, "rounds": 3}
    assert set(table["onnx-int8"]) == {8, 16}
    assert best_batch(table["inductor-bf16"]) == 8 and best_batch({}) is None
    summary = summarize(runs)
    assert summary["onnx-fp32"]["best_max_batch_size"] == 16 and summary["onnx-fp32"]["ratio_to_baseline"] == 1.0
    int8 = summary["onnx-int8"]
    assert (int8["best_max_batch_size"], int8["throughput_rps"], int8["p99_ms"]) == (8, 24.0, 80.0)
    assert int8["ratio_to_baseline"] == pytest.approx(24.0 / 12.0)
    assert summary["inductor-bf16"]["ratio_to_baseline"] == pytest.approx(15.0 / 12.0)
    # Without the baseline (it failed its gate) there is no ratio, and no crash.
    without = summarize([r for r in runs if r["engine"] != "onnx-fp32"])
    assert without["onnx-int8"]["ratio_to_baseline"] is None


def test_quantized_table_gives_gate_figures_and_why_an_engine_is_missing() -> None:
    from benchmarks.quantized import cpu_units, model_table, summarize

    runs = [_quantized_run("onnx-fp32", 8, 40.0, 460.0), _quantized_run("onnx-int8", 8, 60.0, 300.0)]
    builds = {
        "onnx-fp32": {"status": "ok", "compile_seconds": 8.3, "metrics": {"top1_agreement": 1.0}},
        "onnx-int8": {"status": "ok", "compile_seconds": 72.3,
                      "metrics": {"top1_agreement": 0.890625, "top5_agreement": 1.0, "mean_prob_drop": 0.0123,
                                  "cosine": 0.95385}},
        "inductor-int8": {"status": "gate failed",
                          "message": "compile-trt: accuracy gate FAILED, no artifact written:\n"
                                     "  top1_agreement         0.5  (needs >= 0.85)  FAIL\n"
                                     "  top5_agreement         0.97  (needs >= 0.95)  ok\n"
                                     "  mean_prob_drop         0.09  (needs <= 0.05)  FAIL\n"},
        "onnx-bf16": {"status": "unavailable", "message": "compile-trt: --backend onnx cannot build bf16:\n a | b"},
    }  # fmt: skip
    engines = ["onnx-fp32", "onnx-int8", "inductor-int8", "onnx-bf16"]
    lines = model_table(engines, builds, summarize(runs), "onnx-fp32").splitlines()
    assert lines[0].endswith("| ratio to onnx-fp32 |") and len(lines) == 6
    assert lines[2] == "| onnx-fp32 | 8 | 1.000 / - / - / - | 8 | 40.0 | 460 | 1.00x |"
    assert lines[3] == "| onnx-int8 | 72 | 0.891 / 1.000 / 0.012 / 0.9538 | 8 | 60.0 | 300 | 1.50x |"
    # A failed gate: the figures that failed. Another reason: compile-trt's message on one line, its "|"
    # kept out of the table's columns.
    assert lines[4] == (
        "| inductor-int8 |  | gate failed: top1_agreement 0.5 (needs >= 0.85) FAIL; "
        "mean_prob_drop 0.09 (needs <= 0.05) FAIL |  |  |  |  |"
    )
    assert lines[5] == (
        "| onnx-bf16 |  | unavailable: compile-trt: --backend onnx cannot build bf16: a / b |  |  |  |  |"
    )
    flags = "processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni amx_tile\nprocessor\t: 1\n"
    units = cpu_units(flags)
    assert units["avx512_vnni"] and units["amx_tile"] and not units["avx512_bf16"] and not units["amx_int8"]
    assert not any(cpu_units("no flags here").values())


def test_the_compiled_throughput_benchmark_feeds_each_engine_its_height_by_width_input() -> None:
    from benchmarks.compiled_throughput import measure

    shapes: list[tuple[int, ...]] = []

    def engine(images: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(images.shape))
        return images.mean(dim=(2, 3))

    results = measure({"engine": engine}, [1, 2], (48, 64), torch.device("cpu"), repeats=1)
    assert set(shapes) == {(1, 3, 48, 64), (2, 3, 48, 64)} and set(results["engine"]) == {1, 2}
