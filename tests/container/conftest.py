"""The images, built from a clean checkout as a user builds them and run with podman (deploy/podman/).

Slow (minutes of image builds: several GB of torch). Skipped only where podman cannot be installed, which
.ci/run says in VISION_SERVE_NO_PODMAN; anywhere else a missing podman fails like any missing tool in CI.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from benchmarks.harness.podman import Build, build, clean_checkout
from tests.tools import require_tool

NO_PODMAN_ENV = "VISION_SERVE_NO_PODMAN"  # set by .ci/run, with the reason, when podman cannot be installed


@pytest.fixture(scope="session")
def podman_ready() -> None:
    if shutil.which("podman") is None and os.environ.get(NO_PODMAN_ENV):
        pytest.skip(f"podman cannot be installed here: {os.environ[NO_PODMAN_ENV]}")
    require_tool("podman")
    require_tool("mmdebstrap")


@pytest.fixture(scope="session")
def checkout(podman_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a clean clone holds: the tracked files only (no .venv, no artifacts)."""
    return clean_checkout(tmp_path_factory.mktemp("checkout"))


@pytest.fixture(scope="session")
def cpu_image(checkout: Path) -> Build:
    """`make image` in the clean checkout: the CPU image, its reference printed last."""
    return build(["make", "--no-print-directory", "image"], cwd=checkout)


@pytest.fixture(scope="session")
def gpu_image(checkout: Path) -> Build:
    """Dockerfile.gpu, built on the stand-in for its NGC base."""
    return build(["bash", "deploy/podman/image.sh", "gpu"], cwd=checkout)


@pytest.fixture(scope="session")
def run_id() -> str:
    return uuid.uuid4().hex[:8]
