"""One infer request, whichever transport carried it, checked once into the ``InferCall`` it runs as.

Each transport reads its wire form into an ``InferRequest``, the values as sent and still unchecked,
with nothing of the transport left in them: the HTTP routes from JSON and binary tensors
(service/http/oip/json_request.py), the gRPC service from a ModelInferRequest
(service/http/grpc/proto_request.py). ``build_infer_call`` then makes every check the two share, in
one place (the manner of KServe's ``InferRequest``, kserve/protocol/infer_type.py: one type built
from REST JSON or from the proto, then one path). What only one wire form can get wrong stays with
its reader: JSON syntax, the binary header's length, ``binary_data_size``; ``raw_input_contents``,
``uint_contents``.

The order of the checks is part of the protocol: a request with several faults is answered with the
first one found. So a reader's own checks of the input's contents and of the outputs run when the
builder reaches them, not when the request is read: ``InferInput.contents`` is called, and
``InferRequest.outputs`` iterated, only once the input's name, datatype and shape have passed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from service import _defaults
from service.errors import InvalidInput, PayloadTooLarge
from service.http.base.deadlines import parameter_timeout_s
from service.http.base.top_k import top_k_value
from service.http.oip.tensors import (
    INPUT_NAME,
    LABELS,
    OUTPUT_DATATYPES,
    TOP_K_OUTPUTS,
    InferCall,
    RequestedOutput,
    deserialize_bytes,
)

# An input's elements: for BYTES one ``bytes`` per file, for UINT8 the whole buffer.
Elements = Sequence[bytes] | bytes


@dataclass(frozen=True)
class InferInput:
    """The request's one input (IMAGE) as sent; ``name``, ``datatype`` and ``shape`` are unchecked."""

    name: object
    datatype: object
    shape: object
    # The elements for the datatype once it is checked; the reader's faults in them (a binary size
    # that does not match, bad base64, a second raw buffer) are raised from here, after the header's.
    contents: Callable[[str], Elements]


@dataclass(frozen=True)
class OutputSpec:
    """A requested output as sent: its name, whether it goes back binary, its ``classification`` parameter."""

    name: object
    binary: object
    classification: object = None


@dataclass(frozen=True)
class InferRequest:
    """An infer request in no protocol's form; ``build_infer_call`` checks it."""

    input: InferInput
    # Iterated once, after the input's checks: a reader may check its wire form as it yields.
    outputs: Iterable[OutputSpec]
    top_k: object = None  # the request parameters as sent; None when absent
    timeout: object = None
    id: str | None = None


def build_infer_call(request: InferRequest, max_images: int) -> InferCall:
    """The checked call, ``ServiceError`` 400 (413 for too many images) for the first fault, in the
    order both protocols answer: the input, its images, the outputs, ``top_k``, ``timeout``."""
    images = input_images(request.input, max_images)
    outputs = [parse_output(spec.name, spec.binary, spec.classification) for spec in request.outputs]
    top_k = oip_top_k(request.top_k)
    timeout_s = parameter_timeout_s(request.timeout)
    return InferCall(images, top_k, outputs, request.id, timeout_s)


def input_images(tensor: InferInput, max_images: int) -> list[bytes]:
    """The image files of the input: its header checked first, then its contents."""
    datatype, shape = check_input(tensor.name, tensor.datatype, tensor.shape)
    return images_from_elements(datatype, shape, tensor.contents(datatype), max_images)


def unnamed_outputs(binary: bool) -> list[OutputSpec]:
    """What a request that names no outputs asks for: the top-k ones (as Triton answers), not LOGITS."""
    return [OutputSpec(name, binary) for name in TOP_K_OUTPUTS]


def raw_elements(datatype: str, raw: bytes) -> Elements:
    """The elements of a binary tensor (HTTP's binary extension, gRPC's ``raw_input_contents``):
    UINT8 is the buffer itself, BYTES is length-prefixed."""
    return raw if datatype == "UINT8" else deserialize_bytes(raw)


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


def images_from_elements(datatype: str, shape: list[int], elements: Elements, max_images: int) -> list[bytes]:
    """The image files of a checked input, given its BYTES elements or its UINT8 buffer.

    The count is checked against ``max_images`` from the shape first: a shape of a billion empty
    rows must cost nothing.
    """
    rows = 1 if datatype == "UINT8" and len(shape) == 1 else shape[0]
    check_count(rows, max_images)
    if datatype == "UINT8":
        return uint8_rows(shape, bytes(elements), rows)
    if len(elements) != shape[0]:
        raise InvalidInput(f"Input '{INPUT_NAME}': shape {shape} needs {shape[0]} elements, got {len(elements)}.")
    return list(elements)


def uint8_rows(shape: list[int], buffer: bytes, rows: int) -> list[bytes]:
    """A UINT8 buffer cut into its ``rows`` files of the shape's last length."""
    width = shape[-1]
    if width == 0:
        raise InvalidInput(f"Input '{INPUT_NAME}': UINT8 rows of length 0 hold no file.")
    if len(buffer) != rows * width:
        raise InvalidInput(f"Input '{INPUT_NAME}': shape {shape} needs {rows * width} bytes, got {len(buffer)}.")
    # Padding after a file's end is harmless: decoders stop at the end of the image.
    return [buffer[row * width : (row + 1) * width] for row in range(rows)]


def check_count(count: int, limit: int) -> None:
    if count == 0:
        raise InvalidInput(f"Input '{INPUT_NAME}' holds no image.")
    if count > limit:
        raise PayloadTooLarge(
            f"The request has {count} images; the limit is {limit} per request (server flag "
            "--max-images-per-request). Split them over several requests.",
        )


def parse_output(name: object, binary: object, classification: object) -> RequestedOutput:
    """One requested output, checked: a known name, a binary flag, Triton's ``classification`` count."""
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


def oip_top_k(value: object) -> int:
    """The ``top_k`` request parameter (default 5): a JSON integer, else ``ServiceError`` 400."""
    if value is None:
        return _defaults.TOP_K
    top_k = top_k_value(value, text_allowed=False)
    if top_k is None:
        raise InvalidInput(f"Parameter 'top_k' must be an integer from 1 to {_defaults.MAX_TOP_K}, got {value!r}.")
    return top_k
