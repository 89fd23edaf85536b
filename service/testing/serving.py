"""vision-serve with its workers loading another model class: the hook the front-end benchmark serves
its no-op model through, everything else (HTTP processes, admission, batching, metrics) as in
production."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from service.settings import ServeSettings

# Workers import it by name (service/worker/entry.py), so the caller's process stays torch-free.
NOOP_MODEL = "service.testing.noop:NoopClassifier"


def serve_model(
    argv: Sequence[str] | None,
    model: str,
    prog: str,
    refuse: Callable[[ServeSettings], str | None] | None = None,
) -> int:
    """Parse ``argv`` as vision-serve's command line, then serve with each worker loading ``model``
    (``"module:Class"``, a ``Classifier`` subclass) instead of the classifier. ``refuse`` names flags
    the caller cannot serve (a usage error), or returns ``None``. Returns the process exit code."""
    # Imported here as service/cli.py does: the web stack loads while planning runs in its child.
    from service.cli import build_parser, settings_from_args
    from service.logs import adopt_library_loggers, configure_logging
    from service.supervisor.planning.launch import start_planning
    from service.supervisor.server import build_server, serve

    parser: argparse.ArgumentParser = build_parser()
    parser.prog = prog
    try:
        settings = settings_from_args(parser.parse_args(argv))
    except ValueError as exc:
        parser.error(str(exc))
    problem = refuse(settings) if refuse else None
    if problem:
        parser.error(problem)
    configure_logging(settings.log_level, settings.log_format)
    adopt_library_loggers()
    try:
        plans = start_planning(settings).result()
    except ValueError as exc:
        parser.error(str(exc))
    return serve(build_server(plans, model=model))
