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

from compile._defaults import ACTIVATIONS, LOG_LEVELS
from compile.cli_flags import check_device_flag, flag
from compile.model_request import ModelRequest, check_model_flags
from compile.preprocess_flags import NUMBER_FIELDS, SWITCH_FIELDS, SWITCHES, TRIPLET_FIELDS
from compile.settings_errors import HIDDEN, SettingsError
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
    activation: str = _defaults.ACTIVATION
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
    worker_heartbeat_timeout_s: float = _defaults.WORKER_HEARTBEAT_TIMEOUT_S
    batch_hang_timeout_s: float = _defaults.BATCH_HANG_TIMEOUT_S
    max_header_bytes: int = _defaults.MAX_HEADER_BYTES
    header_timeout_s: float = _defaults.HEADER_TIMEOUT_S
    body_timeout_s: float = _defaults.BODY_TIMEOUT_S
    keep_alive_timeout_s: float = _defaults.KEEP_ALIVE_TIMEOUT_S
    model_repository: str = _defaults.MODEL_REPOSITORY
    model_control: str = _defaults.MODEL_CONTROL
    default_model: str = _defaults.DEFAULT_MODEL
    load_timeout_s: float = _defaults.LOAD_TIMEOUT_S
    worker_isolation: str = _defaults.WORKER_ISOLATION
    memory_budget_mib: int = _defaults.MEMORY_BUDGET_MIB
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
        # In the order a user reads the flags; each check names its flag, the value and the fix.
        check_batching(self)
        check_workers(self)
        check_network(self)
        check_choices(self)
        check_device_flag(self.device)
        check_model_flags(ModelRequest.from_settings(self))
        check_limits(self)
        check_keys(self)
        check_repository(self)
        check_cache_and_tracing(self)

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


def check_batching(settings: ServeSettings) -> None:
    """How batches are made: --max-batch-size, --batch-timeout-ms."""
    if settings.max_batch_size < 1:
        raise SettingsError.must(
            "--max-batch-size",
            settings.max_batch_size,
            "be >= 1 (1 turns batching off)",
            f"Leave it out for {_defaults.MAX_BATCH_SIZE}.",
        )
    if not math.isfinite(settings.batch_timeout_ms) or settings.batch_timeout_ms < 0:
        raise SettingsError.must(
            "--batch-timeout-ms",
            settings.batch_timeout_ms,
            "be a number >= 0",
            "Use 0 to run each batch as soon as it can.",
        )


def check_network(settings: ServeSettings) -> None:
    """Where the server listens: --host, --port, --grpc-port."""
    if settings.host not in ALLOWED_HOSTS:
        raise SettingsError.must(
            "--host",
            settings.host,
            f"be one of {', '.join(ALLOWED_HOSTS)} (LitServe binds only these)",
            "Use 0.0.0.0 to listen on every interface.",
        )
    if not 1024 <= settings.port <= 65535:
        raise SettingsError.must(
            "--port", settings.port, "be in 1024..65535", "Pick a free port from 1024 up (8000 by default)."
        )
    if settings.grpc_port and (not 1024 <= settings.grpc_port <= 65535 or settings.grpc_port == settings.port):
        raise SettingsError.must(
            "--grpc-port",
            settings.grpc_port,
            f"be 0 (no gRPC) or a port in 1024..65535 other than --port {settings.port}",
            "Pick another free port (Triton uses 8001), or 0 for no gRPC.",
        )


def check_choices(settings: ServeSettings) -> None:
    """The flags that name one of a few: --log-level, --log-format, --preprocess, --activation."""
    if settings.log_level not in LOG_LEVELS:
        raise SettingsError.must(
            "--log-level", settings.log_level, f"be one of {', '.join(LOG_LEVELS)}", "Leave it out for info."
        )
    if settings.log_format not in LOG_FORMATS:
        raise SettingsError.must(
            "--log-format",
            settings.log_format,
            f"be one of {', '.join(LOG_FORMATS)} (json: one object per line, for log pipelines)",
            "Use text for a terminal, json for a log pipeline.",
        )
    if settings.preprocess not in ("auto", *PREPROCESS_BACKENDS):
        raise SettingsError.must(
            "--preprocess",
            settings.preprocess,
            f"be auto or one of {', '.join(PREPROCESS_BACKENDS)}",
            "Use auto: the fastest this machine can run.",
        )
    if settings.activation not in ("auto", *ACTIVATIONS):
        raise SettingsError.must(
            "--activation",
            settings.activation,
            f"be auto or one of {', '.join(ACTIVATIONS)}",
            "Use auto: the model's own (sigmoid for a multi-label transformers folder, else softmax).",
        )


