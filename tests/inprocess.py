"""A vision-serve server started inside the test process, for an in-process ASGI client."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from litserve.utils import wrap_litserve_start

from service.settings import ServeSettings
from service.supervisor.planning.planner import plan_serving
from service.supervisor.server import VisionLitServer, build_server


@contextlib.contextmanager
def started_in_process(settings: ServeSettings) -> Iterator[VisionLitServer]:
    """The workers started and the app ready for an in-process ASGI client (one HTTP process, id 0),
    as LitServe's own test helper does. The plan is made here, in the test process."""
    if not settings.workers_per_device:  # one worker, as every server of the suite (tests/conftest.py)
        settings = dataclasses.replace(settings, workers_per_device=1)
    server = build_server(plan_serving(settings))
    try:
        with wrap_litserve_start(server) as started:
            yield started
    finally:
        server.channels.remove()
