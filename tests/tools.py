"""External tools some tests drive (promtool, chromium, hadolint...): skip locally where one is missing,
fail in CI, which installs them all and sets VISION_SERVE_REQUIRE_TOOLS=1."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

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
