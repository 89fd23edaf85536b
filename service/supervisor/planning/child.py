"""The planner child process's work (``python -m service.supervisor.planning``, __main__.py, runs
``main`` once it watches its parent): ``{"settings", "load"}`` JSON on stdin -> ``{"plans": [...]}``
or ``{"error": message}`` on stdout, with ``"setting"``: the ``SettingsError``'s fields, when the
refusal was one (launch.py raises it again from them).

Started by the main process (service/supervisor/planning/launch.py) at launch and for each load call;
it imports torch, which the main process must not (service/supervisor/planning/planner.py says why).
"""

from __future__ import annotations

import json
import os
import sys

from compile.settings_errors import SettingsError
from service.settings import ServeSettings
from service.supervisor.planning.planner import plan_repository
from service.supervisor.planning.plans import LoadRequest


def main() -> None:
    """Read the request, plan, write the answer, and exit without interpreter shutdown."""
    import torch  # noqa: F401  (planning needs it; imported first so its logger can be adopted)

    from service.logs import adopt_torch_logger, configure_logging

    request = json.loads(sys.stdin.read())
    settings = ServeSettings(**request["settings"])
    load = None if request["load"] is None else LoadRequest(**request["load"])
    configure_logging(settings.log_level, settings.log_format)
    adopt_torch_logger()
    sys.stdout.write(json.dumps(answer(settings, load)))
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter shutdown: libraries torch loads (OpenAI Triton's nanobind) can report "leaked"
    # objects at exit, which would reach the server's log as if they were ours.
    os._exit(0)


def answer(settings: ServeSettings, load: LoadRequest | None) -> dict:
    """The plans as JSON, or the refusal: a ``SettingsError`` with its fields, so that the main
    process raises it again as it was raised here (launch.py)."""
    try:
        return {"plans": [plan.to_dict() for plan in plan_repository(settings, load)]}
    except SettingsError as exc:
        return {"error": str(exc), "setting": exc.to_dict()}
    except ValueError as exc:
        return {"error": str(exc)}
