"""What ``--model`` names, resolved: a catalog model, a timm model, or a model file made elsewhere.

``--model`` takes five forms, each with its own preprocessing and labels unless flags override them:

=======================  =====================================  ==============================
form                     preprocessing                          labels
=======================  =====================================  ==============================
``resnet50``             torchvision's preset of its weights    ImageNet's, or ``--labels``
``efficientnet-lite0``   the TF reference's                     ImageNet's, or ``--labels``
``timm:<name>``          the model's ``pretrained_cfg``         ImageNet's if it has 1,000
                                                                classes, or ``--labels``
``path/model.onnx``      the flags, required                    ``--labels``, required
``path/model.pt2``       the flags, required                    ``--labels``, required
``path/folder/``         its preprocessor_config.json (HF)      its config.json's ``id2label``
                         or pretrained_cfg (timm)               (``label_names`` for timm)
=======================  =====================================  ==============================

A labels file sets the number of classes: the architectures we build get a head of that size, and
a model file must output that many. Flags of both commands (compile-trt and vision-serve) make a
``ModelRequest``; ``resolve_model`` turns it into the ``ModelEntry`` everything else uses.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from compile import _defaults
from compile.catalog import ModelEntry, get_model_entry, imagenet_labels
from compile.labels import IMAGENET_LABELS_KEYWORD, read_labels
from compile.model_files import ModelFileFacts, model_file_format, read_model_file
from compile.model_request import ModelRequest, check_model_flags
from compile.preprocess_flags import PreprocessFlags, preprocess_spec
from compile.pretrained_folders import FOLDER_FAMILIES, folder_entry, folder_kind
from compile.settings_errors import SettingsError
from compile.timm_support import create_timm_model, import_timm, served_name_of, timm_preprocess


def model_kind(model: str) -> str:
    """``catalog``, ``timm``, ``onnx``, ``exported-program``, or a saved folder's: ``transformers``,
    ``timm-folder`` (compile/pretrained_folders.py)."""
    if model.startswith(_defaults.TIMM_PREFIX):
        return "timm"
    return model_file_format(model) or folder_kind(model) or "catalog"


def resolve_model(request: ModelRequest) -> ModelEntry:
    """The ``ModelEntry`` of ``request``; raises ``ValueError`` (or a subclass) naming the fix."""
    check_model_flags(request)
    flags = request.preprocess_flags
    kind = model_kind(request.model)
    facts: ModelFileFacts | None = None
    if kind == "catalog":
        entry = get_model_entry(request.model)
    elif kind == "timm":
        entry = timm_entry(request.model[len(_defaults.TIMM_PREFIX) :])
    elif kind in FOLDER_FAMILIES:
        # Flags that make the whole spec (interpolation too: nothing says the folder's is bilinear) stand in
        # for a processor that cannot be reproduced.
        entry = folder_entry(request.model, kind, not flags.missing(interpolation=True))
    else:
        facts = read_model_file(request.model)
        entry = file_entry(request, facts)
    if request.labels:
        labels, source = labels_from(request.labels)
        entry = dataclasses.replace(entry, labels=labels, labels_source=source)
    elif not entry.labels:
        raise SettingsError(
            "--labels",
            None,
            f"--model {request.model} needs --labels: a text file with its {facts.classes if facts else 'N'} class "
            "labels, one per line in output order.",
            f"Give --labels FILE, or --labels {IMAGENET_LABELS_KEYWORD} if they are ImageNet's 1,000.",
        )
    if flags.any and facts is None:  # a model file's spec is the flags' already
        entry = dataclasses.replace(entry, preprocess=preprocess_spec(flags, entry.preprocess))
    if facts is not None:
        facts.check_crop(entry.preprocess.input_size)
        if facts.classes != entry.num_classes:
            raise SettingsError(
                "--labels",
                request.labels,
                f"--labels {request.labels} has {entry.num_classes} labels, but {facts.path} outputs {facts.classes} "
                "classes.",
                "Give the labels file the model was trained with (one line per output, in order).",
            )
    if request.name:
        entry = dataclasses.replace(entry, name=request.name)
    return entry


def labels_from(labels: str) -> tuple[tuple[str, ...], str]:
    """(labels, where they came from) for ``--labels``."""
    if labels == IMAGENET_LABELS_KEYWORD:
        return imagenet_labels(), _defaults.IMAGENET_LABELS_SOURCE
    path = Path(labels).expanduser().resolve()
    return read_labels(path), f"file:{path}"


def file_entry(request: ModelRequest, facts: ModelFileFacts) -> ModelEntry:
    """A model file's entry: preprocessing from the flags (all it needs given), labels still to come."""
    flags: PreprocessFlags = request.preprocess_flags
    missing = flags.missing()
    if missing:
        listed = " ".join(missing)
        raise SettingsError(
            ", ".join(missing),
            None,
            f"--model {request.model} is a model file made elsewhere, and vision-serve does not assume ImageNet's "
            f"preprocessing: {listed} missing.",
            "Give the preprocessing it was trained with, e.g. --resize-size 256 --crop-size 224 --mean "
            "0.485,0.456,0.406 --std 0.229,0.224,0.225 --interpolation bilinear (docs/configuration.md"
            "#preprocessing-flags).",
        )
    return ModelEntry(
        name=served_name_of(facts.path.stem),
        family=facts.format,
        preprocess=preprocess_spec(flags, None),
        labels=(),
        labels_source="",
        model=str(facts.path),
    )


def timm_entry(name: str) -> ModelEntry:
    """A timm model's entry: the preprocessing of its ``pretrained_cfg``, translated exactly."""
    timm = import_timm()
    model = create_timm_model(name, f"--model timm:{name}", f"{_defaults.TIMM_PREFIX}{name}", _defaults.TIMM_PREFIX)
    config = timm.data.resolve_model_data_config(model)
    classes = int(getattr(model, "num_classes", 0))
    return ModelEntry(
        name=served_name_of(name),
        family="timm",
        preprocess=timm_preprocess(name, config),
        labels=imagenet_labels() if classes == len(imagenet_labels()) else (),
        labels_source=_defaults.IMAGENET_LABELS_SOURCE if classes == len(imagenet_labels()) else "",
        model=_defaults.TIMM_PREFIX + name,
    )
