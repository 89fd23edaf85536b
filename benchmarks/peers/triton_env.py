"""A virtualenv with NVIDIA PyTriton for the Triton peers, made once and reused.

PyTriton 0.7 ships the real tritonserver binary. Its Python model stub loads only with Python 3.13
here (3.11 and 3.12 fail: measured), so the peer gets a virtualenv of its own on a Python 3.13
interpreter, as the TorchServe peer gets its Java. PyTriton pins numpy<2, which has no 3.13 wheel:
the first setup builds numpy from source (several minutes on 2 cores; pip caches the wheel).

The model peer (benchmarks.peers.triton_peer) also needs torch, torchvision and Pillow there: they are
added only when asked for (``--model``), because the CUDA build of torch and its libraries are
several GB, and the no-op front-end peer needs none of them.

    python -m benchmarks.peers.triton_env            # make it (if needed) and print its python
    python -m benchmarks.peers.triton_env --model    # the same, with the model peer's packages
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

PYTRITON_REQUIREMENT = "nvidia-pytriton==0.7.*"
# The same torch and torchvision releases as vision-serve's own environment, so both sides run the same
# kernels. The registry's default build (CUDA) is what pip finds here; its CPU kernels are the same code.
# efficientnet-lite-pytorch builds the EfficientNet-Lite architecture (the offline model with real weights).
MODEL_REQUIREMENTS = ("torch==2.14.*", "torchvision==0.29.*", "pillow", "efficientnet-lite-pytorch==0.1.0")
MODEL_IMPORT_CHECK = "import torch, torchvision, PIL, efficientnet_lite_pytorch"
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


def default_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _imports(python: Path, statement: str) -> bool:
    return python.exists() and subprocess.run([str(python), "-c", statement], capture_output=True).returncode == 0


def model_env_ready(venv: Path | None = None) -> bool:
    """Whether the virtualenv has PyTriton and the model peer's packages; makes and installs nothing."""
    return _imports(venv_python(venv or default_venv()), f"import pytriton.triton; {MODEL_IMPORT_CHECK}")


def ensure_venv(venv: Path | None = None, *, model: bool = False) -> Path:
    """The virtualenv's python, after making the virtualenv and installing PyTriton if they are missing;
    with ``model``, also the model peer's packages (``MODEL_REQUIREMENTS``)."""
    venv = venv or default_venv()
    python = venv_python(venv)
    if not _imports(python, "import pytriton.triton"):
        logger.info("Making the Triton peer's virtualenv in %s (the first time builds numpy; minutes)", venv)
        subprocess.run([find_python(), "-m", "venv", "--clear", str(venv)], check=True)
        _pip_install(python, [PYTRITON_REQUIREMENT], "import pytriton.triton")
    if model and not _imports(python, MODEL_IMPORT_CHECK):
        logger.info("Installing the Triton model peer's packages into %s (torch: ~1 GB download)", venv)
        _pip_install(python, MODEL_REQUIREMENTS, MODEL_IMPORT_CHECK)
    return python


def _pip_install(python: Path, requirements: Sequence[str], check: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *requirements], check=True)
    if not _imports(python, check):
        raise TritonEnvError(f"{' '.join(requirements)} installed into {python.parent.parent} but `{check}` fails.")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="store_true", help="also torch, torchvision and Pillow (the model peer)")
    parser.add_argument("--venv", type=Path, default=None, help=f"default: ${VENV_ENV} or {DEFAULT_VENV}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(ensure_venv(args.venv, model=args.model))
    except (TritonEnvError, subprocess.CalledProcessError) as exc:
        logger.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
