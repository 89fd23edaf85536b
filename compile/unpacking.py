"""Where AOTInductor unpacks the packages it loads, and who removes what it unpacked.

``aoti_load_package`` extracts the package (the model's shared library and weights, as large as the
model) into a new folder of the temp dir, and only the loader's C++ destructor removes it. That
destructor does not run in a process that ends with ``os._exit`` (an inference worker whose device
broke, any multiprocessing child started by fork), in one that is killed, nor reliably at interpreter
exit: each load left a copy of the model behind, on every server start, worker restart and model swap,
until the temp dir filled.

So each process has one folder of its own, removed when the process exits normally. Recent torch
unpacks into it (its loader reads ``TMPDIR``); older torch (2.11, the GPU machine's) always unpacks into
``/tmp``, so the folder it used, found by the engine library this process mapped from it, is recorded in
this process's folder and removed with it. A server also names a root for its workers' folders
(``unpack_root``) inside its run folder: it removes a worker's folder, and what that folder records,
when the worker ended (``remove_unpacked_of``), and the root after its last worker.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

# Set by a server for the processes it starts: where their unpack folders go.
UNPACK_ROOT_ENV = "VISION_SERVE_UNPACK_ROOT"
# In a process's folder: the folders its loads unpacked elsewhere, a path per line.
ELSEWHERE_FILE = "unpacked-elsewhere"
# What marks a folder as an unpacked AOTInductor package (its layout, on every torch release since 2.6).
PACKAGE_LAYOUT = "data/aotinductor"

T = TypeVar("T")

_lock = threading.Lock()
_folder: tuple[int, str] | None = None  # (pid that made it, path): a forked child makes its own


def process_unpack_dir() -> str:
    """This process's folder for unpacked packages: made on first use, removed at exit."""
    global _folder
    with _lock:
        pid = os.getpid()
        if _folder is None or _folder[0] != pid or not os.path.isdir(_folder[1]):
            root = os.environ.get(UNPACK_ROOT_ENV) or None
            if root is not None:
                os.makedirs(root, exist_ok=True)
            path = tempfile.mkdtemp(prefix=f"unpacked-{pid}-", dir=root)
            atexit.register(remove_folder, path)
            _folder = (pid, path)
        return _folder[1]


def load_unpacked(load: Callable[[], T]) -> T:
    """``load()`` (an ``aoti_load_package`` call) with what it unpacks owned by this process's folder."""
    folder = process_unpack_dir()
    before = mapped_files()
    with _variable("TMPDIR", folder):  # C++'s temp_directory_path reads it; Python's tempfile cached its own
        loaded = load()
    elsewhere = unpacked_elsewhere(mapped_files() - before, folder)
    if elsewhere:
        with open(os.path.join(folder, ELSEWHERE_FILE), "a") as record:
            record.writelines(f"{path}\n" for path in elsewhere)
        logger.debug("This torch unpacked the engine into %s, not %s: removed with it.", ", ".join(elsewhere), folder)
    return loaded


def mapped_files() -> set[str]:
    """The files this process has mapped (its shared libraries among them); empty where /proc is not."""
    try:
        with open("/proc/self/maps") as maps:
            return {fields[5].strip() for fields in (line.split(None, 5) for line in maps) if len(fields) == 6}
    except OSError:
        return set()


def unpacked_elsewhere(new_files: set[str], folder: str) -> list[str]:
    """The temp-dir folders that hold an unpacked package among ``new_files``, outside ``folder``."""
    roots = {os.path.realpath(tempfile.gettempdir()), "/tmp"}
    found = set()
    for path in new_files:
        if f"/{PACKAGE_LAYOUT}/" not in path or path.startswith(folder + os.sep):
            continue
        for root in roots:
            if path.startswith(root + os.sep):
                top = os.path.join(root, path[len(root) + 1 :].split(os.sep, 1)[0])
                if os.path.isdir(top):
                    found.add(top)
    return sorted(found)


def remove_folder(folder: str) -> None:
    """Remove a process's unpack folder and the unpacked packages it records."""
    with contextlib.suppress(OSError), open(os.path.join(folder, ELSEWHERE_FILE)) as record:
        for line in record:
            path = Path(line.strip())
            # Only a folder that still holds a package's layout: never whatever took its name since.
            if line.strip() and (any(path.glob(PACKAGE_LAYOUT)) or any(path.glob(f"*/{PACKAGE_LAYOUT}"))):
                shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _variable(name: str, value: str) -> Iterator[None]:
    """Environment variable ``name`` set to ``value`` while the block runs, then as it was."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def unpack_root(root: str) -> contextlib.AbstractContextManager[None]:
    """Processes started while the block runs unpack into folders under ``root``; the caller removes it."""
    return _variable(UNPACK_ROOT_ENV, root)


def remove_unpacked_of(pid: int | None) -> None:
    """Remove what process ``pid`` (a worker this server started, now ended) unpacked: a worker killed,
    or ended with ``os._exit``, did not remove it, and the server may run for weeks."""
    if pid is not None:
        _remove_under_root(f"unpacked-{pid}-*")


def remove_every_unpacked() -> None:
    """Remove what every process under the root unpacked (the server, once its workers are reaped)."""
    _remove_under_root("unpacked-*")


def _remove_under_root(pattern: str) -> None:
    root = os.environ.get(UNPACK_ROOT_ENV)
    if root:
        for folder in Path(root).glob(pattern):
            remove_folder(str(folder))