def check_limits(settings: ServeSettings) -> None:
    """What a request may be and take: the timeouts and the size limits (service/http/)."""
    for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
        seconds = getattr(settings, name)
        if not math.isfinite(seconds) or seconds <= 0:
            raise SettingsError.must(
                flag(name),
                seconds,
                "be a number of seconds > 0",
                f"Leave it out for {getattr(_defaults, name.upper()):g} s.",
            )
    for name in ("max_body_bytes", "max_image_pixels", "max_images_per_request", "max_queue", "max_header_bytes"):
        if getattr(settings, name) < 1:
            raise SettingsError.must(
                flag(name), getattr(settings, name), "be >= 1", f"Leave it out for {getattr(_defaults, name.upper())}."
            )
    if not math.isfinite(settings.request_timeout_s) or settings.request_timeout_s <= 0:
        # No "off": the deadline is what guarantees an answer even for a request lost with a
        # crashed worker before it could report taking it. Use a large value for long batches.
        raise SettingsError.must(
            "--request-timeout-s",
            settings.request_timeout_s,
            "be a number > 0",
            f"Leave it out for {_defaults.REQUEST_TIMEOUT_S:g} s, or give a large value for long batches.",
        )
    check_hang_timeouts(settings)
    if settings.request_timeout_s * 1000 <= settings.batch_timeout_ms:
        raise SettingsError(
            "--request-timeout-s, --batch-timeout-ms",
            (settings.request_timeout_s, settings.batch_timeout_ms),
            f"--request-timeout-s {settings.request_timeout_s} must be longer than --batch-timeout-ms "
            f"{settings.batch_timeout_ms} (the wait for a batch to fill), or every request would time out.",
            "Raise --request-timeout-s, or lower --batch-timeout-ms.",
        )


def check_hang_timeouts(settings: ServeSettings) -> None:
    """When a worker counts as hung: --worker-heartbeat-timeout-s, --batch-hang-timeout-s."""
    heartbeat = settings.worker_heartbeat_timeout_s
    least = _defaults.MIN_WORKER_HEARTBEAT_TIMEOUT_S
    if not math.isfinite(heartbeat) or not (heartbeat == 0 or heartbeat >= least):
        raise SettingsError.must(
            "--worker-heartbeat-timeout-s",
            heartbeat,
            f"be 0 (off) or >= {least:g} s (workers beat every {_defaults.WORKER_BEAT_INTERVAL_S:g} s)",
            f"Leave it out for {_defaults.WORKER_HEARTBEAT_TIMEOUT_S:g} s.",
        )
    if not math.isfinite(settings.batch_hang_timeout_s) or settings.batch_hang_timeout_s < 0:
        raise SettingsError.must(
            "--batch-hang-timeout-s",
            settings.batch_hang_timeout_s,
            "be a number of seconds >= 0",
            f"Leave it out for {_defaults.BATCH_HANG_REQUEST_TIMEOUTS} x --request-timeout-s.",
        )


def batch_hang_timeout_s(settings: ServeSettings) -> float:
    """How long one batch may run while its worker beats: the flag, or by default a multiple of the
    request deadline (a batch past it has had every request answered 504), at least MIN_BATCH_HANG_S."""
    if settings.batch_hang_timeout_s:
        return settings.batch_hang_timeout_s
    return max(_defaults.BATCH_HANG_REQUEST_TIMEOUTS * settings.request_timeout_s, _defaults.MIN_BATCH_HANG_S)


