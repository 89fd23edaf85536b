"""Where an ONNX file's external data may live: in files inside the model's own folder, nowhere else.

An initializer stored outside the ``.onnx`` names its file in ``external_data`` (``location``). The
file is untrusted input (docs/security.md): a location that is absolute, climbs out with ``..``,
or is a link leading out would have ONNX Runtime read (and the server serve, as weights) any file
this process can read. onnx and ONNX Runtime refuse those too, today, with a traceback at load
time; this refuses them before any work, in one line, and does not depend on their versions.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path, PurePath

from compile.settings_errors import SettingsError

FIX = (
    "Keep its external data files inside the model's folder (relative locations), or save it as one file: "
    "onnx.save_model(onnx.load(PATH), NEW_PATH, save_as_external_data=False)."
)


def check_external_data(model, path: Path, flag: str = "--model") -> None:
    """``SettingsError`` if a tensor of ``model`` (an onnx ModelProto read from ``path`` without its
    external data) takes its data from outside ``path``'s folder."""
    folder = path.resolve().parent
    for tensor in _tensors(model):
        if tensor.data_location != 1:  # TensorProto.EXTERNAL
            continue
        entries = {entry.key: entry.value for entry in tensor.external_data}
        location = entries.get("location", "")
        target = (folder / location).resolve()
        if (
            not location
            or PurePath(location).is_absolute()
            or ".." in PurePath(location).parts
            or not target.is_relative_to(folder)
            or not target.is_file()
        ):
            raise SettingsError(
                flag,
                str(path),
                f"{path}: its tensor {tensor.name!r} takes its data from {location!r}, which is not a file inside "
                f"{folder}; the model's data must come from its own folder.",
                FIX,
            )


def _tensors(model) -> Iterator:
    """Every tensor of ``model``: initializers, sparse ones, and those of node attributes in every
    graph and subgraph (If, Loop, Scan bodies) and in the model's functions."""
    graphs = [model.graph]
    nodes = [node for function in model.functions for node in function.node]
    while graphs or nodes:
        if graphs:
            graph = graphs.pop()
            yield from graph.initializer
            for sparse in graph.sparse_initializer:
                yield from (sparse.values, sparse.indices)
            nodes.extend(graph.node)
            continue
        for attribute in nodes.pop().attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            for sparse in [attribute.sparse_tensor, *attribute.sparse_tensors]:
                yield from (sparse.values, sparse.indices)
            if attribute.HasField("g"):
                graphs.append(attribute.g)
            graphs.extend(attribute.graphs)
