"""What the whole server shares, whatever model a worker serves: ``ServerLayout``, agreed by the
plans of the versions it starts with. Made in the main process (service/supervisor/server.py) from
the planner's answer; a load's versions must match it (service/supervisor/pool/repository_operations.py).

The number of HTTP processes is resolved here, once, from the worker processes of every starting
version: with ``--api-servers 0`` it follows the processes (``worker_processes``), not the model slots
they hold, so a repository of many models does not start an HTTP process per slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from compile.settings_errors import SettingsError
from service.settings import ServeSettings, resolve_api_servers
from service.supervisor.planning.cores import usable_cores
from service.supervisor.planning.plans import ServePlan, VersionPlan


@dataclass(frozen=True)
class ServerLayout:
    """What the whole server shares, whatever model a worker serves."""

    accelerator: str
    devices: int | str
    worker_env: dict[str, str]
    api_servers: int

    def fits(self, plan: ServePlan) -> bool:
        """Whether ``plan``'s workers can run beside this layout's (same accelerator, devices, environment)."""
        return (plan.accelerator, plan.devices, plan.worker_env) == (self.accelerator, self.devices, self.worker_env)


def worker_processes(plans: Sequence[VersionPlan]) -> int:
    """The worker processes the starting versions' workers run in (service/supervisor/pool/hosts.py).

    Shared versions put their k-th worker on a device into that device's k-th process: as many
    processes as the shared version with the most workers has (one layout: the same devices for
    all). Each worker of an isolated version has a process of its own. One model: its workers.
    """
    shared = [plan.serve_plan.workers for plan in plans if plan.serve_plan.settings.worker_isolation == "shared"]
    own = sum(plan.serve_plan.workers for plan in plans if plan.serve_plan.settings.worker_isolation != "shared")
    return max(shared, default=0) + own


def server_layout(plans: Sequence[VersionPlan], settings: ServeSettings, cpu_count: int | None = None) -> ServerLayout:
    """The layout the plans agree on; ``SettingsError`` if two versions want different devices."""
    if not plans:
        raise SettingsError(
            "--model-repository",
            settings.model_repository,
            f"The model repository {settings.model_repository} has no model to serve.",
            "Add DIR/<name>/1 (compile-trt --model ... --output DIR/<name>/1).",
        )
    first = plans[0].serve_plan
    cpus = cpu_count or usable_cores()
    api_servers = resolve_api_servers(settings.api_servers, first.accelerator, worker_processes(plans), cpus)
    layout = ServerLayout(first.accelerator, first.devices, first.worker_env, api_servers)
    for plan in plans[1:]:
        if not layout.fits(plan.serve_plan):
            raise SettingsError(
                "--model-repository",
                settings.model_repository,
                f"Model {plan.name} version {plan.version} is compiled for {plan.serve_plan.accelerator}, and "
                f"{plans[0].name} version {plans[0].version} for {first.accelerator}: one server serves one device "
                "layout.",
                "Recompile one, or pass --device.",
            )
    return layout
