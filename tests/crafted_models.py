"""Model files crafted to run code when read, for the tests of issue 60 (model files are untrusted input).

Each writes ``marker`` if its code runs, and otherwise looks like what it imitates: a real small
exported program whose archive is rewritten, a pickle that also returns a valid tensor, a folder
whose config names its own code. A test asserts the load is refused and the marker never appears.
"""

from __future__ import annotations

import io
import json
import socket
import threading
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

CLASSES = 5
IMAGE = 16  # the exported program's fixed image size: --crop-size 16
PREPROCESS = ["--resize-size", "16", "--crop-size", "16", "--mean", "0.5,0.5,0.5", "--std", "0.5,0.5,0.5"]


def marker_code(marker: Path) -> str:
    return f"__import__('pathlib').Path({str(marker)!r}).write_text('ran')"


class RunsCode:
    """Pickles to ``eval(code)``: writes the marker, then evaluates to ``value`` (Python source)."""

    def __init__(self, marker: Path, value: str) -> None:
        self.code = f"({marker_code(marker)}, {value})[1]"

    def __reduce__(self):
        return (eval, (self.code,))


def marker_pickle(marker: Path, value: str) -> bytes:
    """``torch.save`` of a ``RunsCode``: what torch.load reads back as ``value``, having run the code."""
    buffer = io.BytesIO()
    torch.save(RunsCode(marker, value), buffer)
    return buffer.getvalue()


class TinyClassifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(images).mean((2, 3)))


def exported_program(path: Path) -> Path:
    """A real ``torch.export.save`` of a tiny classifier with a dynamic batch."""
    torch.manual_seed(0)
    model = TinyClassifier().eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (torch.randn(2, 3, IMAGE, IMAGE),), dynamic_shapes=({0: batch},))
    torch.export.save(program, path)
    return path


def rewrite_archive(source: Path, target: Path, edit: Callable[[str, bytes], bytes | None], extra=()) -> Path:
    """``source``'s members through ``edit(name, data)`` (None drops one), plus ``extra`` (name, data)."""
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:
        root = archive.namelist()[0].split("/")[0]
        for info in archive.infolist():
            data = edit(info.filename, archive.read(info.filename))
            if data is not None:
                out.writestr(info.filename, data)
        for name, data in extra:
            out.writestr(f"{root}/{name}", data)
    return target


def edit_json(data: bytes, change: Callable[[dict], None]) -> bytes:
    loaded = json.loads(data)
    change(loaded)
    return json.dumps(loaded).encode()


def pickled_weight(source: Path, target: Path, marker: Path) -> Path:
    """conv.weight stored as a pickle (``use_pickle``) that runs code and returns a valid Parameter."""
    value = "__import__('torch').nn.Parameter(__import__('torch').full((4, 3, 3, 3), 0.1))"

    def edit(name: str, data: bytes) -> bytes:
        if name.endswith("model_weights_config.json"):
            return edit_json(data, lambda c: c["config"]["conv.weight"].update(use_pickle=True))
        if name.endswith(f"weights/{weight_file(source, 'conv.weight')}"):
            return marker_pickle(marker, value)
        return data

    return rewrite_archive(source, target, edit)


def weight_file(archive_path: Path, fqn: str) -> str:
    with zipfile.ZipFile(archive_path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("model_weights_config.json"))
        return json.loads(archive.read(name))["config"][fqn]["path_name"]


def pickled_sample_inputs(source: Path, target: Path, marker: Path) -> Path:
    """Sample inputs whose pickle the weights-only unpickler refuses, and torch then reads in full."""
    value = "((__import__('torch').zeros(2, 3, 16, 16),), {})"
    return rewrite_archive(source, target, lambda n, d: marker_pickle(marker, value) if "sample_inputs/" in n else d)


def code_in_shape_expression(source: Path, target: Path, marker: Path) -> Path:
    """A shape expression (``expr_str``, which sympify evaluates) that runs code, then is the batch symbol."""

    def change(program: dict) -> None:
        size = program["graph_module"]["graph"]["tensor_values"]["images"]["sizes"][0]["as_expr"]
        size["expr_str"] = f"({marker_code(marker)}) and {size['expr_str']} or {size['expr_str']}"

    return rewrite_archive(source, target, lambda n, d: edit_json(d, change) if n.endswith("models/model.json") else d)


def code_in_guards(source: Path, target: Path, marker: Path) -> Path:
    """``guards_code``, which ``.module()`` executes, running code."""

    def change(program: dict) -> None:
        program["guards_code"] = [f"{marker_code(marker)} or True"]

    return rewrite_archive(source, target, lambda n, d: edit_json(d, change) if n.endswith("models/model.json") else d)


def with_member(source: Path, target: Path, name: str, data: bytes) -> Path:
    """``source`` with one more member (e.g. an AOTInductor shared library)."""
    return rewrite_archive(source, target, lambda n, d: d, extra=[(name, data)])


def opaque_constant(source: Path, target: Path, marker: Path) -> Path:
    """A constant stored as an opaque object, which torch.export.load reads with pickle.loads."""
    import pickle

    def change(config: dict) -> None:
        config["config"]["evil"] = {
            "path_name": "opaque_obj_0",
            "is_param": False,
            "use_pickle": True,
            "tensor_meta": None,
        }

    def edit(name: str, data: bytes) -> bytes:
        return edit_json(data, change) if name.endswith("model_constants_config.json") else data

    return rewrite_archive(
        source, target, edit, extra=[("data/constants/opaque_obj_0", pickle.dumps(RunsCode(marker, "0")))]
    )


def remote_code_folder(folder: Path, marker: Path) -> Path:
    """A transformers folder whose config maps the auto class to its own module, which runs code."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["EvilForImageClassification"],
        "model_type": "evil",
        "auto_map": {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForImageClassification": "modeling_evil.Evil"},
        "id2label": {"0": "a", "1": "b"},
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text(f"{marker_code(marker)}\n")
    (folder / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 64}, "crop_pct": 0.875})
    )
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@contextmanager
def listener() -> Iterator[tuple[str, list[bytes]]]:
    """An HTTP endpoint on 127.0.0.1 that records every connection's first bytes (and answers none)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    seen: list[bytes] = []

    def accept() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            seen.append(connection.recv(200))
            connection.close()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", seen
    finally:
        server.close()
