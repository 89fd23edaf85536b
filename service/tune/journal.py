"""What a tune has done so far, one JSON line per finished piece of work, so that a stopped tune resumes.

The first line says what the tune is (its settings, grid and machine, hashed into a fingerprint);
then one line per engine compiled and per configuration measured, appended and flushed to disk as
each finishes. A tune started again with the same settings reads the lines back and measures only
what is missing: the searches are deterministic given the scores, so they walk the same path up to
where the last run stopped. A line cut short by a kill is ignored (that measurement runs again).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
from pathlib import Path

from compile.settings_errors import SettingsError
from service.tune.engines import EngineBuild
from service.tune.measure import Measurement

logger = logging.getLogger(__name__)

# Settings that do not change what is measured or how it is judged: a resume may change them.
NOT_FINGERPRINTED = ("budget_min", "output", "work", "artifacts", "restart", "log_level", "confirm_rounds")


def fingerprint(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def differences(old: dict, new: dict) -> list[str]:
    return [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]


class Journal:
    """``Journal.open(path, identity, restart)``; then ``engines``, ``measurements`` and the ``add_*`` calls."""

    def __init__(self, path: Path, identity: dict) -> None:
        self.path = path
        self.identity = identity
        self.engines: dict[str, EngineBuild] = {}  # EngineBuild.key -> it
        self.measurements: dict[tuple[str, str, int], Measurement] = {}  # (phase, key, round) -> it
        self.spent_s = 0.0  # time spent by earlier runs on what they finished
        self.resumed = 0  # finished pieces of work read back when it was opened

    @classmethod
    def open(cls, path: Path, identity: dict, restart: bool = False) -> Journal:
        """The journal at ``path`` (resumed), or a new one. Raises ``ValueError`` when it holds a tune
        of other settings, naming them, unless ``restart``."""
        journal = cls(path, identity)
        if path.exists() and not restart:
            journal._read()
            journal.resumed = len(journal.engines) + len(journal.measurements)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            header = {"kind": "header", "fingerprint": fingerprint(identity), "identity": identity}
            header["started"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            path.write_text(json.dumps(header) + "\n")
        return journal

    def _read(self) -> None:
        lines = self.path.read_text().splitlines()
        try:
            header = json.loads(lines[0])
        except (IndexError, ValueError):
            raise SettingsError(
                "--work",
                str(self.path.parent),
                f"{self.path} is not a vision-tune journal.",
                "Use --restart to start over, or give another --work folder.",
            ) from None
        if header.get("fingerprint") != fingerprint(self.identity):
            changed = differences(header.get("identity", {}), self.identity)
            raise SettingsError(
                "--work",
                str(self.path.parent),
                f"{self.path.parent} holds a tune of other settings ({'; '.join(changed) or 'unknown'}).",
                "Resume it with the same settings, start over with --restart, or give another --work folder.",
            )
        for number, line in enumerate(lines[1:], 2):
            try:
                entry = json.loads(line)
                self._take(entry)
            except (ValueError, KeyError, TypeError):
                logger.warning("%s line %d is incomplete (a run stopped while writing it); ignored.", self.path, number)

    def _take(self, entry: dict) -> None:
        if entry["kind"] == "engine":
            build = EngineBuild.from_dict(entry["build"])
            self.engines[build.key] = build
            self.spent_s += build.seconds
        elif entry["kind"] == "measurement":
            measurement = Measurement.from_dict(entry["measurement"])
            self.measurements[measurement_key(measurement)] = measurement
            self.spent_s += measurement.seconds

    def _append(self, entry: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def add_engine(self, build: EngineBuild) -> None:
        self.engines[build.key] = build
        self._append({"kind": "engine", "build": build.as_dict()})

    def add_measurement(self, measurement: Measurement) -> None:
        self.measurements[measurement_key(measurement)] = measurement
        self._append({"kind": "measurement", "measurement": measurement.as_dict()})

    def measurement(self, phase: str, key: str, round_number: int = 0) -> Measurement | None:
        return self.measurements.get((phase, key, round_number))


def measurement_key(m: Measurement) -> tuple[str, str, int]:
    return (m.phase, m.candidate.key, m.round)
