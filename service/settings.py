"""One settings object for the server; every field is a flag and a VISION_SERVE_* env var."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

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
    max_body_bytes: int = _defaults.MAX_BODY_BYTES
    max_image_pixels: int = _defaults.MAX_IMAGE_PIXELS
    max_queue: int = _defaults.MAX_QUEUE
    request_timeout_s: float = _defaults.REQUEST_TIMEOUT_S
    # A secret: kept out of repr() (and so out of logs and tracebacks) and out of as_dict().
    api_key: str = field(default=_defaults.API_KEY, repr=False)

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
        for name in ("max_body_bytes", "max_image_pixels", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")
        if not math.isfinite(self.request_timeout_s) or self.request_timeout_s <= 0:
            # No "off": the deadline is what guarantees an answer even for a request lost with a
            # crashed worker before it could report taking it. Use a large value for long batches.
            raise ValueError(f"--request-timeout-s must be a number > 0, got {self.request_timeout_s}.")
        if self.request_timeout_s * 1000 <= self.batch_timeout_ms:
            raise ValueError(
                f"--request-timeout-s {self.request_timeout_s} must be longer than --batch-timeout-ms "
                f"{self.batch_timeout_ms} (the wait for a batch to fill), or every request would time out."
            )
        if self.api_key != self.api_key.strip() or not (self.api_key.isascii() and self.api_key.isprintable()):
            raise ValueError(
                "--api-key must be printable ASCII without spaces at its ends: HTTP headers carry nothing else "
                "reliably."
            )

    def as_dict(self) -> dict:
        """The settings without the API key, safe to log or show."""
        values = asdict(self)
        values["api_key"] = "(set)" if self.api_key else ""
        return values


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
