"""Logging for every server process: plain text for a terminal, one JSON object per line for a log
pipeline (``--log-format json``), with the request id of the request being handled.

LitServe gives its own logger a stdout handler and stops it propagating, uvicorn installs its own
handlers, and so does torch in the workers; ``configure_logging`` and ``adopt_torch_logger`` route
them through the root handler so every line has one format.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import time
from typing import TextIO

from compile._defaults import LOG_FORMATS
from compile.json_logs import JsonFormatter
from compile.torch_logging import adopt_torch_logger

__all__ = ["LOG_FORMATS", "adopt_library_loggers", "adopt_torch_logger", "configure_logging"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
# The request being handled in this task; set by the HTTP middleware (service/http/base/observer.py).
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("vision_serve_request_id", default=None)
# Loggers that bring their own handlers; we want their records in our format instead.
_LIBRARY_LOGGERS = ("litserve", "uvicorn", "uvicorn.error", "uvicorn.access")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._second: tuple[int, str] = (-1, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        # The access log writes thousands of lines a second; strftime once per second is enough.
        second = int(record.created)
        if second != self._second[0] or datefmt is not None:
            self._second = (second, time.strftime(self.default_time_format, self.converter(record.created)))
        return self.default_msec_format % (self._second[1], record.msecs)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        request_id = getattr(record, "request_id", None)
        return f"{text} [request_id={request_id}]" if request_id else text


def configure_logging(level: str, log_format: str = "text", stream: TextIO | None = None) -> None:
    """Root handler with our format at ``level``; library loggers routed through it. Safe to call again."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}.")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # No format here shows a record's source file, line or thread: skip finding them for each record
    # (the optimization the logging HOWTO names), which every access-log line would pay for.
    logging._srcfile = None
    logging.logThreads = False
    logging.captureWarnings(True)  # warnings.warn() lines in the same format, not bare on stderr
    adopt_library_loggers()


def adopt_library_loggers() -> None:
    """Send LitServe's and uvicorn's records to the root handler (they install their own handlers)."""
    for name in _LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        for old in library.handlers[:]:
            library.removeHandler(old)
        library.propagate = True
        library.setLevel(logging.NOTSET)