def check_keys(settings: ServeSettings) -> None:
    """The API keys: what an HTTP header can carry."""
    for name in ("api_key", "admin_api_key"):
        key = getattr(settings, name)
        if key != key.strip() or not (key.isascii() and key.isprintable()):
            raise SettingsError(
                flag(name),
                HIDDEN,  # a key is never shown, not even a wrong one
                f"{flag(name)} must be printable ASCII without spaces at its ends: HTTP headers carry nothing "
                "else reliably.",
                "Make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'.",
            )


def check_repository(settings: ServeSettings) -> None:
    """The model repository and its API (service/repository/, service/supervisor/pool/)."""
    if settings.model_control not in _defaults.MODEL_CONTROL_MODES:
        raise SettingsError.must(
            "--model-control",
            settings.model_control,
            "be none (serve what the repository holds at start) or explicit (also Triton's load/unload API)",
            "Leave it out for none.",
        )
    if not math.isfinite(settings.load_timeout_s) or settings.load_timeout_s <= 0:
        raise SettingsError.must(
            "--load-timeout-s",
            settings.load_timeout_s,
            "be a number of seconds > 0",
            f"Leave it out for {_defaults.LOAD_TIMEOUT_S:g} s.",
        )
    if settings.worker_isolation not in _defaults.WORKER_ISOLATION_MODES:
        raise SettingsError.must(
            "--worker-isolation",
            settings.worker_isolation,
            "be shared (many models' engines in each worker process) or process (worker processes per model)",
            'Leave it out for shared; set isolation = "process" in one model\'s config.toml to isolate only it.',
        )
    if settings.memory_budget_mib < 0:
        raise SettingsError.must(
            "--memory-budget-mib",
            settings.memory_budget_mib,
            "be a number of MiB >= 0",
            "Use 0 to size it from the machine's memory at start.",
        )
    if settings.admin_api_key and settings.admin_api_key == settings.api_key:
        raise SettingsError(
            "--admin-api-key",
            HIDDEN,
            "--admin-api-key must differ from --api-key: a client that may classify must not be able to load "
            "or unload models.",
            "Make another key for the admin.",
        )
    if settings.model_control == "explicit" and not settings.model_repository:
        raise SettingsError(
            "--model-control",
            settings.model_control,
            "--model-control explicit needs --model-repository DIR: the models it loads live there.",
            "Add --model-repository DIR, or leave --model-control out.",
        )
    if not settings.model_repository:
        return
    given = [
        given_flag
        for given_flag, value, default in (
            ("--artifact", settings.artifact, _defaults.ARTIFACT),
            ("--model", settings.model, _defaults.MODEL),
            ("--weights", settings.weights, _defaults.WEIGHTS),
            ("--labels", settings.labels, ""),
            ("--name", settings.name, ""),
        )
        if value != default
    ]
    if given:
        raise SettingsError(
            ", ".join(given),
            settings.model_repository,
            f"{', '.join(given)}: with --model-repository each model's artifact decides these, and its folder "
            "name is its served name.",
            "Drop the flags, or serve one model without --model-repository.",
        )


def check_workers(settings: ServeSettings) -> None:
    """The flags that lay out the processes; 0 lets the server choose (service/supervisor/planning/)."""
    auto = "Use 0 to let the server choose (--print-config shows what and why)."
    if not 0 <= settings.workers_per_device <= _defaults.MAX_WORKERS_PER_DEVICE:
        raise SettingsError.must(
            "--workers-per-device",
            settings.workers_per_device,
            f"be >= 1, or 0 to choose from the engine and the machine; at most {_defaults.MAX_WORKERS_PER_DEVICE}",
            auto,
        )
    if not 0 <= settings.engine_threads <= _defaults.MAX_ENGINE_THREADS:
        raise SettingsError.must(
            "--engine-threads",
            settings.engine_threads,
            f"be >= 1, or 0 to share the cores among the workers; at most {_defaults.MAX_ENGINE_THREADS}",
            auto,
        )
    if not 0 <= settings.api_servers <= _defaults.MAX_API_SERVERS:
        raise SettingsError.must(
            "--api-servers",
            settings.api_servers,
            f"be >= 1, or 0 to size it to the devices and cores; at most {_defaults.MAX_API_SERVERS}",
            auto,
        )
    if settings.pipeline_depth < 0:
        raise SettingsError.must(
            "--pipeline-depth",
            settings.pipeline_depth,
            "be 1 (no overlap), 2 or more (prepare the next batches while one runs), or 0 to choose by device",
            auto,
        )


