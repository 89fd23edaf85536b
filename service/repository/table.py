"""Which workers serve which model version, and which are ready: the ``RoutingTable`` the main process
publishes and every HTTP process follows.

The main process writes the table as a file in the channels' directory (``TableFile``: a pickle,
replaced atomically) whenever a load or unload changes it, or a worker's state changes (ready,
failed, restarted: service/supervisor/pool/states.py); each HTTP process's worker watch reads
it again when it changed (a ``stat`` per poll) and then records the generation it follows in shared
memory (``acks``), so that a load call returns only once every HTTP process sends new requests to
the new version. ``draining`` lists the workers of replaced or unloaded versions: they get no new
requests, and each HTTP process tells each of them, once, that it will send nothing more
(service/transport/channels.py), so a worker knows when it has answered everything and may exit.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from service.errors import InvalidInput, NotFound
from service.model_info import ModelInfo

TABLE_FILE = "routing-table.pickle"


@dataclass(frozen=True)
class VersionRoute:
    """One served version of a model: its workers and what it is."""

    name: str
    version: int
    workers: tuple[int, ...]
    model: ModelInfo
    # False: a version of a repository served on demand that is not loaded now (no workers): a request
    # for it asks the main process to load it (service/http/pipeline/on_demand.py).
    resident: bool = True


@dataclass(frozen=True)
class RoutingTable:
    generation: int = 0
    # name -> version -> route; only versions whose workers were all ready when they were published.
    models: dict[str, dict[int, VersionRoute]] = field(default_factory=dict)
    draining: tuple[int, ...] = ()
    default_model: str = ""  # /predict without ?model=; "" when there is no single answer
    # Worker id -> "starting", "ready", "error" or "unresponsive" (hung: service/supervisor/pool/
    # hangs.py), of every worker the main process has (it publishes a new table at each change):
    # requests go only to ready ones, and a worker that is not ready has the requests it held
    # answered with 503 (service/http/base/worker_watch.py).
    worker_states: dict[int, str] = field(default_factory=dict)
    # The main process is still loading the repository's first models (on demand: those that fit its
    # memory budget): the server is not ready yet, though some models may answer.
    filling: bool = False
    # Worker id -> the pid of the process it runs in: the workers of one shared process
    # (service/worker/host.py) share its cores, and the HTTP processes spread requests by process.
    worker_processes: dict[int, int] = field(default_factory=dict)

    def routes(self) -> list[VersionRoute]:
        return [route for versions in self.models.values() for route in versions.values()]

    def serving_workers(self) -> set[int]:
        return {worker for route in self.routes() for worker in route.workers}

    def resolve(self, name: str | None, version: str | int | None = None) -> VersionRoute:
        """The route for ``name`` (``None``: the default model) at ``version`` (``None``: its latest
        loaded one); ``ServiceError`` 400 or 404 saying what is served."""
        if not name:
            if not self.default_model:
                names = ", ".join(sorted(self.models)) or "none"
                raise (InvalidInput if self.models else NotFound)(
                    f"Name the model: ?model=NAME (models loaded: {names}), or start the server with --default-model.",
                )
            name = self.default_model
        versions = self.models.get(name)
        if not versions:
            loaded = ", ".join(sorted(self.models)) or "none"
            raise NotFound(f"Request for unknown model: '{name}' is not found (models loaded: {loaded}).")
        if version in (None, ""):
            return versions[max(versions)]
        number = parse_version(version)
        route = versions.get(number) if number is not None else None
        if route is None:
            loaded = ", ".join(map(str, sorted(versions)))
            raise NotFound(
                f"Request for unknown model: '{name}' version {version} is not found (versions loaded: {loaded})."
            )
        return route

    def current(self, route: VersionRoute, pinned: bool = False) -> VersionRoute:
        """``route`` if this table still serves its version with the same workers; else the version a
        request for it gets now (``pinned``: that very version, else the model's latest), or
        ``ServiceError`` 404 when there is none. For a route resolved before an await."""
        served = self.models.get(route.name, {}).get(route.version)
        if served is not None and served.workers == route.workers:
            return route
        return self.resolve(route.name, route.version if pinned else None)


def parse_version(version: str | int) -> int | None:
    if isinstance(version, int):
        return version
    if version.isascii() and version.isdigit() and len(version) <= 10:
        return int(version)
    return None


class TableFile:
    """The published table: written by the main process, read by the HTTP processes."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.path = Path(directory) / TABLE_FILE
        self._seen: tuple[int, int] | None = None

    def write(self, table: RoutingTable) -> None:
        partial = self.path.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(table, pickle.HIGHEST_PROTOCOL))
        os.replace(partial, self.path)  # readers see the old table or the new one, never half of one

    def read_if_changed(self) -> RoutingTable | None:
        """The table if the file changed since the last read, else ``None`` (one ``stat``)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return None
        key = (stat.st_mtime_ns, stat.st_ino)
        if key == self._seen:
            return None
        table = pickle.loads(self.path.read_bytes())
        self._seen = key
        return table
