"""One settings object for the server. Every field is a flag, a VISION_SERVE_* env var and a key of
the optional TOML config file; flags win over env vars, which win over the file, which wins over
the defaults. ``resolve_settings`` applies that order and remembers where each value came from.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from compile._defaults import LOG_LEVELS
from compile.cli_flags import check_device_flag, flag
from compile.model_request import ModelRequest, check_model_flags
from preprocessing._defaults import BACKENDS as PREPROCESS_BACKENDS
from service import _defaults
from service.logs import LOG_FORMATS

ALLOWED_HOSTS = ("127.0.0.1", "0.0.0.0", "::")  # what LitServe's run() accepts
# Never logged or shown: keys, and the Redis URL (it may carry a password).
SECRET_FIELDS = ("api_key", "admin_api_key", "response_cache_redis")


@dataclass(frozen=True)
class ServeSettings(ModelRequest):
    # ModelRequest's fields first: the model, its labels, served name and preprocessing overrides,
    # for the eager model; with --artifact its manifest fixes all but the name.
    artifact: str = _defaults.ARTIFACT
    weights: str = _defaults.WEIGHTS
    device: str = _defaults.DEVICE
    preprocess: str = _defaults.PREPROCESS
    max_batch_size: int = _defaults.MAX_BATCH_SIZE
    batch_timeout_ms: float = _defaults.BATCH_TIMEOUT_MS
    workers_per_device: int = _defaults.WORKERS_PER_DEVICE
    engine_threads: int = _defaults.ENGINE_THREADS
    api_servers: int = _defaults.API_SERVERS
    pipeline_depth: int = _defaults.PIPELINE_DEPTH
    host: str = _defaults.HOST
    port: int = _defaults.PORT
    grpc_port: int = _defaults.GRPC_PORT
    log_level: str = _defaults.LOG_LEVEL
    log_format: str = _defaults.LOG_FORMAT
    max_body_bytes: int = _defaults.MAX_BODY_BYTES
    max_image_pixels: int = _defaults.MAX_IMAGE_PIXELS
    max_images_per_request: int = _defaults.MAX_IMAGES_PER_REQUEST
    max_queue: int = _defaults.MAX_QUEUE
    request_timeout_s: float = _defaults.REQUEST_TIMEOUT_S
    max_header_bytes: int = _defaults.MAX_HEADER_BYTES
    header_timeout_s: float = _defaults.HEADER_TIMEOUT_S
    body_timeout_s: float = _defaults.BODY_TIMEOUT_S
    keep_alive_timeout_s: float = _defaults.KEEP_ALIVE_TIMEOUT_S
    model_repository: str = _defaults.MODEL_REPOSITORY
    model_control: str = _defaults.MODEL_CONTROL
    default_model: str = _defaults.DEFAULT_MODEL
    load_timeout_s: float = _defaults.LOAD_TIMEOUT_S
    response_cache_mb: int = _defaults.RESPONSE_CACHE_MB
    response_cache_redis_timeout_ms: float = _defaults.RESPONSE_CACHE_REDIS_TIMEOUT_MS
    response_cache_redis_ttl_s: float = _defaults.RESPONSE_CACHE_REDIS_TTL_S
    trace_sample_rate: float = _defaults.TRACE_SAMPLE_RATE
    otlp_endpoint: str = _defaults.OTLP_ENDPOINT
    # Secrets: kept out of repr() (and so out of logs and tracebacks) and out of as_dict().
    api_key: str = field(default=_defaults.API_KEY, repr=False)
    admin_api_key: str = field(default=_defaults.ADMIN_API_KEY, repr=False)
    response_cache_redis: str = field(default=_defaults.RESPONSE_CACHE_REDIS, repr=False)  # may hold a password

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1 (1 turns batching off), got {self.max_batch_size}.")
        if self.batch_timeout_ms < 0:
            raise ValueError(f"--batch-timeout-ms must be >= 0, got {self.batch_timeout_ms}.")
        check_workers(self)
        if self.host not in ALLOWED_HOSTS:
            raise ValueError(
                f"--host must be one of {', '.join(ALLOWED_HOSTS)} (LitServe binds only these), got {self.host!r}. "
                "Use 0.0.0.0 to listen on every interface."
            )
        if not 1024 <= self.port <= 65535:
            raise ValueError(f"--port must be in 1024..65535, got {self.port}.")
        if self.grpc_port and (not 1024 <= self.grpc_port <= 65535 or self.grpc_port == self.port):
            raise ValueError(
                f"--grpc-port must be 0 (no gRPC) or a port in 1024..65535 other than --port {self.port}, "
                f"got {self.grpc_port}."
            )
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}.")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(
                f"--log-format must be one of {', '.join(LOG_FORMATS)} (json: one object per line, for log "
                f"pipelines), got {self.log_format!r}."
            )
        if self.preprocess not in ("auto", *PREPROCESS_BACKENDS):
            raise ValueError(
                f"--preprocess must be auto or one of {', '.join(PREPROCESS_BACKENDS)}, got {self.preprocess!r}."
            )
        check_device_flag(self.device)
        check_model_flags(ModelRequest.from_settings(self))
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            seconds = getattr(self, name)
            if not math.isfinite(seconds) or seconds <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a number of seconds > 0, got {seconds}.")
        for name in ("max_body_bytes", "max_image_pixels", "max_images_per_request", "max_queue", "max_header_bytes"):
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
        for name in ("api_key", "admin_api_key"):
            key = getattr(self, name)
            if key != key.strip() or not (key.isascii() and key.isprintable()):
                raise ValueError(
                    f"--{name.replace('_', '-')} must be printable ASCII without spaces at its ends: HTTP headers "
                    "carry nothing else reliably."
                )
        self._check_repository()
        check_cache_and_tracing(self)

    def _check_repository(self) -> None:
        if self.model_control not in _defaults.MODEL_CONTROL_MODES:
            raise ValueError(
                f"--model-control must be none (serve what the repository holds at start) or explicit (also "
                f"Triton's load/unload API), got {self.model_control!r}."
            )
        if not math.isfinite(self.load_timeout_s) or self.load_timeout_s <= 0:
            raise ValueError(f"--load-timeout-s must be a number of seconds > 0, got {self.load_timeout_s}.")
        if self.admin_api_key and self.admin_api_key == self.api_key:
            raise ValueError(
                "--admin-api-key must differ from --api-key: a client that may classify must not be able to load "
                "or unload models."
            )
        if self.model_control == "explicit" and not self.model_repository:
            raise ValueError("--model-control explicit needs --model-repository DIR: the models it loads live there.")
        if not self.model_repository:
            return
        given = [
            flag
            for flag, value, default in (
                ("--artifact", self.artifact, _defaults.ARTIFACT),
                ("--model", self.model, _defaults.MODEL),
                ("--weights", self.weights, _defaults.WEIGHTS),
                ("--labels", self.labels, ""),
                ("--name", self.name, ""),
            )
            if value != default
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)}: with --model-repository each model's artifact decides these, and its folder "
                "name is its served name. Drop the flags, or serve one model without --model-repository."
            )

    @property
    def served_name(self) -> str:
        """The name the model is served under: --name, else what the planner derived, else --model."""
        return self.name or self.model

    def as_dict(self) -> dict:
        """The settings without the keys and secrets, safe to log or show."""
        return {k: ("(set)" if v else "") if k in SECRET_FIELDS else v for k, v in asdict(self).items()}


def module_installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def check_workers(settings: ServeSettings) -> None:
    """The flags that lay out the processes; 0 lets the server choose (service/supervisor/planning/)."""
    if settings.workers_per_device < 0:
        raise ValueError(
            f"--workers-per-device must be >= 1, or 0 to choose from the engine and the machine, "
            f"got {settings.workers_per_device}."
        )
    if settings.engine_threads < 0:
        raise ValueError(
            f"--engine-threads must be >= 1, or 0 to share the cores among the workers, got {settings.engine_threads}."
        )
    if settings.api_servers < 0:
        raise ValueError(
            f"--api-servers must be >= 1, or 0 to size it to the devices and cores, got {settings.api_servers}."
        )
    if settings.pipeline_depth < 0:
        raise ValueError(
            f"--pipeline-depth must be 1 (no overlap), 2 or more (prepare the next batches while one runs), "
            f"or 0 to choose by device, got {settings.pipeline_depth}."
        )


def check_cache_and_tracing(settings: ServeSettings) -> None:
    """The response cache's and tracing's flags (service/http/cache/, service/tracing/)."""
    if settings.response_cache_mb < 0:
        raise ValueError(f"--response-cache-mb must be >= 0 (0: no cache), got {settings.response_cache_mb}.")
    if settings.response_cache_redis:
        if not settings.response_cache_redis.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                "--response-cache-redis must be a Redis URL: redis://[:password@]host:port/db, rediss://... "
                "(TLS) or unix:///path/redis.sock."
            )
        if settings.response_cache_mb == 0:
            raise ValueError(
                "--response-cache-redis needs --response-cache-mb N > 0: the per-process cache in front of "
                "Redis (a few MiB is enough)."
            )
    for name in ("response_cache_redis_timeout_ms", "response_cache_redis_ttl_s"):
        value = getattr(settings, name)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a number > 0, got {value}.")
    if not 0.0 <= settings.trace_sample_rate <= 1.0:
        raise ValueError(
            f"--trace-sample-rate must be in 0..1 (0: no tracing, 1: every request), got {settings.trace_sample_rate}."
        )
    for wanted, module, extra in (
        (settings.response_cache_redis, "redis", "cache"),
        (settings.trace_sample_rate > 0, "opentelemetry.sdk", "tracing"),
        (settings.trace_sample_rate > 0, "opentelemetry.exporter.otlp.proto.grpc", "tracing"),
    ):
        if wanted and not module_installed(module):
            flag_name = "--response-cache-redis" if extra == "cache" else "--trace-sample-rate"
            raise ValueError(f"{flag_name} needs {module}, not installed here: pip install 'vision-serve[{extra}]'.")
    if settings.trace_sample_rate > 0 and not settings.otlp_endpoint:
        raise ValueError(
            "--trace-sample-rate > 0 needs --otlp-endpoint URL: the OTLP/gRPC collector the spans go to "
            "(e.g. http://127.0.0.1:4317)."
        )


def resolve_api_servers(requested: int, accelerator: str, inference_workers: int, cpu_count: int) -> int:
    """``--api-servers``: the number asked for, or for 0 a number that fits the devices and cores.
    Resolved once per server, from every starting version's workers (service/supervisor/planning/layout.py).

    On a CPU the model's threads want every core, and a few dozen images per second need no more
    than LitServe's one HTTP process per inference worker. A GPU classifies thousands per second,
    each one parsed, checked and answered in an HTTP process: give them a quarter of the cores (at
    least one per worker), leaving the rest to decoding and the workers.
    """
    if requested > 0:
        return requested
    if accelerator == "cpu":
        return inference_workers
    return max(inference_workers, cpu_count // 4)


def resolve_pipeline_depth(requested: int, accelerator: str) -> int:
    """``--pipeline-depth``: the number asked for, or for 0 one that fits the device. Resolved once,
    in each version's plan (service/supervisor/planning/planner.py); the workers use the plan's.

    On a GPU, decoding and resizing the next batch (its own CUDA stream, and CPU work for the
    decoders) overlaps the engine's run of this one. On a CPU both stages want the same cores, so
    the overlap does not pay (docs/benchmarks.md, benchmarks/pipeline.py): one batch at a time.
    """
    if requested > 0:
        return requested
    return 1 if accelerator == "cpu" else 2


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


CONFIG_ENV = _defaults.ENV_PREFIX + "CONFIG"


def without_setting_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) without the VISION_SERVE_* variables that set a setting or
    name a config file: for a server whose --config must be its whole configuration (vision-tune's)."""
    environ = os.environ if environ is None else environ
    settings = {env_var(f.name) for f in fields(ServeSettings)} | {CONFIG_ENV}
    return {name: value for name, value in environ.items() if name not in settings}


