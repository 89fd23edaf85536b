"""Model files made elsewhere: an ONNX file, or a ``torch.export`` ExportedProgram (``.pt2``).

What the server needs of such a file is read from the file itself and checked before any work:
one float32 image input ``[N, 3, H, W]`` and one logits output ``[N, classes]``, with the batch
dimension ``N`` dynamic (the server forms batches of every size up to its maximum). A file that
does not fit is refused with the reason and what to change in the export.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

from compile import _defaults
from compile.onnx_external_data import check_external_data
from compile.pt2_archive import load_exported_program
from compile.settings_errors import SettingsError


class ModelFileError(ValueError):
    """The model file cannot be served; the message says why and how to re-export it."""


@dataclass(frozen=True)
class ModelFileFacts:
    """The contract read from a model file."""

    path: Path
    format: str  # "onnx" or "exported-program"
    input_name: str
    output_name: str
    classes: int
    image_size: tuple[int | None, int | None]  # (H, W); None where the file leaves it dynamic
    batch_range: tuple[int, int | None]  # smallest and largest batch the file accepts (None: unbounded)

    def check_crop(self, input_size: tuple[int, int]) -> None:
        """Refuse preprocessing whose model input, ``input_size`` = (height, width), differs from a fixed
        image size of the file (a side the file leaves dynamic takes any size)."""
        height, width = input_size
        file_height, file_width = self.image_size
        if file_height in (None, height) and file_width in (None, width):
            return
        # The file's fixed sides, and the preprocessing's where the file takes any.
        wanted = (file_height or height, file_width or width)
        flag = str(wanted[0]) if wanted[0] == wanted[1] else f"{wanted[0]}x{wanted[1]}"
        raise ModelFileError(
            f"{self.path} takes {_side(file_height)}x{_side(file_width)} images (height x width), but the "
            f"preprocessing gives {height}x{width} (--crop-size). Pass --crop-size {flag} (HxW: height x width; "
            "one number for a square)."
        )

    def check_batch(self, batch: tuple[int, int, int]) -> None:
        """Refuse a ``--batch`` range outside what the file's batch dimension accepts."""
        low, high = self.batch_range
        if batch[0] < low or (high is not None and batch[2] > high):
            top = "unbounded" if high is None else str(high)
            raise ModelFileError(
                f"{self.path} accepts batches of {low}..{top}, but --batch asks for {batch[0]}..{batch[2]}. "
                f"Pass a --batch MIN,OPT,MAX within that range, or re-export with a wider batch dimension."
            )


def model_file_format(model: str) -> str | None:
    """``onnx`` or ``exported-program`` when ``--model`` names a model file by its suffix, else None."""
    suffix = Path(model).suffix.lower()
    if suffix == _defaults.ONNX_FILE_SUFFIX:
        return "onnx"
    if suffix == _defaults.EXPORTED_PROGRAM_SUFFIX:
        return "exported-program"
    return None


