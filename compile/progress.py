"""A progress display for long compile stages: a live elapsed-time line on a terminal, log lines elsewhere."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

logger = logging.getLogger(__name__)

SPINNER = "|/-\\"
TICK_S = 0.25


class Progress:
    """``with progress.stage("Compiling"):`` shows the stage while it runs and its duration after.

    On a terminal the line updates in place with a spinner and the seconds so far (an AOTInductor
    compile of ResNet-152 is silent for about a minute; TensorRT for several). Elsewhere (CI logs,
    pipes) each stage logs one line when it starts and one when it ends.
    """

    def __init__(self, stream: TextIO | None = None, live: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.durations: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, label: str) -> Iterator[None]:
        started = time.perf_counter()
        done = threading.Event()
        ticker = None
        if self.live:
            ticker = threading.Thread(target=self._tick, args=(label, started, done), daemon=True)
            ticker.start()
        else:
            logger.info("%s ...", label)
        ok = False
        try:
            yield
            ok = True
        finally:
            done.set()
            if ticker is not None:
                ticker.join()
            elapsed = time.perf_counter() - started
            self.durations[label] = elapsed
            mark = "done" if ok else "FAILED"
            if self.live:
                self.stream.write(f"\r\033[K{label}: {mark} in {elapsed:.1f} s\n")
                self.stream.flush()
            else:
                logger.info("%s: %s in %.1f s", label, mark, elapsed)

    def _tick(self, label: str, started: float, done: threading.Event) -> None:
        frame = 0
        while not done.wait(TICK_S):
            elapsed = time.perf_counter() - started
            self.stream.write(f"\r\033[K{SPINNER[frame % len(SPINNER)]} {label} ... {elapsed:.0f} s")
            self.stream.flush()
            frame += 1