FIELD_TYPES = {f.name: type(f.default) for f in fields(ServeSettings)}
TYPE_NAMES = {int: "an integer", float: "a number", str: "a string"}


def read_config_file(path: str | os.PathLike) -> dict[str, object]:
    """Field values from a TOML file of ``name = value`` lines (``max_batch_size`` or ``max-batch-size``)."""
    path = Path(path).expanduser()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"Config file {path}: no such file (from --config or {CONFIG_ENV}).") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"Config file {path} is not a readable TOML file: {exc}") from None
    values: dict[str, object] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in FIELD_TYPES:
            close = difflib.get_close_matches(name, FIELD_TYPES, n=1)
            hint = f" Did you mean {close[0]}?" if close else f" Known keys: {', '.join(FIELD_TYPES)}."
            raise ValueError(f"Config file {path}: unknown key {key!r}.{hint}")
        kind = FIELD_TYPES[name]
        if kind is float and type(value) is int:
            value = float(value)
        if type(value) is not kind:
            example = toml_value(getattr(ServeSettings(), name)) if name != "api_key" else '"..."'
            raise ValueError(
                f"Config file {path}: {key} must be {TYPE_NAMES[kind]} (e.g. {name} = {example}), got {value!r}."
            )
        values[name] = value
    return values


@dataclass(frozen=True)
class ResolvedSettings:
    settings: ServeSettings
    sources: dict[str, str]  # field -> "default", "config file PATH", "env NAME" or "flag --NAME"