def check_cache_and_tracing(settings: ServeSettings) -> None:
    """The response cache's and tracing's flags (service/http/cache/, service/tracing/)."""
    if settings.response_cache_mb < 0:
        raise SettingsError.must(
            "--response-cache-mb",
            settings.response_cache_mb,
            "be >= 0 (0: no cache)",
            "Give the MiB of answers each HTTP process may keep, or 0 for no cache.",
        )
    if settings.response_cache_redis:
        if not settings.response_cache_redis.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError(
                "--response-cache-redis",
                HIDDEN,  # it may carry a password
                "--response-cache-redis must be a Redis URL: redis://[:password@]host:port/db, rediss://... "
                "(TLS) or unix:///path/redis.sock.",
                "Start it with one of those schemes, e.g. redis://127.0.0.1:6379/0.",
            )
        if settings.response_cache_mb == 0:
            raise SettingsError(
                "--response-cache-mb",
                settings.response_cache_mb,
                "--response-cache-redis needs --response-cache-mb N > 0: the per-process cache in front of Redis.",
                "Add --response-cache-mb 64 (a few MiB is enough).",
            )
    for name in ("response_cache_redis_timeout_ms", "response_cache_redis_ttl_s"):
        value = getattr(settings, name)
        if not math.isfinite(value) or value <= 0:
            default = getattr(_defaults, name.upper())
            raise SettingsError.must(flag(name), value, "be a number > 0", f"Leave it out for {default:g}.")
    if not 0.0 <= settings.trace_sample_rate <= 1.0:
        raise SettingsError.must(
            "--trace-sample-rate",
            settings.trace_sample_rate,
            "be in 0..1 (0: no tracing, 1: every request)",
            "Use e.g. 0.01 to trace one request in a hundred.",
        )
    for wanted, module, extra in (
        (settings.response_cache_redis, "redis", "cache"),
        (settings.trace_sample_rate > 0, "opentelemetry.sdk", "tracing"),
        (settings.trace_sample_rate > 0, "opentelemetry.exporter.otlp.proto.grpc", "tracing"),
    ):
        if wanted and not module_installed(module):
            flag_name, value = (
                ("--response-cache-redis", HIDDEN)
                if extra == "cache"
                else ("--trace-sample-rate", settings.trace_sample_rate)
            )
            raise SettingsError(
                flag_name,
                value,
                f"{flag_name} needs {module}, not installed here.",
                f"pip install 'vision-serve[{extra}]', or leave {flag_name} out.",
            )
    if settings.trace_sample_rate > 0 and not settings.otlp_endpoint:
        raise SettingsError(
            "--otlp-endpoint",
            None,
            f"--trace-sample-rate {settings.trace_sample_rate:g} > 0 needs --otlp-endpoint URL: the OTLP/gRPC "
            "collector the spans go to.",
            "Add e.g. --otlp-endpoint http://127.0.0.1:4317, or use --trace-sample-rate 0.",
        )


