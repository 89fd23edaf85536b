"""One settings object for the server; every field is a flag and a VISION_SERVE_* env var."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from compile._defaults import LOG_LEVELS
from preprocessing._defaults import BACKENDS as PREPROCESS_BACKENDS
from service import _defaults

ALLOWED_HOSTS = ("127.0.0.1", "0.0.0.0", "::")  # what LitServe's run() accepts


@dataclass(frozen=True)
class ServeSettings:
    artifact: str = _defaults.ARTIFACT
    model: str = _defaults.MODEL
    weights: str = _defaults.WEIGHTS
    device: str = _defaults.DEVICE
    preprocess: str = _defaults.PREPROCESS
    max_batch_size: int = _defaults.MAX_BATCH_SIZE
    batch_timeout_ms: float = _defaults.BATCH_TIMEOUT_MS
    workers_per_device: int = _defaults.WORKERS_PER_DEVICE
    host: str = _defaults.HOST
    port: int = _defaults.PORT
    log_level: str = _defaults.LOG_LEVEL

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1 (1 turns batching off), got {self.max_batch_size}.")
        if self.batch_timeout_ms < 0:
            raise ValueError(f"--batch-timeout-ms must be >= 0, got {self.batch_timeout_ms}.")
        if self.workers_per_device < 1:
            raise ValueError(f"--workers-per-device must be >= 1, got {self.workers_per_device}.")
        if self.host not in ALLOWED_HOSTS:
            raise ValueError(
                f"--host must be one of {', '.join(ALLOWED_HOSTS)} (LitServe binds only these), got {self.host!r}. "
                "Use 0.0.0.0 to listen on every interface."
            )
        if not 1024 <= self.port <= 65535:
            raise ValueError(f"--port must be in 1024..65535, got {self.port}.")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}.")
        if self.preprocess not in ("auto", *PREPROCESS_BACKENDS):
            raise ValueError(
                f"--preprocess must be auto or one of {', '.join(PREPROCESS_BACKENDS)}, got {self.preprocess!r}."
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}.")

    def as_dict(self) -> dict:
        return asdict(self)


def env_var(field_name: str) -> str:
    return _defaults.ENV_PREFIX + field_name.upper()


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Field values given by VISION_SERVE_* variables, converted to the field's type."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for f in fields(ServeSettings):
        raw = environ.get(env_var(f.name))
        if raw is None:
            continue
        kind = type(f.default)
        try:
            values[f.name] = kind(raw)
        except ValueError:
            raise ValueError(f"{env_var(f.name)}={raw!r} is not a valid {kind.__name__}.") from None
    return values
