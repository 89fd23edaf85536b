"""Versions of installed packages, and the one way this project reads a version number."""

from __future__ import annotations

import importlib.metadata
import platform
import re

# This project's distribution name, as pip and importlib.metadata know it.
PROJECT_DISTRIBUTION = "vision-serve"


def package_version(name: str) -> str | None:
    """The installed version of the distribution ``name``, or ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# Libraries shipped under more than one distribution name, with one import name: the GPU build of
# ONNX Runtime is `onnxruntime-gpu`. An artifact records (and a server checks) the library, whichever build.
DISTRIBUTIONS = {"onnxruntime": ("onnxruntime", "onnxruntime-gpu")}


def library_version(name: str) -> str | None:
    """The installed version of the library ``name``, under any of its distribution names."""
    return next(filter(None, (package_version(d) for d in DISTRIBUTIONS.get(name, (name,)))), None)


def library_versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    """Versions of the libraries an artifact depends on (those installed among ``extra`` too)."""
    import torch  # here, not at the top: the server's main process reads package versions without it

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("torchvision", *extra):
        version = library_version(name)
        if version is not None:
            versions[name] = version
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    return versions


def major_minor(version: str) -> tuple[int, int]:
    """``"2.14.0+cu130"`` -> ``(2, 14)``: the part of a version that compatibility is judged by.

    The local tag (``+cu130``) and anything after a part's leading digits (``0rc1``, ``dev2025``)
    are ignored; a missing or non-numeric part counts as 0, so ``"10"`` is ``(10, 0)``.
    """
    parts = [*version.split("+")[0].split("."), "0"][:2]
    major, minor = (int(re.match(r"\d*", part).group() or 0) for part in parts)
    return major, minor
