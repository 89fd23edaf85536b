"""External tools some tests drive (promtool, chromium, hadolint, kubectl...): skip locally where one is
missing, fail in CI, which installs them all and sets VISION_SERVE_REQUIRE_TOOLS=1."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REQUIRE_ENV = "VISION_SERVE_REQUIRE_TOOLS"


def require_tool(name: str, path: str | None = None) -> str:
    """The tool's path; skips the test where it is missing, or fails it when CI requires every tool."""
    # pip-installed tools sit next to this interpreter, which need not be on PATH (CI runs venv/bin/python).
    beside_python = Path(sys.executable).parent / name
    found = path if path and os.access(path, os.X_OK) else None
    found = found or (str(beside_python) if os.access(beside_python, os.X_OK) else shutil.which(name))
    if found:
        return found
    message = f"{name} is not installed (CI installs it: see .ci/run)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(message)
    pytest.skip(message)


def kustomize(directory: Path) -> list[dict]:
    """The objects ``kubectl kustomize directory`` renders."""
    kubectl = require_tool("kubectl")
    done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def kustomize_overlay(folder: Path, base: Path, components: list[Path], images: list[dict] | None = None) -> list[dict]:
    """``base`` with ``components`` (and ``images``) rendered from an overlay written in ``folder``, as a
    user's overlay would be: paths relative to it."""
    spec: dict = {"resources": [os.path.relpath(base, folder)]}
    spec["components"] = [os.path.relpath(component, folder) for component in components]
    if images:
        spec["images"] = images
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    return kustomize(folder)
