"""The Open Inference Protocol (KServe v2; Triton's HTTP/REST and gRPC API) for an image classifier.

What an infer call asks for (``InferCall``, made by service/http/oip/infer_request.py's checks) and
what its outputs hold, independent of the transport: the HTTP routes (service/http/oip/routes.py) and
the gRPC service (service/http/grpc/service.py) move the bytes.

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

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from service.errors import Internal, InvalidInput, error_of_status
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
    raise InvalidInput(f"Image(s) {index_list([i for i, _ in failed])} of input '{INPUT_NAME}' failed: {details}")


def index_list(indices: Sequence[int]) -> str:
    """Indices as a message lists them: the first 20, then how many more."""
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