def resolve_settings(
    flags: Mapping[str, object],
    environ: Mapping[str, str] | None = None,
    config_path: str | None = None,
) -> ResolvedSettings:
    """Defaults < config file (``config_path``, else ``VISION_SERVE_CONFIG``) < env vars < flags."""
    environ = os.environ if environ is None else environ
    config_path = config_path or environ.get(CONFIG_ENV) or None
    values: dict[str, object] = {}
    sources = {name: "default" for name in FIELD_TYPES}
    layers = [  # lowest precedence first, each with how to name where its values came from
        (read_config_file(config_path) if config_path else {}, lambda name: f"config file {config_path}"),
        (env_overrides(environ), lambda name: f"env {env_var(name)}"),
        ({k: v for k, v in flags.items() if v is not None}, lambda name: f"flag {flag(name)}"),
    ]
    for layer, source in layers:
        for name, value in layer.items():
            values[name] = value
            sources[name] = source(name)
    try:
        settings = ServeSettings(**values)
        check_admin_key(settings)
    except ValueError as exc:
        # The checks name the flag; say where a value that is not a flag came from.
        from_elsewhere = sorted({s for s in sources.values() if s != "default" and not s.startswith("flag")})
        if from_elsewhere:
            raise ValueError(f"{exc} (values set by: {', '.join(from_elsewhere)})") from None
        raise
    return ResolvedSettings(settings, sources)


