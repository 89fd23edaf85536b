"""service/metrics.py without a server: the multiprocess directory's life, GPU labels, the live gauges."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.metrics import (
    MULTIPROC_ENV,
    LiveState,
    LiveStateCollector,
    exposition,
    metrics,
    multiprocess_mode,
    physical_gpu,
)


@pytest.mark.parametrize(
    ("index", "visible", "label"),
    [
        (0, None, "cuda:0"),
        (1, "", "cuda:1"),
        (0, "3", "cuda:3"),  # --device cuda:3: the worker sees it as cuda:0
        (1, "2, 5", "cuda:5"),
        (0, "GPU-8f6e1c2a-uuid", "GPU-8f6e1c2a-uuid"),
    ],
)
def test_gpu_memory_is_labelled_with_the_gpu_nvidia_smi_shows(index: int, visible: str | None, label: str) -> None:
    assert physical_gpu(index, visible) == label


def _count_images(n: int) -> None:
    metrics().observe_batch(n)


def test_multiprocess_mode_sums_children_and_cleans_up_after_itself(tmp_path, monkeypatch) -> None:
    operator_dir = tmp_path / "prom"
    monkeypatch.setenv(MULTIPROC_ENV, str(operator_dir))
    with multiprocess_mode() as directory:
        # A private directory inside the operator's: two servers never mix or delete each other's files.
        assert os.path.dirname(directory) == str(operator_dir) and os.environ[MULTIPROC_ENV] == directory
        for n in (3, 4):  # spawned like the inference workers
            child = mp.get_context("spawn").Process(target=_count_images, args=(n,))
            child.start()
            child.join(60)
            assert child.exitcode == 0
        families = {f.name: f for f in text_string_to_metric_families(exposition(None).decode())}
        assert families["vision_serve_images"].samples[0].value == 7
        # Made at entry: series that exist at 0 before anything happens.
        assert families["vision_serve_worker_restarts"].samples[0].value == 0
    assert not os.path.exists(directory) and os.environ[MULTIPROC_ENV] == str(operator_dir)


def test_without_multiprocess_mode_a_process_shows_its_own_values(monkeypatch) -> None:
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    with multiprocess_mode():
        pass  # leaves the process in-process mode again
    assert MULTIPROC_ENV not in os.environ
    metrics().observe_batch(5)
    live = LiveStateCollector(
        LiveState(
            queue_depth=lambda: 2,
            in_flight=lambda: 9,
            in_flight_limit=64,
            worker_states=lambda: {"worker_0": "ready", "worker_1": "starting"},
            build_info=lambda: {"version": "1", "model": "m"},
            models=lambda: [("m", "1", True), ("m", "2", False)],
        )
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(exposition(live).decode())
        for s in f.samples
    }
    assert samples[("vision_serve_images_total", ())] >= 5
    assert samples[("vision_serve_queue_depth", ())] == 2 and samples[("vision_serve_requests_in_flight", ())] == 9
    assert samples[("vision_serve_requests_in_flight_limit", ())] == 64
    assert samples[("vision_serve_workers", (("state", "ready"),))] == 1
    assert samples[("vision_serve_workers", (("state", "starting"),))] == 1
    assert samples[("vision_serve_build_info", (("model", "m"), ("version", "1")))] == 1
    assert samples[("vision_serve_model_ready", (("model", "m"), ("version", "2")))] == 0
