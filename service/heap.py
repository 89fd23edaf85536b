"""Give freed heap memory back to the OS now and then, so a worker's resident memory stays flat.

Measured in the soak (benchmarks/soak.py): an inference worker's RSS grew 25-47 % over a few
thousand requests and then plateaued, while one ``malloc_trim(0)`` brought it back below its
post-warm-up size. It is glibc keeping freed chunks of decoded images and varying batch tensors in
its arenas, not a leak. ``MALLOC_MMAP_THRESHOLD_`` kept it flat too but halved throughput (a page
fault per large buffer). A background thread trims once per interval instead, busy or idle, so an
idle worker also returns what its last batches freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

logger = logging.getLogger(__name__)

TRIM_INTERVAL_S = 1.0


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


def start_heap_trimmer(interval_s: float = TRIM_INTERVAL_S) -> threading.Event | None:
    """Trim the heap every ``interval_s`` in a daemon thread; set the returned event to stop it."""
    trim = load_malloc_trim()
    if trim is None:
        logger.debug("malloc_trim is not available here; heap trimming is off.")
        return None
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval_s):
            trim(0)  # takes the allocator's locks: safe alongside the threads that decode and infer

    threading.Thread(target=run, name="vision-serve-heap-trim", daemon=True).start()
    return stop
