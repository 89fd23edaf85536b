"""The plan types: ``ServePlan`` (one served artifact or model, with what the machine decided),
``VersionPlan`` (one version of one repository model) and ``LoadRequest`` (what a load call asks
the planner for).

The planner child process (service/supervisor/planning/planner.py) makes them and the main process
reads them back (service/supervisor/planning/launch.py): they cross a pipe as JSON, without the
API keys. Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from service.model_info import ModelInfo
from service.settings import ServeSettings


@dataclass(frozen=True)
class ServePlan:
    """The settings with what the artifact and the machine decided (model, device, largest batch,
    pipeline depth), and how LitServe lays out the processes."""

    settings: ServeSettings  # pipeline_depth resolved: 0 (auto) never reaches a worker
    accelerator: str  # "cpu" or "cuda"
    devices: int | str  # LitServer's: a number of GPUs, or "auto" on a CPU
    worker_env: dict[str, str]  # set before the workers spawn: CUDA_VISIBLE_DEVICES for one chosen GPU
    workers: int
    model: ModelInfo

    def to_json(self) -> str:
        """Without the keys: the plan crosses a pipe, and the keys never need to."""
        plan = asdict(self)
        plan["settings"]["api_key"] = plan["settings"]["admin_api_key"] = ""
        return json.dumps(plan)

    @classmethod
    def from_json(cls, text: str, keys: ServeSettings | None = None) -> ServePlan:
        """``keys``: the settings whose API keys the plan gets back."""
        plan = json.loads(text)
        secrets = {} if keys is None else {"api_key": keys.api_key, "admin_api_key": keys.admin_api_key}
        settings = ServeSettings(**{**plan.pop("settings"), **secrets})
        return cls(settings=settings, model=ModelInfo(**plan.pop("model")), **plan)


@dataclass(frozen=True)
class VersionPlan:
    """One version of one model of the repository, planned: a single --model or --artifact is
    version 1 of a one-model repository."""

    name: str
    version: int
    serve_plan: ServePlan

    def to_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "serve_plan": json.loads(self.serve_plan.to_json())}

    @classmethod
    def from_dict(cls, data: dict, keys: ServeSettings | None = None) -> VersionPlan:
        return cls(data["name"], data["version"], ServePlan.from_json(json.dumps(data["serve_plan"]), keys))


@dataclass(frozen=True)
class LoadRequest:
    """What a repository load asks the planner for: one model, with a load call's config override."""

    model: str
    config: str = ""  # Triton's model config as JSON, or ""


def render_chosen(plans: list[VersionPlan]) -> str:
    """What the planner chose for each version (its workers and threads, and why), as comment lines
    that can follow --print-config's settings: the file stays usable as a config file."""
    lines = ["", "# Chosen at start on this machine, for the values left at 0 (auto) above:"]
    for plan in plans:
        sizing = plan.serve_plan.model.sizing or {}
        settings = plan.serve_plan.settings
        lines.append(
            f"#   {plan.name} v{plan.version}: workers_per_device = {settings.workers_per_device} "
            f"({sizing.get('workers_per_device', {}).get('source', '?')}), engine_threads = "
            f"{settings.engine_threads} ({sizing.get('engine_threads', {}).get('source', '?')}), "
            f"pipeline_depth = {settings.pipeline_depth}"
        )
        if sizing.get("why"):
            lines.append(f"#     why: {sizing['why']}")
        warning = (plan.serve_plan.model.artifact or {}).get("warning")
        if warning:
            lines.append(f"#     warning: {warning}")
    return "\n".join(lines) + "\n"
