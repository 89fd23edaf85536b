"""Give freed heap memory back to the OS when the worker goes idle, so its resident memory stays flat.

glibc keeps freed chunks of decoded images and of batch tensors of varying sizes in its arenas, so
a worker's resident memory grows under load without leaking (the soak, benchmarks/soak.py, watches
it); ``malloc_trim(0)`` hands them back. Lowering ``MALLOC_MMAP_THRESHOLD_`` instead would cost a
page fault per large buffer.

A trim while a batch runs costs that batch: it holds the allocator's locks and hands back pages the
model then faults in again. So the trimmer waits for a pause: it trims once the worker has been idle
for ``IDLE_BEFORE_TRIM_S``, and under unbroken load at most once per ``MAX_TRIM_GAP_S``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import threading
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.1
IDLE_BEFORE_TRIM_S = 0.3
MAX_TRIM_GAP_S = 30.0


def load_malloc_trim() -> ctypes._CFuncPtr | None:
    """glibc's ``malloc_trim``, or ``None`` where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    """``busy()`` around each batch; a daemon thread trims in the pauses. ``stop()`` ends the thread."""

    def __init__(self, trim: ctypes._CFuncPtr | None = None) -> None:
        self._trim = trim if trim is not None else load_malloc_trim()
        self._lock = threading.Lock()
        self._active = 0  # batches running now
        self._last_activity = time.monotonic()
        self._dirty = True  # something ran since the last trim
        self._last_trim = time.monotonic()
        self._stop = threading.Event()

    @property
    def available(self) -> bool:
        return self._trim is not None

    def start(self) -> HeapTrimmer:
        if not self.available:
            logger.debug("malloc_trim is not available here; heap trimming is off.")
            return self
        threading.Thread(target=self._run, name="vision-serve-heap-trim", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        with self._lock:
            self._active += 1
            self._dirty = True
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                self._last_activity = time.monotonic()

    def _due(self, now: float) -> bool:
        """Whether to trim now (lock held): after a pause in the work, or when unbroken work has gone too
        long without one."""
        if not self._dirty:
            return False
        idle = self._active == 0 and now - self._last_activity >= IDLE_BEFORE_TRIM_S
        return idle or now - self._last_trim >= MAX_TRIM_GAP_S

    def trim_if_due(self, now: float) -> bool:
        with self._lock:  # check and claim in one step: a batch starting in between marks it dirty again
            if not self._due(now):
                return False
            self._dirty = False
            self._last_trim = now
        self._trim(0)
        return True

    def _run(self) -> None:
        while not self._stop.wait(CHECK_INTERVAL_S):
            self.trim_if_due(time.monotonic())


_process_trimmer: tuple[int, HeapTrimmer] | None = None
_process_trimmer_lock = threading.Lock()


def process_heap_trimmer() -> HeapTrimmer:
    """This process's one trimmer, started on first use. A worker process holding several models
    (service/worker/host.py) must trim only when all of them pause: one model's pause is another's
    batch, and a trimmer per model would trim under the others' batches, again and again."""
    global _process_trimmer
    with _process_trimmer_lock:
        pid = os.getpid()
        if _process_trimmer is None or _process_trimmer[0] != pid:  # a forked child starts its own
            _process_trimmer = (pid, HeapTrimmer().start())
        return _process_trimmer[1]


def freeze_startup_objects() -> None:
    """Move every object alive now out of the garbage collector's reach (``gc.freeze``).

    A server process holds many long-lived objects (the web stack; in a worker, torch and the model)
    that the collector's full passes would walk again and again, stalling every request in flight
    while they run. Called in the main process just before the HTTP processes fork (they inherit the
    frozen set) and in each worker once its model is loaded; what is made afterwards is still
    collected as usual.
    """
    gc.collect()
    gc.freeze()
    logger.debug("Froze %d startup objects out of the garbage collector's passes.", gc.get_freeze_count())
