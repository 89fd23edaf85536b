"""What a tune works with, set up before anything is measured: ``TuneSession``.

The machine and the grid it offers, the defaults, the images sent, the journal (opened for a resume
when it holds a tune of the same settings), the objective, how each configuration is loaded, and the
progress line. Every phase of a tune reads these; only the engine phase narrows the grid.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from service.tune import _defaults
from service.tune.errors import TuneSetupError
from service.tune.images import read_images, write_benchmark_images
from service.tune.journal import NOT_FINGERPRINTED, Journal
from service.tune.machine import Machine, build_grid, default_candidate, probe_machine
from service.tune.measure import LoadPlan
from service.tune.progress import TuneProgress
from service.tune.search import Objective
from service.tune.settings import TuneSettings
from service.tune.space import Candidate, SearchSpace


def load_images(folder: str | Path | None, work: Path) -> list[bytes]:
    """The images a tune sends: ``folder`` (its --images), or the project's benchmark photos, written
    into ``work/images`` once (seeded: the same bytes every time)."""
    if folder:
        return read_images(Path(folder).expanduser())
    directory = work / "images"
    if not directory.is_dir():
        write_benchmark_images(directory)
    return read_images(directory)


def images_digest(images: list[bytes]) -> str:
    """A short hash of the images, in order: part of the journal's identity of a tune."""
    digest = hashlib.sha256()
    for image in images:
        digest.update(hashlib.sha256(image).digest())
    return digest.hexdigest()[:16]


@dataclass
class TuneSession:
    """``TuneSession.open(settings)``: everything a tune's phases share; see the module docstring."""

    settings: TuneSettings
    machine: Machine
    space: SearchSpace  # the grid; without the engines that did not build once the engine phase has run
    notes: list[str]  # what build_grid left out of the grid, and why
    default: Candidate
    images: list[bytes]
    journal: Journal
    objective: Objective
    plan: LoadPlan
    progress: TuneProgress

    @property
    def work(self) -> Path:
        return self.settings.work_dir

    @property
    def output(self) -> Path:
        return self.settings.output_path

    @classmethod
    def open(cls, settings: TuneSettings, live_progress: bool | None = None) -> TuneSession:
        """What the machine offers, the images, the journal; ``TuneSetupError`` says what does not fit."""
        s = settings
        try:
            machine = probe_machine(s.device)
            space, notes = build_grid(s, machine)
            default = default_candidate(machine)
            images = load_images(s.images, s.work_dir)
            s.work_dir.mkdir(parents=True, exist_ok=True)
            identity = tune_identity(s, space, default, machine, images)
            journal = Journal.open(s.work_dir / _defaults.JOURNAL_FILE, identity, s.restart)
        except ValueError as exc:  # a SettingsError keeps its flag, value and fix
            raise TuneSetupError.of(exc) from None
        gpu = machine.accelerator == "cuda"
        objective = Objective(s.objective, s.p99_ms, s.max_memory_mib, machine.accelerator)
        clients = s.client_processes or (_defaults.GPU_CLIENT_PROCESSES if gpu else _defaults.CPU_CLIENT_PROCESSES)
        plan = LoadPlan(
            s.p99_ms, s.step_seconds, s.min_requests, s.poisson_seconds, s.load_factor, s.max_concurrency,
            clients, max(machine.gpu_count, 1), gpu,
        )  # fmt: skip
        progress = TuneProgress(0, 60 * s.budget_min, journal.spent_s, live=live_progress)
        return cls(s, machine, space, notes, default, images, journal, objective, plan, progress)


def tune_identity(
    settings: TuneSettings, space: SearchSpace, default: Candidate, machine: Machine, images: list[bytes]
) -> dict:
    """What makes two runs the same tune (the journal's fingerprint): the settings that change what is
    measured or how it is judged, the grid, the defaults, the machine and the images."""
    measured = {k: v for k, v in settings.as_dict().items() if k not in NOT_FINGERPRINTED}
    return {
        **measured,
        "grid": space.as_dict(),
        "default": default.key,
        "machine": machine.name,
        "images": images_digest(images),
    }
