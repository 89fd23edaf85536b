"""An inference worker process, from its start to its end: load the model, say so, serve.

The main process spawns each worker with ``run_worker`` as its target (service/supervisor/pool/
workers.py). The worker tells the main process over the control channel (service/transport/
control_channel.py) that it is ready, or why its setup failed; everything else it does is answer
requests over its own channel (service/worker/loop.py). A worker whose setup failed exits with
``EXIT_SETUP_FAILED`` after its report, so that its state and its exit agree.
"""

from __future__ import annotations

import logging
import sys

from service.parent_watch import exit_with_parent
from service.transport.control_channel import ERROR, READY, WorkerReport, report_to_main_process
from service.worker.entry import WorkerEntry

logger = logging.getLogger(__name__)

EXIT_SETUP_FAILED = 1
# What a setup error's message may take of the load call's answer (the traceback is in the log).
MAX_DETAIL_CHARS = 2000


def run_worker(entry: WorkerEntry, device: object, worker_id: int, channels_directory: str, main_pid: int) -> None:
    """The worker process's target: ``entry.setup(device)``, a READY or ERROR report, then the loop;
    the process ends by itself if the main process (``main_pid``) is killed (service/parent_watch.py)."""
    exit_with_parent(main_pid)
    entry.worker_id = worker_id
    try:
        entry.setup(device)
    except Exception as exc:
        logger.exception("Inference worker %d could not load its model.", worker_id)
        detail = f"{type(exc).__name__}: {exc}"[:MAX_DETAIL_CHARS]
        report_to_main_process(channels_directory, WorkerReport(worker_id, ERROR, detail))
        sys.exit(EXIT_SETUP_FAILED)
    entry.device = device
    if not report_to_main_process(channels_directory, WorkerReport(worker_id, READY)):
        logger.warning("Inference worker %d: the main process did not take its ready report; exiting.", worker_id)
        return
    entry.worker_loop.serve(entry.model, worker_id)