def resolve_api_servers(requested: int, accelerator: str, worker_processes: int, cpu_count: int) -> int:
    """``--api-servers``: the number asked for, or for 0 a number that fits the devices and cores.
    Resolved once per server, from the worker processes of every starting version
    (service/supervisor/planning/layout.py: ``worker_processes``; one model: its workers).

    On a CPU the model's threads want every core, and a few dozen images per second need no more
    than LitServe's one HTTP process per inference worker process. A GPU classifies thousands per
    second, each one parsed, checked and answered in an HTTP process: give them a quarter of the cores
    (at least one per worker process), leaving the rest to decoding and the workers. The model slots
    of a shared process run one batch at a time, so more slots need no more HTTP processes.
    """
    if requested > 0:
        return requested
    if accelerator == "cpu":
        return worker_processes
    return max(worker_processes, cpu_count // 4)


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
            shown = HIDDEN if f.name in SECRET_FIELDS else raw
            raise SettingsError(
                env_var(f.name),
                shown,
                f"{env_var(f.name)}={shown!r} is not a valid {kind.__name__}.",
                f"Set it to {TYPE_NAMES[kind]}, e.g. {env_var(f.name)}={f.default}, or unset it.",
            ) from None
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
        raise SettingsError(
            "--config",
            str(path),
            f"Config file {path}: no such file (from --config or {CONFIG_ENV}).",
            "Give the path of a TOML file (vision-serve --print-config writes one).",
        ) from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(
            "--config",
            str(path),
            f"Config file {path} is not a readable TOML file: {exc}.",
            "Write it as name = value lines (vision-serve --print-config writes one).",
        ) from None
    values: dict[str, object] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in FIELD_TYPES:
            close = difflib.get_close_matches(name, FIELD_TYPES, n=1)
            hint = f"Did you mean {close[0]}?" if close else f"Known keys: {', '.join(FIELD_TYPES)}."
            # The value of a key that is not known may be a secret under a misspelt name: not kept.
            raise SettingsError(f"config file key {key}", HIDDEN, f"Config file {path}: unknown key {key!r}.", hint)
        kind = FIELD_TYPES[name]
        value = config_text(name, value)
        if kind is float and type(value) is int:
            value = float(value)
        if type(value) is not kind:
            example = toml_value(getattr(ServeSettings(), name)) if name not in SECRET_FIELDS else '"..."'
            shown = HIDDEN if name in SECRET_FIELDS else value
            raise SettingsError(
                f"config file key {key}",
                shown,
                f"Config file {path}: {key} must be {TYPE_NAMES[kind]} (e.g. {name} = {example}), got {shown!r}.",
                f"Write it as {name} = {example}.",
            )
        values[name] = value
    return values


def config_text(name: str, value: object) -> object:
    """A preprocessing key's TOML number, boolean or array as the text its flag takes: ``resize_size = 256``
    is ``--resize-size 256`` (as before sizes took ``HxW`` too), ``antialias = false`` is ``--antialias off``,
    ``mean = [0.5, 0.5, 0.5]`` is ``--mean 0.5,0.5,0.5``."""
    if name in NUMBER_FIELDS and type(value) in (int, float):
        return str(value)
    if name in TRIPLET_FIELDS and isinstance(value, list) and all(type(v) in (int, float) for v in value):
        return ",".join(str(v) for v in value)
    if name in SWITCH_FIELDS and type(value) is bool:
        return next(word for word, on in SWITCHES.items() if on is value)
    return value


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
    except SettingsError as exc:
        # The checks name the flag; say where a value that is not a flag came from.
        from_elsewhere = sorted({s for s in sources.values() if s != "default" and not s.startswith("flag")})
        if from_elsewhere:
            message = f"{exc.message} (values set by: {', '.join(from_elsewhere)})"
            raise exc.with_message(message, where_set(exc.flag, sources)) from None
        raise
    return ResolvedSettings(settings, sources)


def where_set(flag_name: str, sources: Mapping[str, str]) -> str:
    """``flag_name`` as the user set it: the flag, the VISION_SERVE_* variable, or the config file's key."""
    name = flag_name.removeprefix("--").replace("-", "_")
    source = sources.get(name, "")
    if source.startswith("env "):
        return source.removeprefix("env ")
    if source.startswith("config file "):
        return f"{name} ({source})"
    return flag_name


def check_admin_key(settings: ServeSettings) -> None:
    """A server started with --model-control explicit must have an admin key. (Checked where a user's
    settings are resolved: the plans that cross to other processes carry no keys at all.)"""
    if settings.model_control == "explicit" and not settings.admin_api_key:
        raise SettingsError(
            "--admin-api-key",
            None,
            "--model-control explicit needs --admin-api-key (or VISION_SERVE_ADMIN_API_KEY): the load and unload "
            "calls change what the server serves, and are never open without a key of their own.",
            "Set VISION_SERVE_ADMIN_API_KEY (flags show in ps), or leave --model-control out.",
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
