"""The Open Inference Protocol (KServe v2; Triton's HTTP/REST and gRPC API) for an image classifier.

What an infer request asks for and what its outputs hold, independent of the transport: the HTTP
routes (service/http/oip/routes.py) and the gRPC service (service/http/grpc/service.py) move the bytes.

The model, as its metadata tells clients:
- input ``IMAGE``: the encoded image files, ``BYTES`` of shape ``[N]`` or ``[N, 1]`` (base64
  strings in JSON, raw in the binary tensor extension and gRPC); or ``UINT8`` of shape ``[L]`` /
  ``[1, L]`` for one file, ``[N, L]`` for N files padded to one length (Triton's DALI examples);
- outputs ``LABELS`` (``BYTES``), ``PROBABILITIES`` (``FP32``: the scores of the model's activation,
  softmax, sigmoid or none) and ``CLASS_INDICES`` (``INT64``), each ``[N, k]``, best first; k is the
  request parameter ``top_k`` (default 5); a request that names no outputs gets these three;
- ``LOGITS`` (``FP32``, ``[N, C]``): the model's whole output before its activation, only when named
  (the workers send it for such a request only);
- Triton's classification extension: an output requested with ``classification: k`` holds the
  strings ``"value:index:label"`` of its top k instead (``%f`` as Triton prints them).
OIP has no per-item status: a request with an image that cannot be classified fails as a whole,
naming the failing items.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from service import _defaults
from service.errors import Internal, InvalidInput, PayloadTooLarge, error_of_status
from service.http.base.top_k import top_k_value
from service.wire import LOGITS_DTYPE, Answer

INPUT_NAME = "IMAGE"
LABELS, PROBABILITIES, CLASS_INDICES, LOGITS = "LABELS", "PROBABILITIES", "CLASS_INDICES", "LOGITS"
# The top-k outputs, which a request that names none gets; LOGITS only when named.
TOP_K_OUTPUTS = {LABELS: "BYTES", PROBABILITIES: "FP32", CLASS_INDICES: "INT64"}
OUTPUT_DATATYPES = {**TOP_K_OUTPUTS, LOGITS: "FP32"}
# What the server metadata lists; only what is implemented.
EXTENSIONS = ("classification", "binary_tensor_data")
REPOSITORY_EXTENSION = "model_repository"


def server_extensions(repository: bool) -> list[str]:
    """What the server metadata lists: the repository extension only where its calls are on."""
    return [*EXTENSIONS, REPOSITORY_EXTENSION] if repository else list(EXTENSIONS)


SERVER_NAME = "vision-serve"  # the server metadata's name, over HTTP and gRPC
TOP_K_PARAMETER = "top_k"
CLASSIFICATION_PARAMETER = "classification"
_LENGTH = struct.Struct("<I")  # the 4-byte little-endian length before each BYTES element


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool = False
    classification: int | None = None  # Triton's classification extension: top this many as strings


@dataclass(frozen=True)
class InferCall:
    """An infer request, parsed: the image files in order and what to answer."""

    images: list[bytes]
    top_k: int
    outputs: list[RequestedOutput]
    request_id: str | None = None
    timeout_s: float | None = None  # the request's ``timeout`` parameter (service/http/base/deadlines.py)

    @property
    def worker_top_k(self) -> int:
        """How many classes the workers must return to fill every requested output."""
        return max([self.top_k] + [o.classification for o in self.outputs if o.classification and o.name != LOGITS])

    @property
    def wants_logits(self) -> bool:
        """Whether an output needs the model's whole output (LOGITS, with or without classification)."""
        return any(output.name == LOGITS for output in self.outputs)


@dataclass(frozen=True)
class OutputTensor:
    name: str
    datatype: str
    shape: list[int]
    values: list  # flat, row-major: bytes for BYTES, float for FP32, int for INT64
    binary: bool = False
    raw: bytes | None = None  # the binary form already made (LOGITS: the workers' float32 rows); values may be []

    def to_bytes(self) -> bytes:
        """The tensor in the binary form (the HTTP extension's body, gRPC's ``raw_output_contents``)."""
        if self.raw is not None:
            return self.raw
        if self.datatype == "BYTES":
            return serialize_bytes(self.values)
        dtype = "<f4" if self.datatype == "FP32" else "<i8"
        return np.asarray(self.values, dtype=dtype).tobytes()


