"""One JSON object per log line (``--log-format json``), for compile-trt and every server process alike,
so that a container's whole log (a first start compiles, then serves) reads as one stream."""

from __future__ import annotations

import json
import logging
import time

# LogRecord's own attributes: anything else on a record came from ``extra=`` and goes into the JSON.
# (uvicorn adds color_message: the message again, with terminal colour codes.)
_RECORD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "request_id", "color_message"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, process, message, request_id and
    any ``extra=`` fields; exceptions as one string."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "process": record.processName,
            "pid": record.process,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            entry["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)
