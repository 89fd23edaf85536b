"""The search space: one ``Candidate`` per vision-serve configuration, and the grid they form."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

# The dimensions in the order quick search walks them: the engine first (the largest factor measured),
# then how much each worker batches and how many there are, then the rest.
DIMENSIONS = (
    "engine",
    "max_batch_size",
    "workers_per_device",
    "batch_timeout_ms",
    "api_servers",
    "pipeline_depth",
    "preprocess",
    "device",
)
NUMERIC = ("max_batch_size", "workers_per_device", "batch_timeout_ms", "api_servers", "pipeline_depth")


@dataclass(frozen=True, order=True)
class Candidate:
    """One configuration: an engine (``backend-precision``, compiled by compile-trt) and the serving
    settings that vision-serve takes from a config file."""

    engine: str
    max_batch_size: int
    workers_per_device: int
    batch_timeout_ms: float
    api_servers: int
    pipeline_depth: int
    preprocess: str
    device: str

    @property
    def key(self) -> str:
        """A short, stable name: ``onnx-fp32 b8 w1 t0 a0 p0 pil cpu`` (a0/p0: automatic)."""
        return (
            f"{self.engine} b{self.max_batch_size} w{self.workers_per_device} t{self.batch_timeout_ms:g} "
            f"a{self.api_servers} p{self.pipeline_depth} {self.preprocess} {self.device}"
        )

    def replace(self, **changes: object) -> Candidate:
        return dataclasses.replace(self, **changes)

    def serve_values(self, artifact: Path) -> dict[str, object]:
        """The vision-serve settings (ServeSettings field names) that serve this configuration."""
        return {
            "artifact": str(artifact),
            "device": self.device,
            "preprocess": self.preprocess,
            "max_batch_size": self.max_batch_size,
            "batch_timeout_ms": float(self.batch_timeout_ms),
            "workers_per_device": self.workers_per_device,
            "api_servers": self.api_servers,
            "pipeline_depth": self.pipeline_depth,
        }

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> Candidate:
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


def split_engine(engine: str) -> tuple[str, str]:
    """``onnx-fp32`` -> ``("onnx", "fp32")``."""
    backend, _, precision = engine.rpartition("-")
    return backend, precision


@dataclass(frozen=True)
class SearchSpace:
    """The grid: the values of every dimension, in DIMENSIONS order."""

    values: Mapping[str, tuple]

    def __post_init__(self) -> None:
        missing = [d for d in DIMENSIONS if not self.values.get(d)]
        if missing:
            raise ValueError(f"the grid has no values for {', '.join(missing)}")

    @property
    def size(self) -> int:
        return math.prod(len(self.values[d]) for d in DIMENSIONS)

    @property
    def varied(self) -> tuple[str, ...]:
        """The dimensions with more than one value: the only ones a search moves along."""
        return tuple(d for d in DIMENSIONS if len(self.values[d]) > 1)

    def __iter__(self) -> Iterator[Candidate]:
        for combination in itertools.product(*(self.values[d] for d in DIMENSIONS)):
            yield Candidate(**dict(zip(DIMENSIONS, combination, strict=True)))

    def __contains__(self, candidate: object) -> bool:
        return isinstance(candidate, Candidate) and all(getattr(candidate, d) in self.values[d] for d in DIMENSIONS)

    def line(self, candidate: Candidate, dimension: str) -> list[Candidate]:
        """``candidate`` with each value of ``dimension`` in turn (itself included)."""
        return [candidate.replace(**{dimension: value}) for value in self.values[dimension]]

    def project(self, candidate: Candidate) -> Candidate:
        """The grid point nearest ``candidate``: its own value where the grid has it, else the nearest
        number, else the grid's first value."""
        changes = {}
        for dimension in DIMENSIONS:
            value, allowed = getattr(candidate, dimension), self.values[dimension]
            if value in allowed:
                continue
            if dimension in NUMERIC:
                changes[dimension] = min(allowed, key=lambda v: (abs(v - value), v))
            else:
                changes[dimension] = allowed[0]
        return candidate.replace(**changes)

    def center(self, candidate: Candidate) -> Candidate:
        """``candidate`` (projected) with every numeric dimension at the middle of its values (the lower
        middle for an even count): where quick search starts with ``from_center``."""
        middle = {d: self.values[d][(len(self.values[d]) - 1) // 2] for d in NUMERIC}
        return self.project(candidate).replace(**middle)

    def as_dict(self) -> dict[str, list]:
        return {d: list(self.values[d]) for d in DIMENSIONS}

    def without_engines(self, dropped: set[str]) -> SearchSpace:
        """The grid without the engines that did not compile or pass their gate."""
        kept = tuple(e for e in self.values["engine"] if e not in dropped)
        if not kept:
            raise ValueError("no engine of the grid compiled and passed its accuracy gate")
        return SearchSpace({**self.values, "engine": kept})
