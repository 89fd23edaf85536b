"""A Triton model repository from an onnx artifact: Triton loads it as it is, and takes JPEG bytes.

    <repository>/
      <model>/                 ensemble: IMAGE (encoded bytes, UINT8 [-1]) -> LOGITS [classes]
        config.pbtxt  labels.txt  1/
      <model>-preprocess/      DALI: decode, resize, center crop, normalize (our spec, computed in-graph)
        config.pbtxt  1/model.dali
      <model>-onnx/            onnxruntime: the artifact's model.onnx, byte for byte
        config.pbtxt  labels.txt  1/model.onnx

The ensemble has the name vision-serve's Open Inference Protocol endpoint gives the model, and the
same input (``IMAGE``, UINT8 ``[N, L]``: N encoded images, zero-padded to the longest), so the
same request body reaches either server. Its output is the logits (vision-serve's are labels and
probabilities); ask Triton for the top k with the classification extension (``class_count``),
which reads ``labels.txt``. Every config is parsed with Triton's own protobuf schema (the
``model_config_pb2`` module tritonclient ships) before it is written.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from compile import _defaults
from compile.manifest import Manifest
from compile.model_files import onnx_io_names
from compile.settings_errors import SettingsError
from preprocessing.dali_triton import TRITON_DALI_INPUT, TRITON_DALI_OUTPUT, build_triton_pipeline

logger = logging.getLogger(__name__)

# First line of every config we write: a folder that starts with it may be replaced by a new export.
MARKER = "# Written by vision-serve's compile-trt --triton-repository; regenerate it rather than edit it."
ENSEMBLE_INPUT = "IMAGE"
ENSEMBLE_OUTPUT = "LOGITS"
VERSION = "1"
DALI_THREADS = 4


DEFAULT_IO_NAMES = (_defaults.ONNX_INPUT_NAME, _defaults.ONNX_OUTPUT_NAME)


@dataclass(frozen=True)
class RepositoryModels:
    """The three model names of one export."""

    ensemble: str
    preprocess: str
    classifier: str

    @classmethod
    def for_model(cls, model: str) -> RepositoryModels:
        return cls(ensemble=model, preprocess=f"{model}-preprocess", classifier=f"{model}-onnx")


def check_exportable(manifest_backend: str, batch: tuple[int, int, int]) -> None:
    """``SettingsError`` saying how to fix it, if an artifact of ``manifest_backend`` and ``batch`` cannot be
    exported."""
    if manifest_backend != "onnx":
        raise SettingsError(
            "--backend",
            manifest_backend,
            f"--triton-repository exports the ONNX model (this compile is {manifest_backend}):",
            "use it with --backend onnx.",
        )
    low, _, high = batch
    if low != 1 or high < 2:
        raise SettingsError(
            "--batch",
            ",".join(map(str, batch)),
            f"--triton-repository needs --batch 1,OPT,MAX with MAX >= 2 (got {','.join(map(str, batch))}): Triton's "
            "dynamic batcher sends batches of every size from 1 up to max_batch_size.",
            "Compile with e.g. --batch 1,8,32.",
        )


def _kind(device_type: str) -> str:
    return "KIND_GPU" if device_type == "cuda" else "KIND_CPU"


def _dims(values: tuple[int, ...]) -> str:
    return "[ " + ", ".join(str(v) for v in values) + " ]"


def classifier_config(manifest: Manifest, names: RepositoryModels, io_names: tuple[str, str] = DEFAULT_IO_NAMES) -> str:
    height, width = manifest.preprocess.input_size
    return f"""{MARKER}
name: "{names.classifier}"
backend: "onnxruntime"
max_batch_size: {manifest.batch_max}
input [
  {{ name: "{io_names[0]}" data_type: TYPE_FP32 dims: {_dims((3, height, width))} }}
]
output [
  {{
    name: "{io_names[1]}"
    data_type: TYPE_FP32
    dims: {_dims((len(manifest.labels),))}
    label_filename: "{_defaults.TRITON_LABELS_FILE}"
  }}
]
instance_group [ {{ count: 1 kind: {_kind(manifest.device_type)} }} ]
dynamic_batching {{
  preferred_batch_size: {_dims(tuple(sorted({manifest.batch_opt, manifest.batch_max})))}
  max_queue_delay_microseconds: {_defaults.TRITON_MAX_QUEUE_DELAY_US}
}}
"""


def preprocess_config(manifest: Manifest, names: RepositoryModels) -> str:
    # allow_ragged_batch: encoded images differ in length, and without it Triton's dynamic batcher
    # only puts requests of one shape in a batch; DALI takes a batch of samples of any lengths.
    height, width = manifest.preprocess.input_size
    return f"""{MARKER}
name: "{names.preprocess}"
backend: "dali"
max_batch_size: {manifest.batch_max}
input [
  {{ name: "{TRITON_DALI_INPUT}" data_type: TYPE_UINT8 dims: [ -1 ] allow_ragged_batch: true }}
]
output [
  {{ name: "{TRITON_DALI_OUTPUT}" data_type: TYPE_FP32 dims: {_dims((3, height, width))} }}
]
instance_group [ {{ count: 1 kind: {_kind(manifest.device_type)} }} ]
dynamic_batching {{
  max_queue_delay_microseconds: {_defaults.TRITON_MAX_QUEUE_DELAY_US}
}}
"""


def ensemble_config(manifest: Manifest, names: RepositoryModels, io_names: tuple[str, str] = DEFAULT_IO_NAMES) -> str:
    return f"""{MARKER}