def model_metadata(name: str, versions: list[int], engine: str, classes: int = -1) -> dict:
    """``GET /v2/models/{name}``: ``-1`` marks the batch and top-k dimensions (and LOGITS' classes when
    ``classes`` is not known)."""
    shapes = {LOGITS: [-1, classes if classes > 0 else -1]}
    return {
        "name": name,
        "versions": [str(v) for v in versions],
        "platform": f"vision-serve_{engine}" if engine else "vision-serve",
        "inputs": [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
        "outputs": [
            {"name": output, "datatype": datatype, "shape": shapes.get(output, [-1, -1])}
            for output, datatype in OUTPUT_DATATYPES.items()
        ],
    }


def serialize_bytes(elements: Iterable[bytes]) -> bytes:
    return b"".join(_LENGTH.pack(len(element)) + element for element in elements)


def deserialize_bytes(raw: bytes) -> list[bytes]:
    """BYTES elements from their binary form; ``ServiceError`` 400 if the lengths do not add up."""
    elements, offset, view = [], 0, memoryview(raw)
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidInput(f"Input '{INPUT_NAME}': binary BYTES data ends inside an element's 4-byte length.")
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidInput(f"Input '{INPUT_NAME}': a BYTES element's length ({length}) runs past the data.")
        elements.append(bytes(view[offset : offset + length]))
        offset += length
    return elements


def oip_top_k(value: object) -> int:
    """The ``top_k`` request parameter (default 5): a JSON integer, else ``ServiceError`` 400."""
    if value is None:
        return _defaults.TOP_K
    top_k = top_k_value(value, text_allowed=False)
    if top_k is None:
        raise InvalidInput(f"Parameter 'top_k' must be an integer from 1 to {_defaults.MAX_TOP_K}, got {value!r}.")
    return top_k


def parse_output(name: object, binary: object, classification: object) -> RequestedOutput:
    if not isinstance(name, str) or name not in OUTPUT_DATATYPES:
        raise InvalidInput(f"Unknown output {name!r}: the model's outputs are {', '.join(OUTPUT_DATATYPES)}.")
    if not isinstance(binary, bool):
        raise InvalidInput(f"Output '{name}': parameter 'binary_data' must be true or false, got {binary!r}.")
    if classification is not None and name == LABELS:
        raise InvalidInput(
            "Parameter 'classification' applies to a numeric output (PROBABILITIES, CLASS_INDICES or LOGITS), "
            "not LABELS."
        )
    if classification is not None and (
        isinstance(classification, bool)
        or not isinstance(classification, int)
        or not 1 <= classification <= _defaults.MAX_TOP_K
    ):
        raise InvalidInput(
            f"Output '{name}': parameter 'classification' must be an integer from 1 to {_defaults.MAX_TOP_K}, "
            f"got {classification!r}.",
        )
    return RequestedOutput(name, binary, classification)


def all_outputs(binary: bool) -> list[RequestedOutput]:
    """What a request that names no outputs gets."""
    return [RequestedOutput(name, binary) for name in TOP_K_OUTPUTS]


def check_input(name: object, datatype: object, shape: object) -> tuple[str, list[int]]:
    """The input's datatype and shape, checked: one input named IMAGE, BYTES or UINT8."""
    if name != INPUT_NAME:
        raise InvalidInput(f"Unknown input {name!r}: the model has one input, '{INPUT_NAME}' (the image files).")
    if not isinstance(shape, list | tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InvalidInput(f"Input '{INPUT_NAME}': shape must be a list of non-negative integers, got {shape!r}.")
    shape = list(shape)
    if datatype == "BYTES":
        if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
            raise InvalidInput(f"Input '{INPUT_NAME}': BYTES takes shape [N] or [N, 1] (one file each), got {shape}.")
    elif datatype == "UINT8":
        if len(shape) not in (1, 2):
            raise InvalidInput(
                f"Input '{INPUT_NAME}': UINT8 takes shape [L] (one file) or [N, L] (N files, padded), got {shape}."
            )
    else:
        raise InvalidInput(f"Input '{INPUT_NAME}': datatype must be BYTES (or UINT8 for file bytes), got {datatype!r}.")
    return str(datatype), shape


def images_from_elements(
    datatype: str, shape: list[int], elements: Sequence[bytes] | bytes, max_images: int
) -> list[bytes]:
    """The image files of a checked input, given its BYTES elements or its UINT8 buffer.

    The count is checked against ``max_images`` from the shape first: a shape of a billion empty
    rows must cost nothing.
    """
    rows = 1 if datatype == "UINT8" and len(shape) == 1 else shape[0]
    check_count(rows, max_images)
    if datatype == "UINT8":
        buffer = bytes(elements)
        width = shape[-1]
        if width == 0:
            raise InvalidInput(f"Input '{INPUT_NAME}': UINT8 rows of length 0 hold no file.")
        if len(buffer) != rows * width:
            raise InvalidInput(f"Input '{INPUT_NAME}': shape {shape} needs {rows * width} bytes, got {len(buffer)}.")
        # Padding after a file's end is harmless: decoders stop at the end of the image.
        return [buffer[row * width : (row + 1) * width] for row in range(rows)]
    if len(elements) != shape[0]:
        raise InvalidInput(f"Input '{INPUT_NAME}': shape {shape} needs {shape[0]} elements, got {len(elements)}.")
    return list(elements)


def json_elements(datatype: str, data: object) -> list[bytes] | bytes:
    """The ``data`` of a JSON input: base64 strings for BYTES, integers 0..255 for UINT8."""
    flat = list(_flatten(data))
    if datatype == "UINT8":
        try:
            return bytes(flat)
        except (TypeError, ValueError):
            raise InvalidInput(f"Input '{INPUT_NAME}': UINT8 data must be integers from 0 to 255.") from None
    elements, bad = [], []
    for index, text in enumerate(flat):
        try:
            if not isinstance(text, str):
                raise ValueError
            elements.append(base64.b64decode("".join(text.split()), validate=True))
        except (binascii.Error, ValueError):
            bad.append(index)
    if bad:
        raise InvalidInput(
            f"Input '{INPUT_NAME}': element(s) {_indices(bad)} are not base64 strings. In JSON, send each file "
            "base64-encoded; or send raw bytes with the binary tensor extension.",
        )
    return elements


def _flatten(data: object) -> Iterable[object]:
    if not isinstance(data, list):
        raise InvalidInput(f"Input '{INPUT_NAME}': 'data' must be a list.")
    for item in data:
        if isinstance(item, list):
            yield from _flatten(item)
        else:
            yield item


def check_count(count: int, limit: int) -> None:
    if count == 0:
        raise InvalidInput(f"Input '{INPUT_NAME}' holds no image.")
    if count > limit:
        raise PayloadTooLarge(
            f"The request has {count} images; the limit is {limit} per request (server flag "
            "--max-images-per-request). Split them over several requests.",
        )


def failed_items(answers: Sequence[Answer | None]) -> None:
    """``ServiceError`` for a request any of whose images failed: a 5xx as it came (503, 504), else 400
    naming each failing item and why (its own 413 or 415 is in the message)."""
    failed = [(index, a) for index, a in enumerate(answers) if a is not None and a.status_code != 200]
    if not failed:
        return
    server_side = [a for _, a in failed if a.status_code >= 500]
    if server_side:
        first = server_side[0]
        raise error_of_status(first.status_code, first.detail, retry_after_s=first.retry_after_s)
    details = "; ".join(f"[{index}] {a.detail}" for index, a in failed)
    raise InvalidInput(f"Image(s) {_indices([i for i, _ in failed])} of input '{INPUT_NAME}' failed: {details}")


def _indices(indices: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:20])
    return shown + (f" and {len(indices) - 20} more" if len(indices) > 20 else "")


def build_outputs(call: InferCall, answers: Sequence[Answer], labels: Sequence[str] = ()) -> list[OutputTensor]:
    """The requested output tensors from every image's successful answer. ``labels``: the model's, in
    index order, for classification strings of LOGITS (else the index alone, as Triton without labels)."""
    tensors = []
    n = len(answers)
    for output in call.outputs:
        if output.name == LOGITS:
            tensors.append(logits_tensor(output, answers, labels))
            continue
        k = output.classification or call.top_k
        rows = [answer.predictions[:k] for answer in answers]
        width = min(len(row) for row in rows) if rows else 0  # k may exceed the model's classes
        if output.classification:
            values = [classification_string(p, i, label) for row in rows for i, label, p in row[:width]]
            tensors.append(OutputTensor(output.name, "BYTES", [n, width], values, output.binary))
            continue
        column = {LABELS: 1, PROBABILITIES: 2, CLASS_INDICES: 0}[output.name]
        values = [prediction[column] for row in rows for prediction in row[:width]]
        if output.name == LABELS:
            values = [label.encode() for label in values]
        tensors.append(OutputTensor(output.name, OUTPUT_DATATYPES[output.name], [n, width], values, output.binary))
    return tensors


def classification_string(value: float, index: int, label: str | None) -> bytes:
    """Triton's classification element: ``"<value>:<index>[:<label>]"``, the value as C's ``%f``."""
    text = f"{value:f}:{index}"
    return (f"{text}:{label}" if label else text).encode()


def logits_tensor(output: RequestedOutput, answers: Sequence[Answer], labels: Sequence[str]) -> OutputTensor:
    """LOGITS ``[N, C]`` from each answer's float32 row, or with ``classification`` its top k as strings."""
    if any(answer.logits is None for answer in answers):
        raise Internal("The workers answered without the logits this request asked for; see the server log.")
    matrix = np.frombuffer(b"".join(answer.logits for answer in answers), dtype=LOGITS_DTYPE)  # type: ignore[misc]
    matrix = matrix.reshape(len(answers), -1)
    if output.classification:
        width = min(output.classification, matrix.shape[1])
        order = np.argsort(-matrix, axis=1, kind="stable")[:, :width]
        values = [
            classification_string(float(row[i]), int(i), labels[i] if i < len(labels) else None)
            for row, indices in zip(matrix, order, strict=True)
            for i in indices
        ]
        return OutputTensor(output.name, "BYTES", [len(answers), width], values, output.binary)
    values = [] if output.binary else matrix.astype(np.float64).ravel().tolist()
    return OutputTensor(output.name, "FP32", list(matrix.shape), values, output.binary, raw=matrix.tobytes())
