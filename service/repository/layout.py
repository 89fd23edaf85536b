"""A model repository on disk, in Triton's layout: ``DIR/<name>/<version>/`` holds a compile-trt
artifact (``compile-trt --output DIR/<name>/<version>`` writes one), and ``DIR/<name>/config.toml``,
optional, sets what the server-wide flags would otherwise decide for that model:

    workers_per_device = 1
    max_batch_size = 8
    batch_timeout_ms = 2.0
    version_policy = {latest = 1}     # or {all = true}, or {specific = [1, 3]}

A load call may override these for one load with Triton's JSON model config (``config_override``),
whose ``version_policy`` is written ``{"latest": {"num_versions": 2}}``, ``{"all": {}}`` or
``{"specific": {"versions": [1]}}``. Torch-free: the main process reads it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from compile._defaults import ACTIVATIONS
from service._defaults import WORKER_ISOLATION_MODES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_FILE = "config.toml"
MANIFEST_FILE = "manifest.json"
# A served name travels in URL paths and metric labels: keep it to what needs no escaping there.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# Largest version number accepted: a folder name is a client-controlled size too.
MAX_VERSION = 2**31 - 1


class RepositoryError(ValueError):
    """The repository, a model's folder or its config is not usable; the message says how to fix it."""


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions of a model are served: the ``latest`` N, ``all``, or ``specific`` ones."""

    kind: str = "latest"  # "latest", "all" or "specific"
    latest: int = 1
    specific: tuple[int, ...] = ()

    def select(self, available: list[int]) -> list[int]:
        """The versions to serve among ``available``, ascending; ``RepositoryError`` if a specific
        version is missing (Triton refuses such a load too)."""
        ordered = sorted(available)
        if self.kind == "all":
            return ordered
        if self.kind == "latest":
            return ordered[-self.latest :] if ordered else []
        missing = [v for v in self.specific if v not in ordered]
        if missing:
            raise RepositoryError(
                f"version_policy asks for version(s) {', '.join(map(str, missing))}, but the model's folder has "
                f"{', '.join(map(str, ordered)) or 'none'}."
            )
        return sorted(self.specific)

    def describe(self) -> str:
        if self.kind == "all":
            return "all"
        if self.kind == "latest":
            return f"latest {self.latest}"
        return "specific " + ",".join(map(str, self.specific))


@dataclass(frozen=True)
class ModelConfig:
    """A model's own settings; ``None``: the server-wide flag's value."""

    workers_per_device: int | None = None
    max_batch_size: int | None = None
    batch_timeout_ms: float | None = None
    version_policy: VersionPolicy | None = None  # None: Triton's default, the latest version
    activation: str | None = None  # auto (the model's own), softmax, sigmoid or none
    isolation: str | None = None  # shared (engines in shared worker processes) or process (its own)

    @property
    def policy(self) -> VersionPolicy:
        return self.version_policy or VersionPolicy()

    def merged(self, override: ModelConfig) -> ModelConfig:
        """This config with the fields ``override`` sets (a load call's ``config``)."""
        changes = {f.name: getattr(override, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{name: value for name, value in changes.items() if value is not None})


@dataclass(frozen=True)
class ModelFolder:
    name: str
    path: Path
    versions: dict[int, Path]  # version -> artifact directory
    config: ModelConfig


def check_model_name(name: str) -> None:
    if not NAME_PATTERN.match(name):
        raise RepositoryError(
            f"Model name {name!r}: use letters, digits, '_', '.' and '-' (at most 128, starting with a letter or "
            "digit); it appears in URLs and metric labels."
        )


def version_folders(path: Path) -> dict[int, Path]:
    """The positive-integer subfolders of a model's folder (Triton's rule: other names are ignored)."""
    versions = {}
    for child in path.iterdir():
        if child.is_dir() and child.name.isascii() and child.name.isdigit() and not child.name.startswith("0"):
            version = int(child.name)
            if version <= MAX_VERSION:
                versions[version] = child
    return versions


def read_model_folder(repository: Path, name: str) -> ModelFolder:
    """One model's folder; ``RepositoryError`` if it is missing, has no version or a bad config."""
    check_model_name(name)
    path = repository / name
    if not path.is_dir():
        known = ", ".join(model_names(repository)) or "none"
        raise RepositoryError(f"Model {name!r} is not in the repository {repository} (models there: {known}).")
    versions = version_folders(path)
    if not versions:
        raise RepositoryError(
            f"Model {name!r} has no version folder: put a compile-trt artifact in {path}/1 "
            f"(compile-trt --model ... --output {path}/1)."
        )
    config_path = path / CONFIG_FILE
    config = read_config_toml(config_path) if config_path.is_file() else ModelConfig()
    return ModelFolder(name, path, versions, config)


def model_names(repository: Path) -> list[str]:
    """The model folders of the repository, sorted; names that cannot be served are skipped."""
    if not repository.is_dir():
        raise RepositoryError(f"--model-repository {repository}: no such directory.")
    return sorted(p.name for p in repository.iterdir() if p.is_dir() and NAME_PATTERN.match(p.name))


def read_config_toml(path: Path) -> ModelConfig:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise RepositoryError(f"{path} is not a readable TOML file: {exc}") from None
    try:
        return config_from_mapping(data, toml=True)
    except RepositoryError as exc:
        raise RepositoryError(f"{path}: {exc}") from None


CONFIG_KEYS = ("workers_per_device", "max_batch_size", "batch_timeout_ms", "version_policy", "activation", "isolation")


def config_from_mapping(data: dict, *, toml: bool) -> ModelConfig:
    """A ``ModelConfig`` from config.toml's keys (``toml``) or a load call's JSON model config, which
    may carry Triton's other keys (``name``, ``backend``...): those are ignored, as they describe
    what the artifact already fixes."""
    if not isinstance(data, dict):
        raise RepositoryError("the model config must be an object of settings.")
    unknown = [key for key in data if key not in CONFIG_KEYS]
    if toml and unknown:
        raise RepositoryError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(CONFIG_KEYS)}.")
    values: dict[str, object] = {}
    for key in ("workers_per_device", "max_batch_size"):
        if key in data:
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
                raise RepositoryError(f"{key} must be an integer from 1 to 1024, got {value!r}.")
            values[key] = value
    if "batch_timeout_ms" in data:
        value = data["batch_timeout_ms"]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 60_000:
            raise RepositoryError(f"batch_timeout_ms must be a number of milliseconds from 0 to 60000, got {value!r}.")
        values["batch_timeout_ms"] = float(value)
    if "version_policy" in data:
        values["version_policy"] = parse_version_policy(data["version_policy"])
    if "activation" in data:
        choices = ("auto", *ACTIVATIONS)
        if data["activation"] not in choices:
            raise RepositoryError(f"activation must be one of {', '.join(choices)}, got {data['activation']!r}.")
        values["activation"] = data["activation"]
    if "isolation" in data:
        if data["isolation"] not in WORKER_ISOLATION_MODES:
            raise RepositoryError(
                f"isolation must be shared (its engine in the shared worker processes) or process (worker processes "
                f"of its own), got {data['isolation']!r}."
            )
        values["isolation"] = data["isolation"]
    return ModelConfig(**values)


POLICY_EXAMPLES = '{latest = 1}, {all = true} or {specific = [1, 3]} (JSON: Triton\'s {"specific": {"versions": [1]}})'


def parse_version_policy(value: object) -> VersionPolicy:
    """config.toml's short form or Triton's JSON form of a version policy."""
    if not isinstance(value, dict) or len(value) != 1:
        raise RepositoryError(f"version_policy must be one of {POLICY_EXAMPLES}, got {value!r}.")
    ((kind, argument),) = value.items()
    if kind == "all":
        return VersionPolicy("all")
    if kind == "latest":
        count = argument.get("num_versions") if isinstance(argument, dict) else argument
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 1024:
            raise RepositoryError(f"version_policy latest needs a count from 1 to 1024, got {argument!r}.")
        return VersionPolicy("latest", latest=count)
    if kind == "specific":
        versions = argument.get("versions") if isinstance(argument, dict) else argument
        if (
            not isinstance(versions, list)
            or not versions
            or len(versions) > 1024
            or not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_VERSION for v in versions)
        ):
            raise RepositoryError(f"version_policy specific needs a list of positive versions, got {argument!r}.")
        return VersionPolicy("specific", specific=tuple(sorted(set(versions))))
    raise RepositoryError(f"version_policy must be one of {POLICY_EXAMPLES}, got {value!r}.")


def parse_config_override(text: str) -> ModelConfig:
    """A load call's ``parameters.config``: Triton's model config as a JSON string."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise RepositoryError("parameters.config must be a JSON object (Triton's model config).") from None
    return config_from_mapping(data, toml=False)
