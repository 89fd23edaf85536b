"""No orphan when the main process is killed: each process it started ends itself once it is gone.

SIGKILL leaves the main process no chance to stop its children, and nothing in Linux stops them for
it: ``PR_SET_PDEATHSIG`` fires when the *thread* that started a child ends, and inference workers
are started from the load and restart threads. So every child (the inference workers, the HTTP
processes, LitServe's manager, the planner) runs ``exit_with_parent``: a thread that checks, twice a second, that
its parent is still the main process, and ends the process at once when it is not.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
EXIT_PARENT_GONE = 1


def exit_with_parent(
    parent_pid: int, interval_s: float = POLL_INTERVAL_S, exit_process: Callable[[int], object] = os._exit
) -> threading.Thread:
    """Start the watch in this process: once its parent is no longer ``parent_pid`` (re-parented to
    init or a subreaper after the parent died), ``exit_process(EXIT_PARENT_GONE)``. ``os._exit``:
    nothing is left to answer, and an orderly shutdown could wait on the dead parent's sockets."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        logger.error("The main process (pid %d) is gone; process %d exits with it.", parent_pid, os.getpid())
        exit_process(EXIT_PARENT_GONE)

    thread = threading.Thread(target=watch, name="vision-serve-parent-watch", daemon=True)
    thread.start()
    return thread
