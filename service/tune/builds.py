"""The engine phase of a tune: ``TuneEngines``, every engine the tune serves, each the journal's build
(on a resume) or compiled by compile-trt now, and which engine artifact a configuration serves.

One compile (engines.py) per engine of the grid at the grid's batch range, and one for the defaults
at compile-trt's own batch range (the same build where the two agree, as on a CPU). An engine that
failed is dropped from the grid; a tune whose every engine failed ends here.
"""

from __future__ import annotations

from pathlib import Path

from compile import _defaults as compile_defaults
from service.tune.engines import EngineBuild, build_engine, build_key
from service.tune.errors import TuneFailed
from service.tune.machine import engine_batch
from service.tune.session import TuneSession
from service.tune.space import Candidate, SearchSpace


class TuneEngines:
    """``TuneEngines.build(session)``: the grid's engines and the defaults'; see the module docstring."""

    def __init__(self, session: TuneSession, builds: dict[str, EngineBuild], default_build: EngineBuild) -> None:
        self.session = session
        self.builds = builds  # the grid's engines, by name
        self.default_build = default_build  # the defaults' engine, at compile-trt's default batch

    @classmethod
    def build(cls, session: TuneSession) -> TuneEngines:
        """Every engine of ``session.space`` and the defaults' engine, in that order."""
        batch = engine_batch(session.space)
        builds = {engine: _build(session, engine, batch) for engine in session.space.values["engine"]}
        default_batch = tuple(compile_defaults.DEFAULT_BATCH)
        default = session.default.engine
        same = batch == default_batch and default in builds
        return cls(session, builds, builds[default] if same else _build(session, default, default_batch))

    def grid(self, space: SearchSpace) -> SearchSpace:
        """``space`` without the engines that did not build; ``TuneFailed`` with compile-trt's reasons
        when none did."""
        dropped = {e for e, b in self.builds.items() if not b.ok}
        try:
            return space.without_engines(dropped)
        except ValueError:
            reasons = "; ".join(
                f"{e}: {b.status}: {b.message.splitlines()[0] if b.message else ''}" for e, b in self.builds.items()
            )
            raise TuneFailed(f"No engine of the grid compiled and passed its accuracy gate ({reasons}).") from None

    def of(self, candidate: Candidate) -> EngineBuild:
        """The build ``candidate`` serves: the defaults' own, or its engine's at the grid's batch range."""
        return self.default_build if candidate == self.session.default else self.builds[candidate.engine]

    def artifact(self, candidate: Candidate) -> Path:
        return Path(self.of(candidate).artifact)

    def all(self) -> list[EngineBuild]:
        """Each build once (the defaults' may be one of the grid's), for the report."""
        return list({b.key: b for b in [*self.builds.values(), self.default_build]}.values())


def _build(session: TuneSession, engine: str, batch: tuple[int, int, int]) -> EngineBuild:
    """The journal's build of ``engine`` at ``batch``, or compile-trt's now; one progress line either way."""
    progress = session.progress
    build = session.journal.engines.get(build_key(engine, batch))
    # A journal entry is reused only while its artifact is still on disk, and unless it failed in a way
    # that may pass on a second try (a missing library, a crash).
    stale = build is not None and (
        build.retry_on_resume or (build.ok and not (Path(build.artifact) / compile_defaults.MANIFEST_FILE).exists())
    )
    if build is None or stale:
        progress.status(f"compiling {engine} (compile-trt, then its accuracy gate)")
        build = build_engine(session.settings, engine, batch, session.work / "logs", session.machine.accelerator)
        session.journal.add_engine(build)
    if build.ok:
        progress.message(f"{engine}: accuracy gate passed, {build.seconds:.0f} s ({build.message})")
    else:
        first = build.message.splitlines()[0] if build.message else ""
        progress.message(f"{engine}: DROPPED, {build.status}: {first}")
    return build
