"""The compile stage and what it stands on, a module each:

- the model catalog (catalog.py) and the models' weights (weights.py);
- compile-trt: its flags and settings (cli.py, cli_flags.py, settings.py; settings_errors.py, the
  refusal of a setting that all three commands share), its stages (build.py, progress.py), the
  engine builders (backends/, libstdcxx.py) over what every engine is (engine.py) and its
  batch-dynamic export (batch_export.py), the quantizers (quantization/), the accuracy gate (gate.py,
  on the photos of sample_photos.py);
- where loaded engines are unpacked (unpacking.py);
- the artifact: its manifest (manifest.py) and whether this machine can serve it (compat.py), judged
  by the device (devices.py) and the library versions (versions.py).

The names below are the public API, what code outside the product (benchmarks/) imports: a module of
this package may move or split, these names stay. They load on first use (PEP 562): ``import compile``
and the torch-free modules (``compile._defaults``, ``compile.manifest``) stay torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    # the model catalog and the models' weights
    "ModelEntry": "compile.catalog",
    "get_model_entry": "compile.catalog",
    "ModelRequest": "compile.model_request",
    "load_model": "compile.weights",
    # compile-trt: settings, engine builders, the accuracy gate and its exit code
    "CompileSettings": "compile.settings",
    "EXIT_GATE_FAILED": "compile.cli",
    "PRECISION_DTYPES": "compile.engine",
    "BackendUnavailable": "compile.engine",
    "PrecisionCast": "compile.engine",
    "get_backend": "compile.backends",
    "restart_with_preload": "compile.libstdcxx",
    "compare_logits": "compile.gate",
    "threshold_failures": "compile.gate",
    # the gate's photos
    "CAT_LABELS": "compile.sample_photos",
    "SAMPLE_PHOTO_JPEG_QUALITY": "compile._defaults",
    "sample_photo": "compile.sample_photos",
    "sample_photo_file": "compile.sample_photos",
    "write_sample_calibration_set": "compile.sample_photos",
    # the artifact and the machine
    "MANIFEST_FILE": "compile._defaults",
    "read_manifest": "compile.manifest",
    "cpu_flags": "compile.devices",
    "cpu_name": "compile.devices",
}
__all__ = [
    "CAT_LABELS",
    "EXIT_GATE_FAILED",
    "MANIFEST_FILE",
    "PRECISION_DTYPES",
    "SAMPLE_PHOTO_JPEG_QUALITY",
    "BackendUnavailable",
    "CompileSettings",
    "ModelEntry",
    "ModelRequest",
    "PrecisionCast",
    "compare_logits",
    "cpu_flags",
    "cpu_name",
    "get_backend",
    "get_model_entry",
    "load_model",
    "read_manifest",
    "restart_with_preload",
    "sample_photo",
    "sample_photo_file",
    "threshold_failures",
    "write_sample_calibration_set",
]

if TYPE_CHECKING:
    from compile._defaults import MANIFEST_FILE, SAMPLE_PHOTO_JPEG_QUALITY
    from compile.backends import get_backend
    from compile.catalog import ModelEntry, get_model_entry
    from compile.cli import EXIT_GATE_FAILED
    from compile.devices import cpu_flags, cpu_name
    from compile.engine import PRECISION_DTYPES, BackendUnavailable, PrecisionCast
    from compile.gate import compare_logits, threshold_failures
    from compile.libstdcxx import restart_with_preload
    from compile.manifest import read_manifest
    from compile.model_request import ModelRequest
    from compile.sample_photos import CAT_LABELS, sample_photo, sample_photo_file, write_sample_calibration_set
    from compile.settings import CompileSettings
    from compile.weights import load_model


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'compile' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
