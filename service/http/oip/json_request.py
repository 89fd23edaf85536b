"""An infer request over HTTP/REST, read into an ``InferRequest``: its JSON, and the binary tensors
after it (the binary tensor extension: ``Inference-Header-Content-Length`` says where the JSON ends).

Only what the JSON form can get wrong is checked here: the header's length, JSON syntax and the
types of its objects, ``binary_data_size`` against the bytes after the header, ``"data"`` against
binary data, base64. Every check gRPC shares is service/http/oip/infer_request.py's.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Iterator
from functools import partial

from service.errors import InvalidInput
from service.http.base.deadlines import TIMEOUT_PARAMETER
from service.http.oip.infer_request import (
    Elements,
    InferInput,
    InferRequest,
    OutputSpec,
    build_infer_call,
    raw_elements,
    unnamed_outputs,
)
from service.http.oip.tensors import CLASSIFICATION_PARAMETER, INPUT_NAME, TOP_K_PARAMETER, InferCall, index_list


def parse_infer_body(body: bytes, header_length: str | None, max_images: int) -> InferCall:
    """An infer request's JSON (and binary tensors after it, with ``Inference-Header-Content-Length``)."""
    return build_infer_call(read_infer_body(body, header_length), max_images)


def read_infer_body(body: bytes, header_length: str | None) -> InferRequest:
    """The request in no protocol's form; ``ServiceError`` 400 for a body that is not one at all."""
    header, binary = split_body(body, header_length)
    request = json_object(header)
    parameters = _object(request.get("parameters"), "parameters")
    tensor = one_input(request)
    request_id = request.get("id")
    return InferRequest(
        InferInput(tensor.get("name"), tensor.get("datatype"), tensor.get("shape"), partial(contents, tensor, binary)),
        requested_outputs(request.get("outputs"), parameters),
        top_k=parameters.get(TOP_K_PARAMETER),
        timeout=parameters.get(TIMEOUT_PARAMETER),
        id=request_id if isinstance(request_id, str) else None,
    )


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """The JSON header and the binary tensors after it (none without ``Inference-Header-Content-Length``)."""
    if header_length is None:
        return body, b""
    # isascii and the length first: int() of "²" or of 5,000 digits raises.
    if not (header_length.isascii() and header_length.isdigit() and len(header_length) <= 12) or int(
        header_length
    ) > len(body):
        raise InvalidInput(
            f"Inference-Header-Content-Length {header_length!r} must be the JSON header's length in bytes, at "
            f"most the body's {len(body)}.",
        )
    return body[: int(header_length)], body[int(header_length) :]


def json_object(header: bytes) -> dict:
    try:
        request = json.loads(header)
    except (ValueError, RecursionError):
        raise InvalidInput("The infer request's JSON is not valid JSON.") from None
    if not isinstance(request, dict):
        raise InvalidInput('The infer request must be a JSON object with "inputs".')
    return request


def one_input(request: dict) -> dict:
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise InvalidInput('The infer request needs "inputs" with one input, IMAGE (the image files).')
    return inputs[0]


def contents(tensor: dict, binary: bytes, datatype: str) -> Elements:
    """The input's elements: the binary data after the header where it names a ``binary_data_size``,
    else its JSON ``"data"``; called once its datatype is checked."""
    size = _object(tensor.get("parameters"), "input parameters").get("binary_data_size")
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size != len(binary):
            raise InvalidInput(
                f"Input IMAGE: binary_data_size {size!r} must equal the {len(binary)} bytes after the JSON header."
            )
        return raw_elements(datatype, binary)
    if "data" not in tensor:
        raise InvalidInput('Input IMAGE needs "data" (JSON) or a "binary_data_size" parameter (binary extension).')
    if binary:
        raise InvalidInput("The body has binary data after the JSON header, but no input names a binary_data_size.")
    return json_elements(datatype, tensor["data"])


def json_elements(datatype: str, data: object) -> Elements:
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
            f"Input '{INPUT_NAME}': element(s) {index_list(bad)} are not base64 strings. In JSON, send each file "
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


def requested_outputs(outputs: object, parameters: dict) -> Iterator[OutputSpec]:
    """The outputs asked for, checked as the builder takes them (so after the input); each one's
    ``binary_data`` defaults to the request's ``binary_data_output``."""
    binary_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InvalidInput(f"Parameter 'binary_data_output' must be true or false, got {binary_default!r}.")
    if not outputs:
        yield from unnamed_outputs(binary_default)
        return
    if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
        raise InvalidInput('"outputs" must be a list of objects with a "name".')
    for output in outputs:
        output_parameters = _object(output.get("parameters"), "output parameters")
        binary = output_parameters.get("binary_data", binary_default)
        yield OutputSpec(output.get("name"), binary, output_parameters.get(CLASSIFICATION_PARAMETER))


def _object(value: object, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f'"{what}" must be a JSON object.')
    return value
