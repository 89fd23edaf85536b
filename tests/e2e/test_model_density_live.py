"""The density benchmark (benchmarks/model_density.py) against real servers: its PSS sum over a server's
process tree agrees with the kernel's own per-process figures, and its memory part, run end to end on
a repository of 1 and 2 EfficientNet-Lite0 ONNX models, writes a record whose numbers add up and
leaves no server process behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from benchmarks import model_density
from benchmarks.harness.repository_server import compile_cached, make_repository, serving, warm_each
from benchmarks.harness.tree_memory import tree_memory
from compile import sample_photo_file
from compile.sample_photos import CAT_LABELS

pytestmark = pytest.mark.slow  # a compile (~10 s) and three servers of Lite0 workers on 2 cores


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("density-cache")
    compile_cached(directory / "efficientnet-lite0-onnx-b1-8-8", *model_density.LITE_ARGS)
    return directory


def kernel_pss_mib(pid: int) -> float:
    """Pss of one process as /proc/PID/smaps_rollup states it (kB), read here and not through psutil."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no Pss line for {pid}")


def test_the_tree_sum_is_every_process_of_the_server_session(cache, tmp_path) -> None:
    repository = make_repository(tmp_path / "repo", cache / "efficientnet-lite0-onnx-b1-8-8", 2, 8)
    with serving(repository, ["--worker-isolation", "process"], tmp_path / "server.log") as (server, _):
        assert [a["status"] for a in warm_each(server.url, ["m001", "m002"], sample_photo_file("chelsea"))] == [
            200,
            200,
        ]
        measured = tree_memory(server.process.pid)
        # Independently: every process of the server's session (it starts one of its own), by the kernel.
        session = [p for p in psutil.process_iter() if _session(p) == server.process.pid]
        kernel = sum(kernel_pss_mib(p.pid) for p in session)
    assert {entry["pid"] for entry in measured["each"]} == {p.pid for p in session}
    roles = measured["by_role"]
    assert roles["worker"]["count"] == 2 and roles["main"]["count"] == 1 and "http" in roles
    assert measured["pss_mib"] == pytest.approx(sum(r["pss_mib"] for r in roles.values()))
    assert measured["pss_mib"] == pytest.approx(kernel, abs=20)  # memory moves a little between the reads
    assert roles["worker"]["pss_mib"] > 2 * 150  # a Lite0 ONNX worker holds torch and ONNX Runtime


def _session(process: psutil.Process) -> int | None:
    try:
        return os.getsid(process.pid)
    except (ProcessLookupError, PermissionError):
        return None


def test_the_memory_part_measures_each_size_and_stops_its_servers(cache, tmp_path) -> None:
    out = tmp_path / "out"
    argv = ["--parts", "memory", "--sizes", "1,2", "--max-models", "2", "--worker-isolation", "process"]
    assert model_density.main([*argv, "--cache", str(cache), "--out", str(out)]) == 0
    record = json.loads((out / "model-density.json").read_text())
    lite = record["results"]["memory"]["lite0"]
    sizes = lite["by_size"]
    assert sorted(sizes) == ["1", "2"]
    assert sizes["1"]["answered_like_model_1"] == 1 and sizes["2"]["answered_like_model_1"] == 2
    for run in lite["runs"]:
        roles = run["by_role"]
        assert roles["worker"]["count"] >= 1 and run["processes"] == sum(r["count"] for r in roles.values())
        assert run["first_labels"][0] in CAT_LABELS  # chelsea is a cat
        # Every process of that server is gone: a leftover worker would be counted by the next size.
        assert not any(psutil.pid_exists(entry["pid"]) for entry in run["each"]), run["each"]
    # Two sizes: the slope is the difference.
    assert lite["mib_per_added_model"] == pytest.approx(sizes["2"]["pss_mib"] - sizes["1"]["pss_mib"])
    assert lite["engine"]["weights_mib"] == pytest.approx(
        (cache / "efficientnet-lite0-onnx-b1-8-8" / "model.onnx").stat().st_size / 2**20
    )
    summary = (out / "model-density.md").read_text()
    assert "MiB PSS per added model" in summary and "benchmarks.model_swap" in summary
