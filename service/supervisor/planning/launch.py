"""The main process's end of the planner child process: ``start_planning`` starts
``python -m service.supervisor.planning`` (service/supervisor/planning/__main__.py) with the settings
as JSON on its stdin, and ``Planning.result`` reads back its ``VersionPlan``s, or the error that says
what to fix, from its stdout.

The main process plans in a child because planning imports torch (service/supervisor/planning/
planner.py), which the HTTP processes forked from it must not carry; it imports its web stack while
the child works. A load call plans the same way. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import asdict

from compile.settings_errors import SettingsError
from service.settings import ServeSettings
from service.supervisor.planning.plans import LoadRequest, VersionPlan

PLANNER = (sys.executable, "-m", "service.supervisor.planning")  # + this process's pid, which it watches


class PlanningFailed(RuntimeError):
    """The planner process failed for a reason other than the settings (its output says why)."""


class Planning:
    """The planner process, started; ``result()`` waits for its ``VersionPlan``s."""

    def __init__(self, settings: ServeSettings, load: LoadRequest | None = None) -> None:
        self._keys = settings
        public = dataclasses.replace(settings, api_key="", admin_api_key="")
        # It ends itself once this process is gone (a SIGKILL leaves no chance to stop it): __main__.py.
        self._process = subprocess.Popen(
            (*PLANNER, str(os.getpid())),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._input = json.dumps({"settings": asdict(public), "load": None if load is None else asdict(load)})

    def result(self, timeout_s: float | None = None) -> list[VersionPlan]:
        """The plans; ``SettingsError`` when the settings cannot be served: the planner's own (its flag,
        value and fix cross as JSON), or, for a refusal that names no setting (a model file that does
        not load, an artifact this machine cannot run), one with the planner's message alone."""
        try:
            stdout, stderr = self._process.communicate(self._input, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.communicate()
            raise SettingsError(
                "--load-timeout-s",
                timeout_s,
                f"Planning took longer than {timeout_s:g} s (--load-timeout-s).",
                "Raise --load-timeout-s: planning imports torch and reads the engine.",
            ) from None
        if stderr.strip():
            sys.stderr.write(stderr)  # its log records and warnings, as if this process had written them
        try:
            answer = json.loads(stdout)
        except ValueError:
            raise PlanningFailed(f"the planner exited with code {self._process.returncode}; see above.") from None
        if "setting" in answer:
            raise SettingsError.from_dict(answer["setting"])
        if "error" in answer:
            raise SettingsError("", None, answer["error"], "")
        return [VersionPlan.from_dict(plan, self._keys) for plan in answer["plans"]]


def start_planning(settings: ServeSettings, load: LoadRequest | None = None) -> Planning:
    """Start the planner child for ``settings`` (``load``: one model of the repository, for a load call)."""
    return Planning(settings, load)
