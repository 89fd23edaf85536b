"""``--model FOLDER``: an image classifier saved by Hugging Face transformers or by timm, read from disk.

A folder is recognized by its ``config.json``:

* transformers (``save_pretrained``): ``architectures`` and ``model_type``; labels from ``id2label``,
  preprocessing from ``preprocessor_config.json`` (the processor ``AutoImageProcessor`` would build,
  reproduced step for step or refused: compile/hf_processors.py),
  the activation from ``problem_type`` (multi_label_classification: sigmoid; else softmax);
* timm (``timm.models.push_to_hf_hub.save_for_hf``): ``architecture`` and ``pretrained_cfg``; labels
  from ``label_names`` (or ``id2label``), preprocessing from ``pretrained_cfg`` as for ``timm:<name>``.

A folder is untrusted input (docs/security.md): nothing in it runs and nothing is downloaded. A
transformers folder whose config names its own code (``auto_map``) is refused, and the model is
built with ``trust_remote_code=False``, offline (``local_files_only``, the Hub's variables set:
compile/offline_loads.py); a timm folder's ``architecture`` must be one of timm's own. Its values are
checked as they are read (compile/config_values.py). transformers is imported only for such a folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from compile import _defaults
from compile.config_values import FLAGS_HINT
from compile.hf_processors import processor_spec
from compile.offline_loads import untrusted_load
from compile.settings_errors import SettingsError
from preprocessing.spec import PreprocessSpec

CONFIG_FILE = "config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"
TRANSFORMERS_FAMILY = "transformers"
TIMM_FOLDER_FAMILY = "timm-folder"
FOLDER_FAMILIES = (TRANSFORMERS_FAMILY, TIMM_FOLDER_FAMILY)
WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")
SAVE_AGAIN = "Save it again with save_pretrained (transformers) or timm's save_for_hf."


def folder_kind(model: str) -> str | None:
    """``transformers`` or ``timm-folder`` when ``model`` is a folder holding such a config.json, else None."""
    path = Path(model).expanduser()
    if not (path / CONFIG_FILE).is_file():
        return None
    config = read_json(path / CONFIG_FILE)
    if "architecture" in config and "pretrained_cfg" in config:
        return TIMM_FOLDER_FAMILY
    if config.get("architectures") or "model_type" in config:
        return TRANSFORMERS_FAMILY
    raise SettingsError(
        "--model",
        model,
        f"{path / CONFIG_FILE} is neither a transformers config (architectures, model_type) nor a timm one "
        "(architecture, pretrained_cfg).",
        "Point --model at a folder written by save_pretrained (transformers) or timm's save_for_hf.",
    )


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SettingsError("--model", str(path.parent), f"Cannot read {path}: {exc}", "") from None
    if not isinstance(data, dict):
        raise SettingsError("--model", str(path.parent), f"{path} is not a JSON object.", "")
    return data


def architecture_of(folder: Path, kind: str) -> str:
    config = read_json(folder / CONFIG_FILE)
    if kind == TIMM_FOLDER_FAMILY:
        return str(config["architecture"])
    return str((config.get("architectures") or [config.get("model_type", "?")])[0])


def folder_labels(folder: Path, config: dict) -> tuple[str, ...]:
    """Labels in output order, from ``label_names`` (timm) or ``id2label``; refuses gaps. A timm folder
    without either has none (``--labels`` then required)."""
    if isinstance(config.get("label_names"), list):
        return tuple(str(name) for name in config["label_names"])
    if "pretrained_cfg" in config and not config.get("id2label"):
        return ()
    id2label = config.get("id2label") or {}
    try:
        by_index = {int(key): str(value) for key, value in id2label.items()}
    except (TypeError, ValueError, AttributeError):
        by_index = {}
    if not by_index or sorted(by_index) != list(range(len(by_index))):
        raise SettingsError(
            "--labels",
            None,
            f"{folder / CONFIG_FILE} has no id2label with ids 0..N-1 (got {sorted(by_index)[:10]}).",
            "Give --labels FILE with the class labels, one per line in output order.",
        )
    return tuple(by_index[i] for i in range(len(by_index)))


def transformers_preprocess(folder: Path) -> PreprocessSpec:
    """The preprocessing of the image processor ``AutoImageProcessor`` would build from the folder, as a
    ``PreprocessSpec`` that reproduces it exactly (compile/hf_processors.py), or a ``SettingsError`` naming
    the field it cannot reproduce and the flags nearest to it."""
    path, cfg = processor_config(folder)
    config = read_json(folder / CONFIG_FILE) if (folder / CONFIG_FILE).is_file() else {}
    return processor_spec(cfg, config.get("model_type"), str(path), str(folder))


def processor_config(folder: Path) -> tuple[Path, dict]:
    """The saved processor dict and its file, where transformers looks: a ``processor_config.json`` that
    nests an ``image_processor`` (what a multimodal processor saves) first, else ``preprocessor_config.json``."""
    nested = folder / PROCESSOR_FILE
    if nested.is_file():
        image_processor = read_json(nested).get("image_processor")
        if isinstance(image_processor, dict):
            return nested, image_processor
    path = folder / PREPROCESSOR_FILE
    if not path.is_file():
        raise SettingsError(
            "--model", str(folder), f"{folder} has no {PREPROCESSOR_FILE}: its preprocessing is unknown.", FLAGS_HINT
        )
    return path, read_json(path)


def folder_entry(model: str, kind: str, preprocess_overridden: bool = False):
    """The ``ModelEntry`` of a saved folder. ``preprocess_overridden``: every preprocessing flag was
    given, so a processor that cannot be reproduced is not an error."""
    from compile.catalog import ModelEntry
    from compile.timm_support import served_name_of, timm_preprocess

    folder = Path(model).expanduser().resolve()
    config = read_json(folder / CONFIG_FILE)
    labels = folder_labels(folder, config)
    architecture = architecture_of(folder, kind)
    # Refused here, before the planner or a worker builds anything from the folder.
    check_folder_model(folder, kind, config, architecture)
    try:
        try:
            if kind == TIMM_FOLDER_FAMILY:
                cfg = dict(config["pretrained_cfg"])
                cfg.setdefault("input_size", (3, 224, 224))
                preprocess = timm_preprocess(architecture, cfg, str(folder / CONFIG_FILE))
            else:
                preprocess = transformers_preprocess(folder)
        except SettingsError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # a value of a shape no processor writes
            raise SettingsError(
                "--model", str(folder), f"{folder}'s preprocessing config cannot be read ({exc}).", FLAGS_HINT
            ) from None
    except SettingsError:
        if not preprocess_overridden:
            raise
        preprocess = PreprocessSpec(256, 224, (0.5,) * 3, (0.5,) * 3)  # replaced by the flags
    return ModelEntry(
        name=served_name_of(folder.name),
        family=kind,
        preprocess=preprocess,
        labels=labels,
        labels_source=f"{folder / CONFIG_FILE}:{'label_names' if 'label_names' in config else 'id2label'}",
        model=str(folder),
        activation=folder_activation(folder, config),
    )


def folder_activation(folder: Path, config: dict) -> str:
    """What turns the folder's logits into scores: transformers' ``problem_type`` says (absent: softmax,
    as transformers' own pipeline reads a model of one label per image)."""
    problem_type = config.get("problem_type")
    if problem_type is None:
        return _defaults.MODEL_ACTIVATION
    activation = _defaults.PROBLEM_TYPE_ACTIVATIONS.get(problem_type) if isinstance(problem_type, str) else None
    if activation is None:
        raise SettingsError(
            "--model",
            str(folder),
            f"{folder / CONFIG_FILE} has problem_type {problem_type!r}, not one of "
            f"{', '.join(_defaults.PROBLEM_TYPE_ACTIVATIONS)}.",
            "Set problem_type to one of those in config.json, or remove it (softmax).",
        )
    return activation


class LogitsOnly(nn.Module):
    """A transformers classifier as a plain images -> logits module, the contract every backend takes."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=images).logits


def check_folder_model(folder: Path, kind: str, config: dict, architecture: str) -> Path | None:
    """``SettingsError`` naming the file and the fix unless what the folder names builds without its own
    code, the Hub or another folder; then its weights file, if it has one, checked to be one (None: it
    has none, which only loading it refuses: the folder's facts are read without its weights)."""
    config_file = folder / CONFIG_FILE
    if kind == TIMM_FOLDER_FAMILY:
        from compile.timm_support import check_timm_architecture

        check_timm_architecture(architecture, str(config_file), str(folder))
    else:
        if "auto_map" in config:
            raise SettingsError(
                "--model",
                str(folder),
                f"{config_file} has an auto_map: the model is code shipped in the folder, and vision-serve runs no "
                "code from a model folder.",
                "Save a model of a class transformers has (save_pretrained without custom code), or export it to "
                "ONNX on a machine you trust and serve the .onnx.",
            )
        check_transformers_type(folder, config)
    weights = next((folder / n for n in WEIGHTS_FILES if (folder / n).is_file()), None)
    if weights is None:
        return None
    if weights.stat().st_size == 0:
        raise SettingsError("--model", str(folder), f"{weights} is empty.", SAVE_AGAIN)
    if weights.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(weights), framework="pt"):  # reads the header only
                pass
        except Exception as exc:  # safetensors' SafetensorError, OSError
            raise SettingsError(
                "--model", str(folder), f"{weights} is not a safetensors file ({str(exc)[:200]}).", SAVE_AGAIN
            ) from None
    return weights


def check_transformers_type(folder: Path, config: dict) -> None:
    """Its ``model_type`` must be an image classifier transformers has (AutoModelForImageClassification)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
    except ImportError:
        raise SettingsError(
            "--model",
            str(folder),
            f"{folder} is a transformers model: it needs transformers.",
            "pip install 'vision-serve[hf]'.",
        ) from None
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        raise SettingsError(
            "--model",
            str(folder),
            f"{folder / CONFIG_FILE}: its model_type {model_type!r} is not an image classifier of transformers "
            f"{_transformers_version()}.",
            "Save a model of an image-classification class transformers has (e.g. ConvNextForImageClassification).",
        )


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def load_folder_model(entry) -> tuple[nn.Module, Path]:
    """The folder's model in eval mode on the CPU with its saved weights, and the weights file."""
    folder = Path(entry.model)
    config = read_json(folder / CONFIG_FILE)
    weights = check_folder_model(folder, entry.family, config, architecture_of(folder, entry.family))
    if weights is None:
        raise SettingsError("--model", str(folder), f"{folder} holds no {' or '.join(WEIGHTS_FILES)}.", SAVE_AGAIN)
    if entry.family == TIMM_FOLDER_FAMILY:
        from compile.timm_support import create_timm_model

        where = str(folder / CONFIG_FILE)
        model = create_timm_model(
            architecture_of(folder, entry.family), where, str(folder), num_classes=entry.num_classes
        )
        try:
            model.load_state_dict(read_state_dict(weights))
        except RuntimeError as exc:  # shapes or keys that do not fit the architecture
            lines = str(exc).splitlines()
            mismatch = (lines[1] if len(lines) > 1 else lines[0]).strip()[:300]
            raise SettingsError(
                "--model",
                str(folder),
                f"{weights} does not fit {where}'s architecture ({mismatch}).",
                SAVE_AGAIN,
            ) from None
        return model.eval(), weights
    from transformers import AutoModelForImageClassification

    try:
        with untrusted_load():
            model = AutoModelForImageClassification.from_pretrained(
                str(folder), local_files_only=True, trust_remote_code=False, weights_only=True
            )
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise SettingsError(
            "--model", str(folder), f"{folder} did not load ({str(exc).splitlines()[0][:300]}).", SAVE_AGAIN
        ) from None
    if model.config.num_labels != entry.num_classes:
        raise SettingsError(
            "--labels",
            entry.labels_source,
            f"{entry.labels_source} has {entry.num_classes} labels, but {folder} outputs {model.config.num_labels}.",
            "Give the labels file the model was trained with.",
        )
    return LogitsOnly(model).eval(), weights


def read_state_dict(path: Path) -> dict:
    """The tensors of a folder's weights file: safetensors, or a pickle read by the weights-only unpickler."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        with untrusted_load():
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors' SafetensorError, pickle's UnpicklingError, OSError...
        raise SettingsError(
            "--model", str(path.parent), f"Could not read {path} ({str(exc).splitlines()[0][:300]}).", SAVE_AGAIN
        ) from None
