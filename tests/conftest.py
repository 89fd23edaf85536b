"""Shared fixtures: real sample images (scikit-image, public domain / CC0); the tier and gpu markers.

Tiers, by folder: ``tests/unit`` (no server, no model run beyond a few milliseconds: ``make test-fast``),
``tests/integration`` (a real worker or compiler in process), ``tests/e2e`` (real servers as
subprocesses on loopback), ``tests/container`` (the images built and run with podman: slow, always).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from PIL import Image

from compile.sample_photos import CAT_LABELS, sample_photo, sample_photo_file
from tests.worker_hold import HOLD_SAFE_ENV

__all__ = ["CAT_LABELS"]  # the tests import it from here


# The servers the suite starts run one inference worker each, whatever the machine: the tests that hold
# a worker (tests/worker_hold.py) or count its batches rely on there being one, and two per server
# would add a model load to each of the suite's many starts. The automatic choice is tested where it
# is the subject (tests/unit/test_sizing.py, tests/e2e/test_sizing_live.py), with this variable removed.
os.environ.setdefault("VISION_SERVE_WORKERS_PER_DEVICE", "1")
# Tests hold workers with SIGSTOP to make requests share a batch (tests/worker_hold.py): a hold must not
# read as a hang. The hang detection is tested with bounds of its own (tests/e2e/test_hung_workers.py).
for _name, _value in HOLD_SAFE_ENV.items():
    os.environ.setdefault(_name, _value)

# Under pytest-xdist (make test-slow, the unit tier) each test process has a temp dir of its own, which
# the servers and compiles it starts inherit: what one process's tests unpack or leave there is never
# taken for another's (the GPU headline's dry run checks that it left nothing in /tmp).
if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("VISION_SERVE_TEST_TMPDIR"):
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix=f"vision-serve-tests-{os.environ['PYTEST_XDIST_WORKER']}-")
    os.environ["VISION_SERVE_TEST_TMPDIR"] = os.environ["TMPDIR"]
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again

TIERS = ("unit", "integration", "e2e", "container")  # the folders under tests/: where a test lives says what it needs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier (``-m unit``, ``-m "not e2e"``), and skip GPU tests without a GPU."""
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU; torch sees none")
    for item in items:
        tier = next((part for part in item.path.parts[-3:-1] if part in TIERS), None)
        if tier is None:
            raise pytest.UsageError(
                f"{item.nodeid}: tests live in tests/unit, tests/integration, tests/e2e or tests/container."
            )
        item.add_marker(tier)
        if tier == "container":  # image builds of minutes: never in make test
            item.add_marker("slow")
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``-n N --dist loadfile`` (make test-slow) with the container tier as one unit: a file's tests
    share its module's servers and compiles, and every container test the images one process builds
    (two processes would build each image twice, at once)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedBuildScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/container" if path.startswith("tests/container/") else path

    return SharedBuildScheduling(config, log)


def sample_array(name: str) -> np.ndarray:
    return sample_photo(name)


def encode(img: Image.Image | np.ndarray, fmt: str = "JPEG", **save_kwargs: object) -> bytes:
    if isinstance(img, np.ndarray):
        img = Image.fromarray(img)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


@pytest.fixture(scope="session")
def chelsea_jpeg() -> bytes:
    return sample_photo_file("chelsea")


@pytest.fixture(scope="session")
def coffee_jpeg() -> bytes:
    return sample_photo_file("coffee")


@pytest.fixture(scope="session")
def truncated_jpeg(chelsea_jpeg: bytes) -> bytes:
    """A JPEG cut in the middle of its pixel data: the header parses, the decode fails."""
    return chelsea_jpeg[: len(chelsea_jpeg) // 2]


def command_line(process: psutil.Process) -> str:
    """The process's command line, or "" once it has exited or is a zombie not yet reaped.

    A shell's short-lived children (command substitutions, `mkdir`) turn into zombies between
    listing and reading; psutil raises for those, and a scan of children must not fail on them.
    """
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def inference_workers(server_process) -> list[psutil.Process]:
    """The spawned inference worker processes of a running ``service.client.launcher.ServerProcess``."""
    children = psutil.Process(server_process.process.pid).children(recursive=True)
    return [p for p in children if "spawn_main" in command_line(p)]


@pytest.fixture(scope="session")
def images_dir(tmp_path_factory: pytest.TempPathFactory):
    """A folder of the benchmark photos (service.tune.images), for the load generator and friends."""
    from service.tune.images import write_benchmark_images

    directory = tmp_path_factory.mktemp("bench-images")
    write_benchmark_images(directory)
    return directory


def compile_eager(output: Path, *args: str) -> None:
    """compile-trt's eager backend (batches 1, 4, 8) into ``output``, as a user runs it."""
    command = [sys.executable, "-m", "compile.cli", "--log-level", "warning", "--backend", "eager", "--batch", "1,4,8"]
    completed = subprocess.run([*command, *args, "--output", str(output)], capture_output=True)
    assert completed.returncode == 0, completed.stdout.decode() + completed.stderr.decode()


@pytest.fixture(scope="session")
def lite0_eager_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """compile-trt's eager EfficientNet-Lite0 artifact (batches 1, 4, 8), compiled once per session: the
    model repositories of the e2e tier copy it into their versions (shutil.copytree; never change it)."""
    output = tmp_path_factory.mktemp("lite0-eager") / "artifact"
    compile_eager(output, "--model", "efficientnet-lite0")
    return output
