"""A virtualenv with NVIDIA PyTriton for the Triton peer, made once and reused.

PyTriton 0.7 ships the real tritonserver binary. Its Python model stub loads only with Python 3.13
here (3.11 and 3.12 fail: measured), so the peer gets a virtualenv of its own on a Python 3.13
interpreter, as the TorchServe peer gets its Java. PyTriton pins numpy<2, which has no 3.13 wheel:
the first setup builds numpy from source (several minutes on 2 cores; pip caches the wheel).

    python -m benchmarks.triton_env            # make it (if needed) and print its python
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

PYTRITON_REQUIREMENT = "nvidia-pytriton==0.7.*"
PYTHON_VERSION = "3.13"
VENV_ENV = "VISION_SERVE_TRITON_VENV"
DEFAULT_VENV = Path.home() / ".cache" / "vision-serve" / "pytriton-venv"


class TritonEnvError(RuntimeError):
    pass


def find_python(version: str = PYTHON_VERSION) -> str:
    """A ``python<version>`` on PATH that runs, else one that pyenv installed.

    Runs each candidate: pyenv puts a shim for every installed version on PATH, and the shim fails
    unless that version is selected (``pyenv global``/``local``).
    """
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = [shutil.which(f"python{version}")]
    candidates += sorted(map(str, pyenv_root.glob(f"versions/{version}.*/bin/python{version}")), reverse=True)
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode == 0:
            return candidate
    raise TritonEnvError(
        f"The Triton peer needs Python {version} (PyTriton's model stub fails on 3.11 and 3.12): install it "
        f"(pyenv install {version}) or put python{version} on PATH."
    )


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path | None = None) -> Path:
    """The virtualenv's python, after making the virtualenv and installing PyTriton if they are missing."""
    venv = venv or Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)
    python = venv_python(venv)
    check = [str(python), "-c", "import pytriton.triton"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    logger.info("Making the Triton peer's virtualenv in %s (the first time builds numpy; minutes)", venv)
    subprocess.run([find_python(), "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", PYTRITON_REQUIREMENT], check=True)
    if subprocess.run(check, capture_output=True).returncode != 0:
        raise TritonEnvError(f"PyTriton was installed in {venv} but does not import; see pip's output above.")
    return python


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(ensure_venv())
    except (TritonEnvError, subprocess.CalledProcessError) as exc:
        logger.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
