"""What LitServe starts in each inference worker process: set the process up, load the model, serve.

LitServe pickles this object into every worker it spawns, so the main process builds it, and the
HTTP processes are forked from the main process: it imports no tensor library. ``setup`` runs in
the worker and imports the model there (``model`` names it: service/worker/classifier.py unless a
benchmark swaps in its own); the loop (service/worker/loop.py) then serves it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import warnings
from pathlib import Path

import litserve as ls

from service.heap import freeze_startup_objects
from service.logs import adopt_torch_logger, configure_logging
from service.metrics import metrics
from service.settings import ServeSettings
from service.tracing import configure_tracing, flush_on_terminate

CLASSIFIER = "service.worker.classifier:Classifier"
SETUP_ERROR_FILE = "setup-error-{worker_id}"


def setup_error_path(directory: str, worker_id: int) -> Path:
    return Path(directory) / SETUP_ERROR_FILE.format(worker_id=worker_id)


def record_setup_error(loop: object, error: BaseException) -> None:
    """Write why this worker's setup failed beside its channels (service/supervisor/pool/workers.py reads it)."""
    channels = getattr(loop, "channels", None)
    worker_id = os.environ.get("LITSERVE_WORKER_ID")  # LitServe sets it before setup
    if channels is None or worker_id is None:
        return
    with contextlib.suppress(OSError):
        setup_error_path(channels.directory, int(worker_id)).write_text(f"{type(error).__name__}: {error}"[:2000])


class WorkerEntry(ls.LitAPI):
    """``model``: ``"module:Class"`` whose ``load(settings, device)`` returns the ``BatchedModel``."""

    def __init__(self, settings: ServeSettings, model: str = CLASSIFIER) -> None:
        with warnings.catch_warnings():
            # LitServe warns about batch/unbatch overrides; its own loop never runs here.
            warnings.simplefilter("ignore")
            super().__init__(max_batch_size=settings.max_batch_size, batch_timeout=settings.batch_timeout_ms / 1000.0)
        self.settings = settings
        self.model_path = model
        self.model = None  # set by setup, in the worker

    def setup(self, device: str) -> None:
        # Ctrl-C in a terminal reaches the whole process group; the main process stops the server
        # in order (HTTP first, so in-flight requests get answers), so workers must not die first.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        configure_logging(self.settings.log_level, self.settings.log_format)  # a spawned process starts bare
        metrics()  # its series exist at 0 from the start, not from the first batch
        module, _, name = self.model_path.partition(":")
        try:
            self._configure_tracing()
            model_class = getattr(importlib.import_module(module), name)
            adopt_torch_logger()  # the model's module imported torch, whose logger has a format of its own
            self.model = model_class.load(self.settings, device)
        except BaseException as exc:
            # LitServe logs the traceback and marks the worker ERROR; the reason also goes where the
            # main process reads it, to answer the load call that started this worker.
            record_setup_error(self.loop, exc)
            raise
        freeze_startup_objects()

    def _configure_tracing(self) -> None:
        """Spans of the traced requests' stages here (service/tracing/), exported also when the
        main process stops this worker with SIGTERM."""
        worker_id = os.environ.get("LITSERVE_WORKER_ID")  # LitServe sets it before setup
        role = "worker" if worker_id is None else f"worker-{worker_id}"
        configure_tracing(
            self.settings.trace_sample_rate,
            self.settings.otlp_endpoint,
            role,
            worker_id=None if worker_id is None else int(worker_id),
        )
        flush_on_terminate()

    def predict(self, x: object) -> object:
        raise NotImplementedError("vision-serve's loop calls the model's prepare and run (service/worker/loop.py)")
