"""A ModelInferRequest (gRPC) read into an ``InferRequest``.

Only what the proto form can get wrong is checked here: the number of inputs and of
``raw_input_contents`` entries, and ``uint_contents`` past 255. Every check HTTP shares is
service/http/oip/infer_request.py's. gRPC sends its outputs raw, so each one is binary.
"""

from __future__ import annotations

from functools import partial

from tritonclient.grpc import service_pb2

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
from service.http.oip.tensors import CLASSIFICATION_PARAMETER, INPUT_NAME, TOP_K_PARAMETER, InferCall


def parse_grpc_request(request: service_pb2.ModelInferRequest, max_images: int) -> InferCall:
    """A ModelInferRequest as an ``InferCall``; ``ServiceError`` 400 for what the model cannot take."""
    return build_infer_call(read_grpc_request(request), max_images)


def read_grpc_request(request: service_pb2.ModelInferRequest) -> InferRequest:
    """The request in no protocol's form; ``ServiceError`` 400 unless it has one input."""
    if len(request.inputs) != 1:
        raise InvalidInput(f"The infer request needs one input, {INPUT_NAME} (the image files).")
    tensor = request.inputs[0]
    outputs = [
        OutputSpec(output.name, True, parameter_value(output.parameters.get(CLASSIFICATION_PARAMETER)))
        for output in request.outputs
    ]
    return InferRequest(
        InferInput(tensor.name, tensor.datatype, list(tensor.shape), partial(contents, request)),
        outputs or unnamed_outputs(binary=True),
        top_k=parameter_value(request.parameters.get(TOP_K_PARAMETER)),
        timeout=parameter_value(request.parameters.get(TIMEOUT_PARAMETER)),
        id=request.id or None,
    )


def contents(request: service_pb2.ModelInferRequest, datatype: str) -> Elements:
    """The input's elements: its one ``raw_input_contents`` entry (as tritonclient sends them), else
    its typed contents; called once its datatype is checked."""
    if request.raw_input_contents:
        if len(request.raw_input_contents) != 1:
            raise InvalidInput(f"raw_input_contents must hold one entry, for {INPUT_NAME}.")
        return raw_elements(datatype, request.raw_input_contents[0])
    typed = request.inputs[0].contents
    if datatype == "BYTES":
        return list(typed.bytes_contents)
    try:
        return bytes(typed.uint_contents)
    except ValueError:
        raise InvalidInput(f"Input '{INPUT_NAME}': UINT8 contents must be from 0 to 255.") from None


def parameter_value(parameter: service_pb2.InferParameter | None) -> object:
    """The value a parameter holds, whichever of its types; ``None`` for one absent or empty."""
    if parameter is None:
        return None
    choice = parameter.WhichOneof("parameter_choice")
    return None if choice is None else getattr(parameter, choice)