name: "{names.ensemble}"
platform: "ensemble"
max_batch_size: {manifest.batch_max}
input [
  {{ name: "{ENSEMBLE_INPUT}" data_type: TYPE_UINT8 dims: [ -1 ] }}
]
output [
  {{
    name: "{ENSEMBLE_OUTPUT}"
    data_type: TYPE_FP32
    dims: {_dims((len(manifest.labels),))}
    label_filename: "{_defaults.TRITON_LABELS_FILE}"
  }}
]
ensemble_scheduling {{
  step [
    {{
      model_name: "{names.preprocess}"
      model_version: -1
      input_map {{ key: "{TRITON_DALI_INPUT}" value: "{ENSEMBLE_INPUT}" }}
      output_map {{ key: "{TRITON_DALI_OUTPUT}" value: "preprocessed" }}
    }},
    {{
      model_name: "{names.classifier}"
      model_version: -1
      input_map {{ key: "{io_names[0]}" value: "preprocessed" }}
      output_map {{ key: "{io_names[1]}" value: "{ENSEMBLE_OUTPUT}" }}
    }}
  ]
}}
"""


def parse_model_config(text: str):
    """``text`` parsed into Triton's ``inference.ModelConfig`` message; ``ValueError`` if it does not parse."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise ValueError(f"not a valid Triton model configuration: {exc}") from None


def repository_configs(manifest: Manifest, io_names: tuple[str, str] = DEFAULT_IO_NAMES) -> dict[str, str]:
    """Model name -> its config.pbtxt, for the three models of ``manifest``'s export."""
    names = RepositoryModels.for_model(manifest.served_name)
    return {
        names.ensemble: ensemble_config(manifest, names, io_names),
        names.preprocess: preprocess_config(manifest, names),
        names.classifier: classifier_config(manifest, names, io_names),
    }


def check_replaceable(folder: Path) -> None:
    """Refuse to replace a model folder that this exporter did not write: it may be someone's model."""
    if not folder.exists():
        return
    config = folder / "config.pbtxt"
    try:
        ours = config.read_text().startswith(MARKER)
    except OSError:
        ours = False
    if not ours:
        raise SettingsError(
            "--triton-repository",
            str(folder.parent),
            f"{folder} exists and was not written by compile-trt --triton-repository (its config.pbtxt lacks our "
            "first line).",
            "Move it away or export into another repository.",
        )


def check_repository(repository: Path, model: str) -> None:
    """``SettingsError`` if exporting ``model`` into ``repository`` would replace a folder we did not write."""
    if repository.exists() and not repository.is_dir():
        raise SettingsError(
            "--triton-repository",
            str(repository),
            f"--triton-repository {repository} is a file.",
            "Give a directory (it is created).",
        )
    for name in RepositoryModels.for_model(model).__dict__.values():
        check_replaceable(repository / name)


def write_triton_repository(artifact: Path, manifest: Manifest, repository: Path) -> list[Path]:
    """Write the three models of ``manifest`` (the onnx artifact in ``artifact``) into ``repository``;
    returns the model folders. All three are built next to their final places first, then renamed
    into them, so a failure leaves the repository as it was."""
    check_exportable(manifest.backend, (manifest.batch_min, manifest.batch_opt, manifest.batch_max))
    names = RepositoryModels.for_model(manifest.served_name)
    configs = repository_configs(manifest, onnx_io_names(artifact / manifest.engine_file))
    for text in configs.values():
        parse_model_config(text)  # catches a malformed config here (syntax, field names), not at Triton's start
    check_repository(repository, manifest.served_name)
    repository.mkdir(parents=True, exist_ok=True)
    labels = "\n".join(manifest.labels) + "\n"
    staged = {name: repository / f".{name}.tmp-{os.getpid()}" for name in configs}
    try:
        for name, staging in staged.items():
            shutil.rmtree(staging, ignore_errors=True)
            (staging / VERSION).mkdir(parents=True)
            (staging / "config.pbtxt").write_text(configs[name])
            if name != names.preprocess:
                (staging / _defaults.TRITON_LABELS_FILE).write_text(labels)
            if name == names.classifier:
                shutil.copyfile(artifact / manifest.engine_file, staging / VERSION / "model.onnx")
            if name == names.preprocess:
                serialize_preprocessing(manifest, staging / VERSION / "model.dali")
        for name, staging in staged.items():
            final = repository / name
            if final.exists():
                shutil.rmtree(final)
            staging.rename(final)
    finally:
        for staging in staged.values():
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("Triton model repository written to %s: %s", repository, ", ".join(configs))
    return [repository / name for name in configs]


def serialize_preprocessing(manifest: Manifest, path: Path) -> None:
    """The DALI graph for ``manifest``'s preprocessing into ``path``: on the CPU for a CPU artifact,
    decoding with nvJPEG on GPU 0 for a GPU one (serializing that needs a GPU here)."""
    device_id = 0 if manifest.device_type == "cuda" else None
    pipe = build_triton_pipeline(manifest.preprocess, manifest.batch_max, DALI_THREADS, device_id)
    pipe.serialize(filename=str(path))
