"""`vision-serve`: serve an image classifier over HTTP (POST /predict)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import Field
from pathlib import Path

from compile.cli_flags import SHARED_HELP, add_settings_flags, parse_settings
from compile.settings_errors import SettingsError, exit_on_settings_error
from service.logs import LOG_FORMATS, adopt_library_loggers, configure_logging
from service.settings import (
    CONFIG_ENV,
    LOG_LEVELS,
    ResolvedSettings,
    ServeSettings,
    env_var,
    render_config,
    resolve_settings,
)
from service.supervisor.planning.plans import render_chosen

# Flags of the command itself, not settings.
COMMAND_FLAGS = ("config", "print_config")

_HELP = {
    "artifact": "a compile-trt artifact directory to serve; its manifest sets the model, weights, "
    "preprocessing and labels",
    **SHARED_HELP,
    "device": "auto, cpu, cuda (every GPU) or cuda:N",
    "preprocess": "preprocessing backend: auto (first usable of torch, cvcuda, dali on a GPU; pil on a CPU), "
    "dali, cvcuda, torch or pil",
    "activation": "what turns the model's logits into the scores answered: auto (the model's own: sigmoid for a "
    "multi-label transformers folder, else softmax), softmax, sigmoid or none (the raw logits)",
    "max_batch_size": "largest batch the model sees (1 turns batching off)",
    "batch_timeout_ms": "how long the first request of a batch waits for more",
    "workers_per_device": "inference worker processes per device; 0: chosen from the engine and the machine "
    "(--print-config shows the choice and why)",
    "engine_threads": "threads of each worker's engine (torch, ONNX Runtime) on a CPU; 0: the usable cores "
    "shared among the workers",
    "pipeline_depth": "batches in flight per worker: 1 runs each batch start to end, 2 prepares the next while "
    "one runs; 0: 2 on a GPU, 1 on a CPU",
    "api_servers": "HTTP processes that parse requests and answer them; 0: one per inference worker on a CPU, "
    "more on a GPU (up to a quarter of the cores)",
    "host": "address to listen on: 127.0.0.1, 0.0.0.0 or ::",
    "port": "TCP port (HTTP: /predict, the OIP v2 routes, probes, metrics)",
    "grpc_port": "TCP port for the Open Inference Protocol over gRPC (KServe v2, Triton's GRPCInferenceService); "
    "0: no gRPC",
    "log_format": "text (for a terminal) or json (one object per line with the request id, for log pipelines)",
    "max_body_bytes": "largest request body accepted; larger ones get 413",
    "max_image_pixels": "largest image (width x height, read from its header before decoding) accepted; "
    "larger ones get 413",
    "max_images_per_request": "most images one request may carry (several image fields, a JSON images list, "
    "an OIP batch); more get 413",
    "max_queue": "most images queued or being processed at once; more get 503 with Retry-After",
    "request_timeout_s": "deadline from admission to answer, queue and inference included; later answers are 504",
    "worker_heartbeat_timeout_s": "seconds a serving inference worker may go without a heartbeat (stopped, or "
    "frozen); then it is marked unresponsive and its requests get 503, and at twice that it is killed and "
    "restarted; 0: off",
    "batch_hang_timeout_s": "seconds one batch may run while its worker still beats (a hung engine); then the "
    "worker is killed and restarted; 0: 4 x --request-timeout-s",
    "max_header_bytes": "largest request headers accepted (all header lines together); larger ones get 431",
    "header_timeout_s": "seconds a request's headers may take to arrive, from the connection's opening or the "
    "request's first byte; slower ones get 408 and the connection closes",
    "body_timeout_s": "seconds a request's body may take to arrive after its headers; slower ones get 408",
    "keep_alive_timeout_s": "seconds an idle kept-alive connection stays open between requests",
    "model_repository": "a model repository: DIR/<name>/<version>/ compile-trt artifacts, with an optional "
    "DIR/<name>/config.toml each (docs/model-repository.md); serves every model there",
    "model_control": "none (serve what the repository holds at start) or explicit (also Triton's repository "
    "API: POST /v2/repository/index, /v2/repository/models/NAME/load and /unload)",
    "default_model": "the model /predict classifies with when the request names none (?model=NAME); default: "
    "the only model",
    "worker_isolation": "shared: each worker process (one per device and --workers-per-device) holds the engines "
    "of every model it serves, so a model costs its engine, not a process; process: every model version gets "
    "worker processes of its own (config.toml's isolation sets it per model)",
    "memory_budget_mib": "MiB the resident models may take; with --model-control none a repository may hold "
    "more models than fit: one not resident loads on its first request and the least recently used idle one "
    "is evicted; 0: from the machine's memory at start",
    "load_timeout_s": "longest a model load may take until its workers are warm; then it fails and the old "
    "version keeps serving",
    "response_cache_mb": "MiB of answers each HTTP process keeps, keyed on the image's bytes, model version and "
    "top-k; a repeated image is answered before any decode (X-Cache: hit); 0: no cache",
    "response_cache_redis": "a Redis shared by several replicas behind the per-process cache: "
    "redis://[:password@]host:port/db; a slow or dead Redis counts as a miss",
    "response_cache_redis_timeout_ms": "longest wait for Redis on a lookup; slower is a miss, and Redis is "
    "then skipped for a few seconds",
    "response_cache_redis_ttl_s": "seconds an answer stays in Redis",
    "trace_sample_rate": "share of requests traced with OpenTelemetry (0: off; a client's traceparent decides "
    "for its own request)",
    "otlp_endpoint": "OTLP/gRPC collector for the traces, e.g. http://127.0.0.1:4317",
    "admin_api_key": "key of the repository API (X-API-Key or Authorization: Bearer); required with "
    "--model-control explicit, and different from --api-key",
    "api_key": "key clients must send as X-API-Key or Authorization: Bearer to /predict and /info; prefer "
    "the env variable, since flags show in ps",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vision-serve",
        description="Serve an image classifier: POST an image to /predict, get its top-k labels.",
        epilog="Every setting can also be set with an environment variable (e.g. VISION_SERVE_PORT=9000) or a "
        "key of a TOML --config file (e.g. port = 9000). Flags win over env vars, which win over the file.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML file of settings, keys as the flags without dashes (max_batch_size = 8) (env {CONFIG_ENV})",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective settings, where each comes from, as a config file; then exit",
    )
    options = {"log_level": {"choices": LOG_LEVELS}, "log_format": {"choices": LOG_FORMATS}}
    add_settings_flags(parser, ServeSettings, _help_of, options)
    return parser


def _help_of(f: Field) -> str:
    default = f.default if f.default != "" else "none"
    if isinstance(f.default, int) and f.default >= 10_000:
        default = f"{f.default:_}"
    return f"{_HELP[f.name]} (default: {default}; env {env_var(f.name)})"


def resolve_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ResolvedSettings:
    """Flags win over VISION_SERVE_* variables, which win over the config file, then the defaults."""
    flags = {k: v for k, v in vars(args).items() if k not in COMMAND_FLAGS}
    return resolve_settings(flags, environ, getattr(args, "config", None))


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServeSettings:
    return resolve_from_args(args, environ).settings


@exit_on_settings_error("vision-serve")
def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, resolved = parse_settings(parser, argv, resolve_from_args)
    settings = resolved.settings
    configure_logging(settings.log_level, settings.log_format)
    if args.print_config:
        return print_config(resolved)
    check_weights_file(settings)
    from service.supervisor.planning.launch import start_planning

    planning = start_planning(settings)  # a child process with torch; meanwhile this one imports its web stack
    from service.supervisor.server import build_server, serve

    adopt_library_loggers()  # importing litserve gave its logger a handler of its own
    plans = planning.result()
    names = {plan.name for plan in plans}
    if settings.default_model and settings.default_model not in names:
        raise SettingsError(
            "--default-model",
            settings.default_model,
            f"--default-model {settings.default_model}: no such model in the repository (models: "
            f"{', '.join(sorted(names)) or 'none'}).",
            "Name one of those, or leave --default-model out.",
        )
    # A repository server keeps its own settings (loads plan from them); a one-model server
    # serves its plan's, with what the artifact and the machine decided.
    server = build_server(plans, settings if settings.model_repository else None)
    artifacts = [plan.serve_plan.settings for plan in plans if plan.serve_plan.settings.artifact]
    if artifacts:  # AOTInductor CUDA packages need it in the workers that load them
        from compile.libstdcxx import preload_for_children

        preload_for_children(artifacts[0].device)
    return serve(server)


def check_weights_file(settings: ServeSettings) -> None:
    """A --weights path must be a file, said before the planner starts (the workers would fail later)."""
    weights = settings.weights
    if not settings.artifact and weights not in ("imagenet", "random") and not Path(weights).expanduser().is_file():
        raise SettingsError(
            "--weights",
            weights,
            f"--weights {weights!r}: no such file.",
            "Use imagenet, random, or a state_dict file path.",
        )


def print_config(resolved: ResolvedSettings) -> int:
    """The effective settings as a config file, then what the server would choose for the values left
    at 0 (auto) on this machine, and why: planned as a start would plan them."""
    from service.supervisor.planning.launch import start_planning

    sys.stdout.write(render_config(resolved))
    sys.stdout.flush()
    try:
        plans = start_planning(resolved.settings).result()
    except SettingsError as exc:
        raise exc.with_message(f"these settings would not start a server: {exc.message}") from None
    sys.stdout.write(render_chosen(plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
