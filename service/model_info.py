"""What is served, as every process reports it: ``ModelInfo``. The main process resolves it
(service/supervisor/planning/planner.py); the HTTP processes show it (``/info``, the Open Inference Protocol's
metadata, the build_info metric)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

AUTO_ACTIVATION = "auto"


def resolve_activation(requested: str, model_activation: str) -> str:
    """What the workers apply to the logits: --activation, or with ``auto`` the model's own."""
    return model_activation if requested == AUTO_ACTIVATION else requested


@dataclass(frozen=True)
class ModelInfo:
    """What ``/info``, the Open Inference Protocol's metadata and the build_info metric say of the
    served model. Fields in ``/info``'s order."""

    model: str  # the served name (--name)
    weights: str
    engine: str
    preprocess: str
    preprocess_reason: str
    preprocess_spec: dict
    labels_source: str
    device: str  # what --device resolved to: cpu, cuda (every GPU) or cuda:N
    max_batch_size: int
    batch_timeout_ms: float
    artifact: dict | None = None  # the manifest's facts, when serving an artifact
    source: str = ""  # what --model said: a catalog name, timm:<name>, a model file
    # The class names in index order, which the workers answer with. Not in /info (``labels_source``
    # says where they come from); the HTTP processes check cached answers against them
    # (service/http/cache/codec.py). Empty: not known, and nothing is answered from a cache.
    labels: tuple[str, ...] = ()
    # The workers per device and engine threads it is served with, where each came from and why
    # (service/supervisor/planning/sizing.py).
    sizing: dict | None = None
    # What the workers turn the logits into the answered scores with (softmax, sigmoid, none):
    # --activation, or the model's own (``resolve_activation``).
    activation: str = "softmax"
    # ``preprocess_spec`` in one line (PreprocessSpec.describe: ``shorter 256, crop 224x224, bilinear``).
    # Added in place: empty where a plan made before it is read.
    preprocess_summary: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", tuple(self.labels))  # a list when read back from JSON

    def to_dict(self) -> dict:
        """What /info shows: every field but the labels, the spec's summary right after the spec."""
        described = asdict(self)
        del described["labels"]
        for optional in ("artifact", "sizing"):
            if described[optional] is None:
                del described[optional]
        summary = described.pop("preprocess_summary")
        ordered: dict = {}
        for key, value in described.items():
            ordered[key] = value
            if key == "preprocess_spec":
                ordered["preprocess_summary"] = summary
        return ordered
