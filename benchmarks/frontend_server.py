"""vision-serve with its decoder and model replaced by no-ops: what the front end alone can carry.

    python -m benchmarks.frontend_server --port 8200 --api-servers 2 [any vision-serve flag]

Everything else is the production path: body parsing and limits, the header probe, admission,
deadlines, the worker watch, the batch loop, top-k on 1,000 logits, JSON answers, metrics and the
access log. The decoder answers a batch of 1x1 images without reading the bytes, and the model
returns zero logits, so the rate measured is what a GPU fast enough to cost nothing would leave.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

logger = logging.getLogger(__name__)

# Imported by the workers only: this process, and the HTTP processes forked from it, stay torch-free
# as vision-serve's own do.
NOOP_CLASSIFIER = "benchmarks.harness.noop_classifier:NoopClassifier"


def main(argv: Sequence[str] | None = None) -> int:
    from service.cli import build_parser, settings_from_args
    from service.logs import adopt_library_loggers, configure_logging
    from service.supervisor.planning.launch import start_planning
    from service.supervisor.server import build_server, serve

    parser = build_parser()
    parser.prog = "python -m benchmarks.frontend_server"
    try:
        settings = settings_from_args(parser.parse_args(argv))
    except ValueError as exc:
        parser.error(str(exc))
    if settings.artifact:
        parser.error("--artifact: the front-end benchmark serves no engine; drop it.")
    configure_logging(settings.log_level, settings.log_format)
    adopt_library_loggers()
    try:
        plans = start_planning(settings).result()
    except ValueError as exc:
        parser.error(str(exc))
    return serve(build_server(plans, model=NOOP_CLASSIFIER))


if __name__ == "__main__":
    sys.exit(main())