def check_admin_key(settings: ServeSettings) -> None:
    """A server started with --model-control explicit must have an admin key. (Checked where a user's
    settings are resolved: the plans that cross to other processes carry no keys at all.)"""
    if settings.model_control == "explicit" and not settings.admin_api_key:
        raise ValueError(
            "--model-control explicit needs --admin-api-key (or VISION_SERVE_ADMIN_API_KEY): the load and unload "
            "calls change what the server serves, and are never open without a key of their own."
        )


def toml_value(value: object) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for everything json escapes
    return repr(value)


def render_config(resolved: ResolvedSettings) -> str:
    """The effective settings as a TOML config file (the API key never shown), each with its source."""
    lines = [
        "# vision-serve effective configuration: flags > VISION_SERVE_* env vars > config file > defaults.",
        "# Usable as a --config file as is.",
    ]
    rows = []
    for name, value in asdict(resolved.settings).items():
        source = resolved.sources[name]
        if name in SECRET_FIELDS:
            state = "set" if value else "not set"
            rows.append((f"# {name} = ... ({state}; never printed)", source))
            continue
        rows.append((f"{name} = {toml_value(value)}", source))
    width = max(len(text) for text, _ in rows)
    lines += [f"{text.ljust(width)}  # {source}" for text, source in rows]
    return "\n".join(lines) + "\n"
