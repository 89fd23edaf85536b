"""torch's log records in the process's own format (compile-trt's, or the server's where torch is
imported: the planner and the workers)."""

from __future__ import annotations

import logging
import sys


def adopt_torch_logger() -> None:
    """Send torch's records to the root handler, in our format, where torch is imported (the
    workers). torch gives its logger a stderr handler of its own format at import; its level
    (warnings and up unless TORCH_LOGS says otherwise) stays torch's."""
    if "torch" not in sys.modules:
        return
    torch_logger = logging.getLogger("torch")
    for old in torch_logger.handlers[:]:
        torch_logger.removeHandler(old)
    torch_logger.propagate = True
