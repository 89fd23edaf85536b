"""The artifact manifest: everything the server needs to know about an engine, in one JSON file.

An artifact is a directory holding the engine file and ``manifest.json``. The server reads the
preprocessing, labels, batch range and device from the manifest, never from its own flags.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from compile import _defaults
from preprocessing.spec import PreprocessSpec


class ManifestError(ValueError):
    """The artifact directory or its manifest is missing, unreadable or from another format."""


@dataclass(frozen=True)
class Manifest:
    format_version: int
    model: str
    model_family: str
    weights_source: str  # "imagenet:...", "file:/path", "random(seed=0)"
    weights_sha256: str
    weights_sha256_of: str  # "file" (the weights file as downloaded/given) or "state_dict" (random weights)
    preprocess: PreprocessSpec
    labels_source: str
    labels: tuple[str, ...]
    backend: str  # "inductor", "tensorrt", "onnx" or "eager"
    precision: str
    batch_min: int
    batch_opt: int
    batch_max: int
    device_type: str  # "cpu" or "cuda"
    device_name: str
    device_capability: str  # torch's CPU capability (AVX512) or the GPU's sm_XY
    device_isa: str  # CPU: the instruction sets compiled code may use (devices.cpu_isa); GPU: ""
    engine_file: str  # relative to the artifact directory
    engine_sha256: str
    versions: dict[str, str]
    compiled_at: str  # ISO 8601, UTC
    compile_seconds: float
    compile_settings: dict[str, Any]
    validation: dict[str, Any]
    cache_key: str
    # The backend's own options that shaped the engine, as hashed into cache_key (ONNX Runtime's
    # execution providers and session options, TensorRT's builder settings). Added in place: a
    # manifest written before it reads as {}.
    backend_config: dict[str, Any] = field(default_factory=dict)
    # The served name (--name); ``model`` is what --model said (a catalog name, timm:<name>, a file).
    # Added in place: a manifest written before it serves under its model's name.
    name: str = ""
    # A quantized engine (int8, fp8): its calibration set (folder, count, sha256, method) and the
    # evaluation set its gate ran on. Added in place: {} for other precisions and older manifests.
    quantization: dict[str, Any] = field(default_factory=dict)
    # What turns the engine's logits into scores (softmax, sigmoid, none: compile/_defaults.py), the
    # model's own. Added in place: a manifest written before it reads as softmax.
    activation: str = _defaults.MODEL_ACTIVATION

    @property
    def served_name(self) -> str:
        return self.name or self.model

    @property
    def engine_name(self) -> str:
        """What responses report in their ``engine`` field, e.g. ``inductor-bf16``, ``onnxruntime-fp32``."""
        return f"{_defaults.ENGINE_RUNTIME_NAMES.get(self.backend, self.backend)}-{self.precision}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["preprocess"] = self.preprocess.to_dict()
        data["labels"] = list(self.labels)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        version = data.get("format_version")
        if version != _defaults.MANIFEST_FORMAT_VERSION:
            raise ManifestError(
                f"Manifest format_version {version!r} is not {_defaults.MANIFEST_FORMAT_VERSION}, the one this "
                "vision-serve reads. Recompile the artifact with this version's compile-trt."
            )
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = sorted(required - data.keys())
        if missing:
            raise ManifestError(f"Manifest lacks {', '.join(missing)}. Recompile the artifact with compile-trt.")
        values = {name: data[name] for name in names if name in data}
        values["preprocess"] = read_preprocess(values["preprocess"])
        labels = values["labels"]
        if not isinstance(labels, list) or not all(isinstance(label, str) for label in labels):
            raise ManifestError("Manifest has an invalid labels entry (not a list of names). Recompile it.")
        values["labels"] = tuple(labels)
        if values.get("activation", _defaults.MODEL_ACTIVATION) not in _defaults.ACTIVATIONS:
            raise ManifestError(
                f"Manifest activation {values['activation']!r} is not one of {', '.join(_defaults.ACTIVATIONS)}."
            )
        engine_file = values["engine_file"]
        if not isinstance(engine_file, str) or Path(engine_file).name != engine_file or engine_file in ("", ".", ".."):
            raise ManifestError(f"Manifest engine_file {engine_file!r} must be a file name inside the artifact.")
        return cls(**values)


def read_preprocess(entry: object) -> PreprocessSpec:
    """The manifest's ``preprocess``: every field of PreprocessSpec.to_dict, or the five a manifest written
    before the others existed holds (resize_size, crop_size, mean, std, interpolation), which keep their
    meaning (a shorter-side resize and a square crop). Anything else is from another format."""
    try:
        if not isinstance(entry, dict):
            raise TypeError(f"a JSON {type(entry).__name__}, not an object")
        return PreprocessSpec.from_dict(entry)
    except (TypeError, ValueError) as exc:
        raise ManifestError(
            f"Manifest has an invalid preprocess entry ({exc}). Recompile the artifact with this version's compile-trt."
        ) from None


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    path = directory / _defaults.MANIFEST_FILE
    path.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    return path


def read_manifest(directory: str | Path) -> Manifest:
    directory = Path(directory).expanduser()
    path = directory / _defaults.MANIFEST_FILE
    if not path.is_file():
        hint = " (the directory does not exist)" if not directory.exists() else ""
        raise ManifestError(
            f"{path} not found{hint}. --artifact takes a directory written by compile-trt, e.g. "
            "`compile-trt --model resnet152 --output artifacts/resnet152`."
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ManifestError(f"Could not read {path} as JSON ({exc}). Recompile the artifact.") from exc
    if not isinstance(data, dict):
        raise ManifestError(f"{path} holds a JSON {type(data).__name__}, not an object. Recompile the artifact.")
    try:
        return Manifest.from_dict(data)
    except ManifestError as exc:
        raise ManifestError(f"{path}: {exc}") from None


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def cache_key(parts: dict[str, Any]) -> str:
    """A stable hash of everything that makes one engine differ from another."""
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]
