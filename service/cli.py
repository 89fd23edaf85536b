"""`vision-serve`: serve an image classifier over HTTP (POST /predict)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path

from service.settings import LOG_LEVELS, ServeSettings, env_overrides, env_var

_HELP = {
    "artifact": "a compile-trt artifact directory to serve; its manifest sets the model, weights, "
    "preprocessing and labels",
    "model": "model name: resnet152, efficientnet-lite0, or any torchvision classifier",
    "weights": "imagenet (torchvision download + cache), a state_dict file PATH, or random (seeded)",
    "device": "auto, cpu, cuda (every GPU) or cuda:N",
    "preprocess": "preprocessing backend: auto (first usable of dali, cvcuda, torch on a GPU; pil on a CPU), "
    "dali, cvcuda, torch or pil",
    "max_batch_size": "largest batch the model sees (1 turns batching off)",
    "batch_timeout_ms": "how long the first request of a batch waits for more",
    "workers_per_device": "inference worker processes per device",
    "host": "address to listen on: 127.0.0.1, 0.0.0.0 or ::",
    "port": "TCP port",
    "log_level": "logging level",
    "max_body_bytes": "largest request body accepted; larger ones get 413",
    "max_image_pixels": "largest image (width x height, read from its header before decoding) accepted; "
    "larger ones get 413",
    "max_queue": "most requests queued or being processed at once; more get 503 with Retry-After",
    "request_timeout_s": "deadline from admission to answer, queue and inference included; later answers are 504",
    "api_key": "key clients must send as X-API-Key or Authorization: Bearer to /predict and /info; prefer "
    "the env variable, since flags show in ps",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vision-serve",
        description="Serve an image classifier: POST an image to /predict, get its top-k labels.",
        epilog="Every flag can also be set with an environment variable, e.g. VISION_SERVE_PORT=9000.",
    )
    for f in fields(ServeSettings):
        flag = "--" + f.name.replace("_", "-")
        kwargs = {"type": type(f.default), "default": None, "metavar": f.name.upper()}
        if f.name == "log_level":
            kwargs = {"choices": LOG_LEVELS, "default": None}
        default = f.default if f.default != "" else "none"
        if isinstance(f.default, int) and f.default >= 10_000:
            default = f"{f.default:_}"
        parser.add_argument(flag, help=f"{_HELP[f.name]} (default: {default}; env {env_var(f.name)})", **kwargs)
    return parser


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServeSettings:
    """Flags win over VISION_SERVE_* variables, which win over the defaults."""
    values = env_overrides(environ)
    values.update({k: v for k, v in vars(args).items() if v is not None})
    return ServeSettings(**values)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    from service.server import build_server, serve  # imports torch and litserve; keep --help fast

    try:
        if (
            not settings.artifact
            and settings.weights not in ("imagenet", "random")
            and not Path(settings.weights).expanduser().is_file()
        ):
            raise ValueError(
                f"--weights {settings.weights!r}: no such file. Use imagenet, random, or a state_dict file path."
            )
        server = build_server(settings)
    except ValueError as exc:
        parser.error(str(exc))
    return serve(settings, server)


if __name__ == "__main__":
    sys.exit(main())
