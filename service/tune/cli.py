"""`vision-tune`: find the fastest vision-serve configuration that meets a p99 target, and write it."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import Field, fields

from compile._defaults import CALIBRATION_METHODS, LOG_LEVELS
from compile.cli_flags import SHARED_HELP, add_settings_flags, parse_settings
from compile.settings_errors import exit_on_settings_error, usage_exit
from service.tune import _defaults
from service.tune.settings import TuneSettings

EXIT_NO_ANSWER = 1
EXIT_INTERRUPTED = 130  # as a shell reports a command stopped by Ctrl-C
# What vision-tune needs beyond the server: psutil (server memory) and matplotlib (the plot).
TUNE_EXTRA_MODULES = ("psutil", "matplotlib")

_HELP = {
    **SHARED_HELP,
    "p99_ms": "the latency target: the p99 in milliseconds the tuned configuration must meet (required)",
    "objective": "throughput: most images/s with p99 within the target; latency: lowest p99 at --rate",
    "rate": "--objective latency: the Poisson load, requests/s; 0: the rate the defaults sustain within the target",
    "budget_min": "stop searching after this many minutes (the confirm rounds included) and answer with the best "
    "found; 0: no limit",
    "search": f"quick: coordinate descent from the defaults (at most {_defaults.QUICK_MAX_SHARE:.0%} of "
    "it); full: every configuration".replace("%", "%%"),
    "images": "a folder of images to send (cycled); default: the project's benchmark photos",
    "output": "the tuned config file (vision-serve --config FILE); the report (.md), plot (.png) and every "
    "measurement (.csv) go beside it",
    "work": "folder for artifacts, server logs and the journal a stopped tune resumes from; default: "
    "OUTPUT with .work instead of .toml",
    "artifacts": "folder for the compiled engines (compile-trt's cache: shared by tunes that point at it); "
    "default: WORK/artifacts",
    "device": "auto (every GPU if there is one, else the CPU), cpu, cuda or cuda:N",
    "engines": "engines to try, BACKEND-PRECISION, e.g. onnx-fp32,inductor-bf16; default: the machine's grid "
    "(docs/tuning.md)",
    "max_batch_sizes": "values of --max-batch-size to try, e.g. 1,4,8,32",
    "batch_timeouts_ms": "values of --batch-timeout-ms to try, e.g. 0,10",
    "workers_per_device": "values of --workers-per-device to try, e.g. 0,1,2 (0: the server's own choice)",
    "api_servers": "values of --api-servers to try (0: automatic), e.g. 0,2,4",
    "pipeline_depths": "values of --pipeline-depth to try (0: automatic), e.g. 1,2",
    "preprocess": "preprocessing backends to try, e.g. pil,dali (torch, cvcuda, dali on a GPU)",
    "devices": "values of --device to try on a GPU machine, e.g. cuda:0,cuda (one GPU, or all)",
    "step_seconds": "seconds of load at each concurrency of the closed loop",
    "min_requests": "fewest requests at each concurrency and in the Poisson run",
    "poisson_seconds": "seconds of Poisson arrivals at the concurrency chosen",
    "load_factor": "the Poisson rate as a share of the closed-loop throughput chosen",
    "max_concurrency": "highest closed-loop concurrency; 0: twice what the workers batch at once",
    "client_processes": "load generator processes; 0: 1 on a CPU, 4 on a GPU",
    "confirm_rounds": "rounds of the defaults vs the tuned configuration, alternating, after the search",
    "max_memory_mib": "a configuration must use at most this much memory (GPU memory on a GPU, the server's "
    "PSS on a CPU); 0: no limit",
    "gate_images": "folder of images for compile-trt's accuracy gate, also --eval (default: its sample photos)",
    "calibration": "folder of images like the served ones to calibrate int8/fp8 engines on (compile-trt "
    "--calibration); without --engines it adds the machine's int8 engines to the grid (docs/tuning.md)",
    "calibration_count": "int8/fp8: how many calibration images compile-trt uses (a seeded sample of the folder)",
    "calibration_method": "int8/fp8: how compile-trt reads the activation ranges (auto: each engine's measured best)",
    "gate_min_top1_agreement": "compile-trt's gate: minimum top-1 agreement with eager fp32",
    "gate_min_top5_overlap": "compile-trt's gate: minimum top-5 overlap",
    "gate_min_cosine": "compile-trt's gate: minimum cosine similarity of the logits",
    "gate_max_rel_error": "compile-trt's gate: maximum relative logit error",
    "gate_min_top5_agreement": "compile-trt's gate: minimum share of inputs whose fp32 top-1 is in the top-5",
    "gate_max_prob_drop": "compile-trt's gate: maximum mean drop of the fp32 top-1 class's probability",
    "restart": "discard what an earlier run of this tune measured (the compiled engines are kept)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vision-tune",
        description="Find the fastest vision-serve configuration (engine, precision, batching, workers, ...) "
        "whose p99 meets a target, measured on real servers, and write it as a config file.",
        epilog="Example: vision-tune --model efficientnet-lite0 --p99-ms 100 --output tuned.toml; then "
        "vision-serve --config tuned.toml. Ctrl-C stops it; the same command resumes it.",
    )
    options = {
        "objective": {"choices": _defaults.OBJECTIVES},
        "search": {"choices": _defaults.SEARCHES},
        "log_level": {"choices": LOG_LEVELS},
        "calibration_method": {"choices": CALIBRATION_METHODS},
        "restart": {"action": "store_true", "default": False},
        **{name: {"type": float, "metavar": "X"} for name in _gate_flags()},
    }
    add_settings_flags(parser, TuneSettings, _help_of, options)
    # compile-trt's other name for the gate's images, taken here too.
    parser.add_argument("--eval", dest="gate_images", metavar="DIR", default=None, help="the same as --gate-images")
    return parser


def _gate_flags() -> list[str]:
    return [f.name for f in fields(TuneSettings) if f.name.startswith("gate_m")]


def _help_of(f: Field) -> str:
    text = _HELP.get(f.name, f.name.replace("_", " "))
    if f.default in ("", 0, 0.0, None, False) or f.name in ("p99_ms",):
        return text
    return f"{text} (default: {f.default})"


def settings_from_args(args: argparse.Namespace) -> TuneSettings:
    values = {k: v for k, v in vars(args).items() if v is not None}
    if not values.get("restart"):
        values.pop("restart", None)
    return TuneSettings(**values)


def missing_extras() -> list[str]:
    return [name for name in TUNE_EXTRA_MODULES if importlib.util.find_spec(name) is None]


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM unwind the same way: every server is stopped on the way out, and the journal is
    kept. SIGINT too, since a shell starts a background job with it ignored (``vision-tune ... &``)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.default_int_handler(signum, frame))


@exit_on_settings_error("vision-tune")
def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    _, settings = parse_settings(parser, argv, settings_from_args)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    missing = missing_extras()
    if missing:
        usage_exit(parser.prog, f"vision-tune needs {', '.join(missing)}: pip install 'vision-serve[tune]'")
    _stop_on_signals()
    # torch and the load generator after the argument checks, so that --help and usage errors are fast.
    from service.tune.report import ratios_text
    from service.tune.tuner import TuneFailed, Tuner

    try:
        outcome = Tuner(settings).run()
    except KeyboardInterrupt:
        print(
            f"\nvision-tune: stopped; every server it started is stopped. What was measured is kept in "
            f"{settings.work_dir}: run the same command again to resume.",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except TuneFailed as exc:
        print(f"vision-tune: {exc}", file=sys.stderr)
        return EXIT_NO_ANSWER
    record = outcome.record
    print(f"Tuned: {record.tuned.key} -> {outcome.toml}")
    ratios = record.ratios()
    if ratios:
        print(
            f"vs the defaults ({record.default.key}): {ratios_text(ratios)} (medians of {len(record.confirm)} "
            "alternating rounds)"
        )
    print(f"Report: {outcome.report} (plot {outcome.plot.name}, every measurement {outcome.csv.name})")
    print(f"Serve it: vision-serve --config {outcome.toml}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
