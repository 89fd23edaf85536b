"""A progress bar with an ETA for a tune: one line redrawn in place on a terminal, log lines elsewhere.

The ETA is the mean time of the configurations measured so far times those left (the grid for a
full search, quick search's limit for a quick one, and the confirm rounds), and never later than
the end of ``--budget-min``.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

logger = logging.getLogger(__name__)

BAR_WIDTH = 24
REDRAW_S = 1.0


def clock(seconds: float) -> str:
    """``3725`` -> ``1:02:05``; ``65`` -> ``1:05``."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class TuneProgress:
    def __init__(
        self,
        total: int,
        budget_s: float = 0.0,
        spent_s: float = 0.0,
        stream: TextIO | None = None,
        live: bool | None = None,
    ) -> None:
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.total = total
        self.done = 0
        self.budget_s = budget_s
        self.spent_s = spent_s  # by earlier runs of a resumed tune
        self.started = time.monotonic()
        self.durations: list[float] = []
        self.text = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if self.live:
            self._ticker = threading.Thread(target=self._tick, name="tune-progress", daemon=True)
            self._ticker.start()

    @property
    def elapsed_s(self) -> float:
        return self.spent_s + time.monotonic() - self.started

    def eta_s(self) -> float | None:
        """Seconds until the end, or None before anything was timed."""
        left = max(0, self.total - self.done)
        if not self.durations:
            return None
        eta = left * sum(self.durations) / len(self.durations)
        if self.budget_s:
            eta = min(eta, max(0.0, self.budget_s - self.elapsed_s))
        return eta

    def line(self) -> str:
        share = min(1.0, self.done / self.total) if self.total else 1.0
        filled = round(share * BAR_WIDTH)
        eta = self.eta_s()
        parts = [
            f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.done}/{self.total} configurations",
            f"{clock(self.elapsed_s)} elapsed",
            f"ETA {clock(eta)}" if eta is not None else "ETA --:--",
        ]
        if self.budget_s:
            parts.append(f"budget {clock(self.budget_s)}")
        return "  ".join(parts) + (f"  | {self.text}" if self.text else "")

    def status(self, text: str) -> None:
        with self._lock:
            self.text = text
        self._draw()

    def set_total(self, total: int) -> None:
        with self._lock:
            self.total = max(total, self.done)
        self._draw()

    def item_done(self, seconds: float, quiet: bool = False) -> None:
        """A configuration was measured (``seconds`` long), or read back from the journal (``quiet``: it
        counts, for the bar, the ETA and the budget, without a line of its own)."""
        with self._lock:
            self.durations.append(seconds)
            self.done += 1
            self.text = ""  # what was running is done: its last load step is no summary of it
        if quiet:
            return
        self._draw()
        if not self.live:
            logger.info("%s", self.line())

    def message(self, text: str) -> None:
        """A line above the bar (on a terminal), or a log line."""
        if self.live:
            with self._lock:
                self.stream.write(f"\r\033[K{text}\n")
            self._draw()
        else:
            logger.info("%s", text)

    def _draw(self) -> None:
        if not self.live:
            return
        with self._lock:
            self.stream.write(f"\r\033[K{self.line()[:200]}")
            self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(REDRAW_S):
            self._draw()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self.live:
            self.stream.write("\n")
            self.stream.flush()
