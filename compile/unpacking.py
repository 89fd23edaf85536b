"""Where AOTInductor unpacks the packages it loads, and who removes what it unpacked.

``aoti_load_package`` extracts the package (the model's shared library and weights, as large as the
model) into a new ``aotinductor_*`` folder of the temp dir, and only the loader's C++ destructor removes
it. That destructor does not run in a process that ends with ``os._exit`` (an inference worker whose
device broke, any multiprocessing child started by fork), in one that is killed, nor reliably at
interpreter exit: each load left a copy of the model behind, on every server start, worker restart and
model swap, until the temp dir filled.

So each process unpacks into one folder of its own, removed when the process exits normally. A server
also names a root for its workers' folders (``unpack_root``) inside its run folder, which it removes
after its last worker ended, whatever way that worker ended.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

# Set by a server for the processes it starts: where their unpack folders go.
UNPACK_ROOT_ENV = "VISION_SERVE_UNPACK_ROOT"

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
            atexit.register(shutil.rmtree, path, ignore_errors=True)
            _folder = (pid, path)
        return _folder[1]


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


def unpacking_into(folder: str) -> contextlib.AbstractContextManager[None]:
    """The loader's ``mkdtemp`` reads ``TMPDIR`` (C++'s ``temp_directory_path``): point it at ``folder``
    while the block runs. Python's own ``tempfile`` caches its temp dir, so it is not moved."""
    return _variable("TMPDIR", folder)


def unpack_root(root: str) -> contextlib.AbstractContextManager[None]:
    """Processes started while the block runs unpack into folders under ``root``; the caller removes it."""
    return _variable(UNPACK_ROOT_ENV, root)


def remove_unpacked_of(pid: int | None) -> None:
    """Remove what process ``pid`` (a worker this server started, now ended) unpacked under the root: a
    worker killed, or ended with ``os._exit``, did not remove it, and the server may run for weeks."""
    root = os.environ.get(UNPACK_ROOT_ENV)
    if not root or pid is None:
        return
    for folder in Path(root).glob(f"unpacked-{pid}-*"):
        shutil.rmtree(folder, ignore_errors=True)
