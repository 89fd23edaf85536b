"""`compile-trt`: compile a catalog model into a served artifact (engine file + manifest.json)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import Field, fields

from compile import _defaults
from compile.cli_flags import SHARED_HELP, add_settings_flags, parse_settings
from compile.settings import CompileSettings, parse_batch
from compile.settings_errors import SettingsError, exit_on_settings_error
from preprocessing.spec import SUPPORTED_INTERPOLATIONS

logger = logging.getLogger("compile.cli")

EXIT_GATE_FAILED = 3
EXIT_UNAVAILABLE = 4

_HELP = {
    **SHARED_HELP,
    "backend": "auto (a fixed rule from our measurements: tensorrt on a GPU, onnx on a CPU at fp32, else "
    "inductor; docs/compiling.md#which-engine), "
    "tensorrt, inductor (torch.export + AOTInductor), onnx (torch.onnx.export, run by ONNX Runtime) or eager",
    "precision": "fp32, fp16, bf16 (uses the AVX-512 bf16 units on CPU), int8 (calibrated on --calibration; "
    "onnx, inductor or tensorrt) or fp8 (tensorrt on compute capability 8.9+)",
    "calibration": "int8/fp8: folder of images like the served ones (subfolders too) to calibrate the "
    "activation ranges on; not the --eval images",
    "calibration_count": "int8/fp8: how many calibration images to use (a seeded sample of the folder)",
    "calibration_method": "int8/fp8: how ranges are read: auto (the engine's measured best, docs/compiling.md#int8), "
    "minmax, entropy, percentile (onnx, tensorrt) or histogram (inductor)",
    "batch": "MIN,OPT,MAX batch sizes the engine accepts (OPT: what TensorRT tunes for); one number: static",
    "device": "auto, cpu, cuda or cuda:N",
    "output": "artifact directory (default: artifacts/<model>-<backend>-<precision>-<device type>)",
    "workspace_gib": "TensorRT builder workspace in GiB",
    "optimization_level": "TensorRT builder optimization level, 0..5",
    "gate_images": "folder of images for the accuracy gate, also --eval (default: scikit-image's sample photos; "
    "for int8/fp8, those and 15 augmentations of each)",
    "gate_min_top1_agreement": "override the gate's minimum top-1 agreement (0..1)",
    "gate_min_top5_overlap": "override the gate's minimum top-5 overlap (0..1)",
    "gate_min_cosine": "override the gate's minimum cosine similarity of logits (0..1)",
    "gate_max_rel_error": "override the gate's maximum relative logit error",
    "gate_min_top5_agreement": "override the gate's minimum share of inputs whose fp32 top-1 is in the top-5 (0..1)",
    "gate_max_prob_drop": "override the gate's maximum mean drop of the fp32 top-1 class's probability (0..1)",
    "force": "recompile even if --output already holds this exact engine",
    "triton_repository": "also write a Triton model repository into this folder (--backend onnx): the ONNX "
    "model, a DALI preprocessing model and an ensemble taking JPEG bytes",
}
# What a failed quantized engine's user can change, in the order worth trying.
QUANTIZED_GATE_ADVICE = (
    "A quantized engine that fails its gate was calibrated on images unlike the evaluated ones, or on too few: "
    "calibrate on a few hundred images like the served ones (--calibration, --calibration-count), try another "
    "--calibration-method, or serve fp32/bf16. Thresholds: --gate-min-top1-agreement, --gate-max-prob-drop."
)
# The gate's threshold overrides: a number each, whose default depends on --precision.
GATE_OVERRIDES = tuple(f.name for f in fields(CompileSettings) if f.name.startswith("gate_m"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compile-trt",
        description="Compile an image classifier into an engine artifact that `vision-serve --artifact DIR` serves.",
        epilog="Gate thresholds per precision: " + "; ".join(f"{p}: {t}" for p, t in _defaults.GATE_THRESHOLDS.items()),
    )
    options = {
        "force": {"action": "store_true", "default": False},
        "batch": {"type": parse_batch_arg, "metavar": "MIN,OPT,MAX"},
        "backend": {"choices": _defaults.BACKENDS},
        "precision": {"choices": _defaults.PRECISIONS},
        "log_level": {"choices": _defaults.LOG_LEVELS},
        "log_format": {"choices": _defaults.LOG_FORMATS},
        "interpolation": {"choices": SUPPORTED_INTERPOLATIONS},
        "calibration_method": {"choices": _defaults.CALIBRATION_METHODS},
        **{name: {"type": float, "metavar": "X"} for name in GATE_OVERRIDES},
    }
    add_settings_flags(parser, CompileSettings, _help_of, options)
    # The name quantization guides use for the gate's images: the same setting.
    parser.add_argument("--eval", dest="gate_images", metavar="DIR", default=None, help="the same as --gate-images")
    return parser


def _help_of(f: Field) -> str:
    if f.name == "force":
        return _HELP[f.name]
    default = f.default
    if f.name == "batch":
        default = ",".join(map(str, default))
    elif f.name in GATE_OVERRIDES:
        default = "per precision"
    elif default == "" or (type(default) is int and default == 0):  # not given: the help says what then
        return _HELP[f.name]
    return f"{_HELP[f.name]} (default: {default})"


def parse_batch_arg(text: str) -> tuple[int, int, int]:
    try:
        return parse_batch(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def settings_from_args(args: argparse.Namespace) -> CompileSettings:
    values = {k: v for k, v in vars(args).items() if v is not None}
    if not values.get("force"):
        values.pop("force", None)
    return CompileSettings(**values)


@exit_on_settings_error("compile-trt")
def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    _, settings = parse_settings(parser, argv, settings_from_args)
    say = configure_output(settings.log_level, settings.log_format)
    # Heavy imports (torch, torchvision) after argument checks, so --help and usage errors are fast.
    from compile.backends import BackendUnavailable
    from compile.build import GateFailed, compile_artifact
    from compile.progress import Progress
    from compile.torch_logging import adopt_torch_logger
    from compile.weights import WeightsError

    adopt_torch_logger()

    try:
        result = compile_artifact(settings, Progress())
    except GateFailed as exc:
        advice = f"\n{QUANTIZED_GATE_ADVICE}" if settings.quantized else ""
        say(f"compile-trt: accuracy gate FAILED, no artifact written:\n{exc.report.summary()}{advice}", logging.ERROR)
        return EXIT_GATE_FAILED
    except BackendUnavailable as exc:
        say(f"compile-trt: {exc}", logging.ERROR)
        return EXIT_UNAVAILABLE
    except WeightsError as exc:  # the weights --weights names: the message says what to use instead
        raise SettingsError("--weights", settings.weights, str(exc), "") from None
    except ValueError as exc:  # a setting, or the labels, model file or images one names: what to change
        raise SettingsError.of(exc) from None
    manifest = result.manifest
    state = "up to date (cache hit)" if result.cached else f"compiled in {manifest.compile_seconds:.1f} s"
    say(f"{result.directory}: {manifest.model} {manifest.engine_name} on {manifest.device_type}, {state}")
    say(f"accuracy gate passed:\n{_summary(manifest.validation)}")
    say(f"serve it: vision-serve --artifact {result.directory}")
    if result.triton_repository is not None:
        say(f"Triton model repository: {result.triton_repository} (tritonserver --model-repository ...)")
    return 0


def configure_output(level: str, log_format: str) -> Callable[..., None]:
    """Log records to stderr in ``log_format``; returns how the outcome is told: printed for a terminal
    (errors to stderr), or, in JSON, as log records, so that a container's log stays one JSON stream."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        from compile.json_logs import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)

    def say(text: str, level: int = logging.INFO) -> None:
        if log_format == "json":
            logger.log(level, text)
        else:
            print(text, file=sys.stderr if level >= logging.ERROR else sys.stdout)

    return say


def entry(argv: Sequence[str] | None = None) -> int:
    """The ``compile-trt`` command: ``main``, in a process that preloads the C++ compiler's libstdc++
    when it compiles for a GPU (its accuracy gate loads the package here; see compile/libstdcxx.py)."""
    from compile.libstdcxx import restart_with_preload

    known, _ = build_parser().parse_known_args(argv)
    if argv is None:  # the command line: restart it as it was started (a call with argv cannot be)
        restart_with_preload(known.device or "auto")
    return main(argv)


def _summary(validation: dict) -> str:
    from compile.gate import photo_lines

    lines = [f"  {name:<22} {value:.6g}" for name, value in validation.get("metrics", {}).items()]
    lines += photo_lines(validation.get("real_images", []))
    return "\n".join(lines) or json.dumps(validation)


if __name__ == "__main__":
    sys.exit(entry())
