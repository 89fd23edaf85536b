"""The no-op model with batches that take as long as a test says (``SleepyClassifier``): a slow model,
or a hung engine whose heartbeat still beats, without burning the machine's cores. Loaded by the
inference workers of tests/sleepy_server.py only (it imports torch, which the main process must not).

While the file named by ``SLEEPY_FILE`` exists, every batch first sleeps as many seconds as it says,
in the model's run, where an engine would be busy (``time.sleep`` releases the GIL, as the engines'
native calls do).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from service.testing.noop import NoopClassifier
from service.wire import Answer
from service.worker.classifier import ClassifyBatch

SLEEP_FILE = Path(os.environ.get("SLEEPY_FILE", "/nonexistent/sleepy"))


def batch_sleep_s() -> float:
    try:
        return float(SLEEP_FILE.read_text())
    except (OSError, ValueError):
        return 0.0


class SleepyClassifier(NoopClassifier):
    def run(self, prepared: ClassifyBatch) -> list[Answer]:
        time.sleep(batch_sleep_s())
        return super().run(prepared)
