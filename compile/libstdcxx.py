"""Run AOTInductor CUDA packages against the C++ runtime of the compiler that built them.

AOTInductor compiles each package's wrapper with the system C++ compiler. Measured on an H100
machine (torch 2.11.0+cu130 wheels from PyPI, Ubuntu 24.04, g++ 13.3, 2026-11-22): loading any CUDA
package, ours or a plain torchvision ResNet-18, segfaulted inside the wrapper's own ``std::regex``
(``parse_device_str``) in ``aoti_load_package``. With that compiler's ``libstdc++.so.6`` in
``LD_PRELOAD`` the same packages loaded, compiled, passed their gate and served. The loader reads
``LD_PRELOAD`` only when a process starts, so:

- ``compile-trt`` (which loads the package for its accuracy gate) starts itself again with it set;
- ``vision-serve`` sets it before its inference workers are spawned.

Only processes that load such a package get it. Set ``VISION_SERVE_NO_LIBSTDCXX_PRELOAD=1`` to
turn this off.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

OPT_OUT_ENV = "VISION_SERVE_NO_LIBSTDCXX_PRELOAD"
RESTARTED_ENV = "VISION_SERVE_PRELOAD_RESTARTED"  # set in the restarted process: never restart twice
NVIDIA_DEVICE_NODE = Path("/dev/nvidiactl")  # present where an NVIDIA driver is (containers included)


def compiler_libstdcxx(compiler: str | None = None) -> Path | None:
    """The ``libstdc++.so.6`` that the C++ compiler AOTInductor uses ($CXX, else g++) links against."""
    compiler = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        return None
    try:
        found = subprocess.run(
            [*shlex.split(compiler), "-print-file-name=libstdc++.so.6"],  # $CXX may be "ccache g++"
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    path = Path(found)  # a bare name (not absolute) means the compiler does not know the file
    return path.resolve() if path.is_absolute() and path.exists() else None


def preload_environment(environ: Mapping[str, str], library: Path | None) -> dict[str, str] | None:
    """``environ`` with ``library`` first in ``LD_PRELOAD``, or ``None`` when nothing is to change
    (not Linux, turned off, no library found, or a libstdc++ already preloaded)."""
    if not sys.platform.startswith("linux") or library is None:
        return None
    if environ.get(OPT_OUT_ENV) or environ.get(RESTARTED_ENV):
        return None
    current = environ.get("LD_PRELOAD", "")
    if any(Path(entry).name.startswith("libstdc++") for entry in current.replace(":", " ").split()):
        return None
    return {**environ, "LD_PRELOAD": f"{library} {current}".strip()}  # ld.so takes spaces or colons


def nvidia_gpu_present() -> bool:
    """Cheap and import-free: whether an NVIDIA driver's device node exists."""
    return NVIDIA_DEVICE_NODE.exists()


def _environment_for(device: str) -> dict[str, str] | None:
    """This process's environment with the preload, where work on ``device`` needs it; else ``None``."""
    if device == "cpu" or not nvidia_gpu_present():
        return None
    return preload_environment(os.environ, compiler_libstdcxx())


def preload_for_children(device: str) -> None:
    """For a server: processes started from here on (the spawned workers) preload the library."""
    environ = _environment_for(device)
    if environ is not None:
        os.environ["LD_PRELOAD"] = environ["LD_PRELOAD"]
        logger.debug("Workers preload %s (AOTInductor CUDA packages need it)", environ["LD_PRELOAD"])


def restart_with_preload(device: str, argv: Sequence[str] | None = None) -> None:
    """For a command that loads a package in its own process: start it again with the library
    preloaded, replacing this process (``argv``: the interpreter's arguments, by default those this
    process was started with, flags included). Returns, doing nothing, when it is not needed."""
    environ = _environment_for(device)
    if environ is None:
        return
    argv = list(sys.orig_argv[1:] if argv is None else argv)
    logger.debug("Restarting with LD_PRELOAD=%s", environ["LD_PRELOAD"])
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *argv], {**environ, RESTARTED_ENV: "1"})
    except OSError as exc:  # go on without it: the package may still load
        logger.warning("Could not restart with LD_PRELOAD=%s (%s); going on without it.", environ["LD_PRELOAD"], exc)