def read_model_file(model: str) -> ModelFileFacts:
    """The facts of the model file ``model``; raises ``ModelFileError`` if it cannot be served.

    Reading a .pt2 loads the whole program: the facts are kept per file version (path, size, mtime),
    so that resolving the model and checking it against --batch read it once."""
    path = Path(model).expanduser().resolve()
    if not path.is_file():
        raise ModelFileError(f"--model {model}: file not found.")
    stat = path.stat()
    return _read_model_file(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_model_file(path: Path, size: int, mtime_ns: int) -> ModelFileFacts:
    if model_file_format(str(path)) == "onnx":
        return _read_onnx(path)
    return _read_exported_program(path)


_STATIC_BATCH_FIX = {
    "onnx": "export it with a dynamic batch dimension: torch.onnx.export(..., dynamic_shapes=({0: "
    "torch.export.Dim('batch')},)) or dynamic_axes={'input': {0: 'batch'}}",
    "exported-program": "export it with a dynamic batch dimension: torch.export.export(model, (example,), "
    "dynamic_shapes=({0: torch.export.Dim('batch', min=1, max=64)},)), with an example batch of 2 or more",
}


def _check_image_input(path: Path, kind: str, name: str, shape: list, batch_dynamic: bool) -> None:
    if len(shape) != 4 or shape[1] != 3:
        raise ModelFileError(
            f"{path}: its input {name!r} has shape {_show(shape)}; vision-serve feeds images as [N, 3, H, W] "
            "(a batch of RGB images, channels first)."
        )
    if not batch_dynamic:
        raise ModelFileError(
            f"{path}: the batch dimension of its input {name!r} is fixed at {shape[0]} (shape {_show(shape)}); the "
            f"server batches 1..N images, so it must be dynamic. Re-{_STATIC_BATCH_FIX[kind]}."
        )


def _check_logits_output(path: Path, name: str, shape: list) -> int:
    if len(shape) != 2 or not isinstance(shape[1], int) or shape[1] < 1:
        raise ModelFileError(
            f"{path}: its output {name!r} has shape {_show(shape)}; vision-serve needs logits shaped [N, classes] "
            "(one row of class scores per image, a fixed number of classes)."
        )
    return shape[1]


def _side(size: int | None) -> str:
    return "any" if size is None else str(size)


def _show(shape: list) -> str:
    return "[" + ", ".join("N" if s is None else str(s) for s in shape) + "]"


def onnx_graph_inputs(graph) -> list:
    """The graph's real inputs: older exporters also list every initializer (weight) as an input."""
    initializers = {i.name for i in graph.initializer}
    return [i for i in graph.input if i.name not in initializers]


def onnx_io_names(path: Path) -> tuple[str, str]:
    """The input and output names of the ONNX file at ``path``: ours, or those of a file made elsewhere."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return onnx_graph_inputs(graph)[0].name, graph.output[0].name


def _read_onnx(path: Path) -> ModelFileFacts:
    try:
        import onnx
    except ImportError:
        raise ModelFileError(
            "Reading an ONNX model needs the onnx package: pip install 'vision-serve[onnx]'."
        ) from None
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError, OSError...
        raise ModelFileError(f"Could not read {path} as an ONNX model ({str(exc)[:300]}).") from None
    check_external_data(model, path)
    graph = model.graph
    inputs = onnx_graph_inputs(graph)
    if len(inputs) != 1 or len(graph.output) != 1:
        raise ModelFileError(
            f"{path} has {len(inputs)} inputs and {len(graph.output)} outputs; vision-serve serves classifiers "
            "with one image input and one logits output."
        )

    def dims(value) -> list[int | None]:
        return [
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
            for d in value.type.tensor_type.shape.dim
        ]

    image, logits = inputs[0], graph.output[0]
    if image.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
        raise ModelFileError(
            f"{path}: its input {image.name!r} is not float32; vision-serve feeds normalized float32 images "
            "(cast inside the model for other precisions)."
        )
    in_shape, out_shape = dims(image), dims(logits)
    _check_image_input(path, "onnx", image.name, in_shape, batch_dynamic=in_shape[0] is None if in_shape else False)
    classes = _check_logits_output(path, logits.name, out_shape)
    return ModelFileFacts(path, "onnx", image.name, logits.name, classes, (in_shape[2], in_shape[3]), (1, None))


def _read_exported_program(path: Path) -> ModelFileFacts:
    from torch.export.graph_signature import InputKind

    try:
        program = load_exported_program(path)
    except SettingsError:
        raise  # refused before torch read it: the message says why
    except Exception as exc:
        raise ModelFileError(
            f"Could not read {path} as a torch.export ExportedProgram ({str(exc)[:300]}). Save one with "
            "torch.export.save(torch.export.export(model, (example,), dynamic_shapes=...), PATH); an AOTInductor "
            "package (also .pt2) is served with --artifact, not compiled again."
        ) from None
    user_inputs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    outputs = program.graph_signature.user_outputs
    if len(user_inputs) != 1 or len(outputs) != 1:
        raise ModelFileError(
            f"{path} takes {len(user_inputs)} inputs and returns {len(outputs)} outputs; vision-serve serves "
            "classifiers with one image input and one logits output."
        )
    nodes = {node.name: node for node in program.graph.nodes}
    image_name = user_inputs[0].arg.name
    image = nodes[image_name].meta["val"]
    output_node = next(node for node in program.graph.nodes if node.op == "output")
    logits = output_node.args[0][0].meta["val"]

    def dims(shape) -> list[int | None]:
        return [s if isinstance(s, int) else None for s in shape]

    in_shape, out_shape = dims(image.shape), dims(logits.shape)
    _check_image_input(path, "exported-program", image_name, in_shape, batch_dynamic=in_shape[0] is None)
    classes = _check_logits_output(path, outputs[0], out_shape)
    batch = image.shape[0]
    bounds = program.range_constraints.get(batch.node.expr)
    low = max(1, int(bounds.lower)) if bounds is not None else 1
    high = int(bounds.upper) if bounds is not None and math.isfinite(float(bounds.upper)) else None
    return ModelFileFacts(
        path, "exported-program", image_name, outputs[0], classes, (in_shape[2], in_shape[3]), (low, high)
    )
