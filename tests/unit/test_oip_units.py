"""The Open Inference Protocol's request and response forms, without a server (service/oip*.py).

The requests here are built by tritonclient itself where it can build them offline (its HTTP
client's request body), so the parser is checked against the real client's bytes.
"""

from __future__ import annotations

import base64
import json
import struct

import numpy as np
import pytest
import tritonclient.http as triton_http
from tritonclient.grpc import service_pb2

from service.errors import ServiceError
from service.http.base.observer import client_request_id
from service.http.grpc.proto_request import parse_grpc_request
from service.http.oip.json_request import parse_infer_body
from service.http.oip.routes import decompress, encode_infer_response, model_in_path
from service.http.oip.tensors import (
    CLASS_INDICES,
    LABELS,
    LOGITS,
    PROBABILITIES,
    InferCall,
    RequestedOutput,
    build_outputs,
    deserialize_bytes,
    failed_items,
    model_metadata,
    serialize_bytes,
)
from service.wire import LOGITS_DTYPE, Answer

LIMIT = 64


def tritonclient_body(inputs, outputs=None, **kwargs) -> tuple[bytes, str | None]:
    """The body and Inference-Header-Content-Length tritonclient.http would send."""
    body, json_size = triton_http.InferenceServerClient.generate_request_body(inputs, outputs=outputs, **kwargs)
    return body, None if json_size is None else str(json_size)


def bytes_input(files: list[bytes], binary: bool = True, shape: list[int] | None = None) -> triton_http.InferInput:
    shape = shape or [len(files)]
    tensor = triton_http.InferInput("IMAGE", shape, "BYTES")
    values = files if binary else [base64.b64encode(f) for f in files]
    tensor.set_data_from_numpy(np.array(values, dtype=np.object_).reshape(shape), binary_data=binary)
    return tensor


def test_binary_bytes_from_tritonclient() -> None:
    body, header_length = tritonclient_body([bytes_input([b"\xff\xd8one", b"\x89PNGtwo"])])
    assert header_length is not None
    call = parse_infer_body(body, header_length, LIMIT)
    assert call.images == [b"\xff\xd8one", b"\x89PNGtwo"]
    # No outputs named: all three, binary (tritonclient asks with binary_data_output).
    assert [(o.name, o.binary) for o in call.outputs] == [(LABELS, True), (PROBABILITIES, True), (CLASS_INDICES, True)]


def test_json_base64_of_shape_n_by_1_and_outputs_with_classification() -> None:
    outputs = [
        triton_http.InferRequestedOutput("LABELS", binary_data=False),
        triton_http.InferRequestedOutput("PROBABILITIES", binary_data=True, class_count=3),
    ]
    body, header_length = tritonclient_body([bytes_input([b"a", b"b"], binary=False, shape=[2, 1])], outputs)
    call = parse_infer_body(body, header_length, LIMIT)
    assert call.images == [b"a", b"b"]
    assert call.outputs == [RequestedOutput(LABELS, False, None), RequestedOutput(PROBABILITIES, True, 3)]


def test_uint8_rows_as_in_tritons_dali_examples() -> None:
    tensor = triton_http.InferInput("IMAGE", [2, 4], "UINT8")
    tensor.set_data_from_numpy(np.frombuffer(b"abc\x00defg", dtype=np.uint8).reshape(2, 4))
    call = parse_infer_body(*tritonclient_body([tensor]), LIMIT)
    assert call.images == [b"abc\x00", b"defg"]  # padding stays; decoders stop at the image's end
    one = json.dumps({"inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": [3], "data": [1, 2, 3]}]})
    assert parse_infer_body(one.encode(), None, LIMIT).images == [b"\x01\x02\x03"]


def test_top_k_parameter_and_request_id() -> None:
    body = {"id": "r-1", "parameters": {"top_k": 3}, "inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1]}]}
    body["inputs"][0]["data"] = [base64.b64encode(b"x").decode()]
    call = parse_infer_body(json.dumps(body).encode(), None, LIMIT)
    assert call.top_k == 3 and call.request_id == "r-1"


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda r: r["inputs"][0].update(name="INPUT0"), "one input, 'IMAGE'"),
        (lambda r: r["inputs"][0].update(datatype="FP32"), "datatype must be BYTES"),
        (lambda r: r["inputs"][0].update(shape=[2]), "needs 2 elements, got 1"),
        (lambda r: r["inputs"][0].update(shape=[1, 2]), "[N] or [N, 1]"),
        (lambda r: r["inputs"][0].update(data=["@@@"]), "not base64"),
        (lambda r: r["inputs"][0].pop("data"), '"data" (JSON) or a "binary_data_size"'),
        (
            lambda r: r.update(outputs=[{"name": "SCORES"}]),
            "Unknown output 'SCORES': the model's outputs are LABELS, PROBABILITIES, CLASS_INDICES, LOGITS",
        ),
        (lambda r: r.update(outputs=[{"name": "LABELS", "parameters": {"classification": 0}}]), "classification"),
        (lambda r: r.update(parameters={"top_k": "5"}), "top_k"),
        (lambda r: r.update(inputs=[]), 'needs "inputs"'),
        (lambda r: r.update(outputs=[{"name": ["LABELS"]}]), "Unknown output ['LABELS']"),
        (lambda r: r.update(outputs=[{"name": "LABELS", "parameters": {"binary_data": "false"}}]), "true or false"),
        (lambda r: r.update(parameters={"binary_data_output": 1}), "true or false"),
        (lambda r: r.update(outputs=[{"name": "LABELS", "parameters": {"classification": 2}}]), "not LABELS"),
        (lambda r: r["inputs"][0].update(shape=[True]), "non-negative integers"),
        (lambda r: r["inputs"][0].update(datatype="UINT8", shape=[1, 0], data=[]), "length 0"),
    ],
)
def test_malformed_requests_are_400_and_say_what_is_wrong(mutate, words) -> None:
    request = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["eA=="]}]}
    mutate(request)
    with pytest.raises(ServiceError) as caught:
        parse_infer_body(json.dumps(request).encode(), None, LIMIT)
    assert caught.value.status == 400 and words in caught.value.message


def test_binary_framing_errors() -> None:
    body, header_length = tritonclient_body([bytes_input([b"abc"])])
    with pytest.raises(ServiceError, match="binary_data_size"):
        parse_infer_body(body + b"extra", header_length, LIMIT)
    with pytest.raises(ServiceError, match="Inference-Header-Content-Length"):
        parse_infer_body(body, str(len(body) + 1), LIMIT)
    with pytest.raises(ServiceError, match="runs past the data"):
        deserialize_bytes(struct.pack("<I", 10) + b"short")


def test_too_many_images_is_413() -> None:
    body, header_length = tritonclient_body([bytes_input([b"x"] * 5)])
    with pytest.raises(ServiceError) as caught:
        parse_infer_body(body, header_length, 4)
    assert caught.value.status == 413 and "--max-images-per-request" in caught.value.message


def test_bytes_serialization_round_trips() -> None:
    elements = [b"", b"a", bytes(range(256)) * 3]
    assert deserialize_bytes(serialize_bytes(elements)) == elements


def answer(*predictions: tuple[int, str, float]) -> Answer:
    return Answer(predictions=tuple(predictions), model="m", engine="e")


def test_outputs_are_n_by_k_best_first_and_classification_strings() -> None:
    answers = [
        answer((285, "Egyptian cat", 0.5), (281, "tabby", 0.25)),
        answer((967, "espresso", 0.75), (968, "cup", 0.125)),
    ]
    outputs = [RequestedOutput(LABELS), RequestedOutput(PROBABILITIES), RequestedOutput(CLASS_INDICES, True, 1)]
    tensors = build_outputs(InferCall([b"", b""], 2, outputs), answers)
    assert [t.shape for t in tensors] == [[2, 2], [2, 2], [2, 1]]
    assert tensors[0].values == [b"Egyptian cat", b"tabby", b"espresso", b"cup"]
    assert tensors[1].values == [0.5, 0.25, 0.75, 0.125]
    assert tensors[2].values == [b"0.500000:285:Egyptian cat", b"0.750000:967:espresso"]


def test_http_response_binary_and_json_parts_parse_with_tritonclient() -> None:
    answers = [answer((1, "goldfish", 0.5), (2, "great white shark", 0.25))]
    outputs = [
        RequestedOutput(LABELS, binary=True),
        RequestedOutput(PROBABILITIES),
        RequestedOutput(CLASS_INDICES, True),
    ]
    call = InferCall([b""], 2, outputs, request_id="abc")
    body, header_length = encode_infer_response("m", 1, call, build_outputs(call, answers))
    result = triton_http.InferResult.from_response_body(body, header_length=header_length)
    assert result.as_numpy(LABELS).tolist() == [[b"goldfish", b"great white shark"]]
    assert result.as_numpy(PROBABILITIES).tolist() == [[0.5, 0.25]]
    assert result.as_numpy(CLASS_INDICES).dtype == np.int64 and result.as_numpy(CLASS_INDICES).tolist() == [[1, 2]]
    assert result.get_response()["id"] == "abc"


def test_a_failed_item_fails_the_request_naming_it() -> None:
    failed_items([answer((1, "a", 1.0))])  # nothing failed: no error
    with pytest.raises(ServiceError) as caught:
        failed_items([answer((1, "a", 1.0)), Answer(status_code=415, detail="not an image"), None])
    assert (
        caught.value.status == 400 and "Image(s) 1 " in caught.value.message and "not an image" in caught.value.message
    )
    with pytest.raises(ServiceError) as caught:
        failed_items([Answer(status_code=415, detail="bad"), Answer(status_code=504, detail="late")])
    assert caught.value.status == 504  # a server-side failure is the request's own status


def test_model_and_version_from_the_path() -> None:
    assert model_in_path("/v2/models/resnet152/infer") == ("resnet152", None)
    assert model_in_path("/v2/models/resnet152/versions/1/infer") == ("resnet152", "1")


def test_grpc_request_raw_contents_and_parameters() -> None:
    request = service_pb2.ModelInferRequest(model_name="m", id="x")
    tensor = request.inputs.add(name="IMAGE", datatype="BYTES", shape=[2])
    del tensor  # the data travels in raw_input_contents, as tritonclient.grpc sends it
    request.raw_input_contents.append(serialize_bytes([b"one", b"two"]))
    request.parameters["top_k"].int64_param = 7
    output = request.outputs.add(name="CLASS_INDICES")
    output.parameters["classification"].int64_param = 2
    call = parse_grpc_request(request, LIMIT)
    assert call.images == [b"one", b"two"] and call.top_k == 7 and call.request_id == "x"
    assert call.outputs == [RequestedOutput(CLASS_INDICES, True, 2)] and call.worker_top_k == 7


def test_grpc_request_typed_contents() -> None:
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="IMAGE", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"file")
    assert parse_grpc_request(request, LIMIT).images == [b"file"]
    with pytest.raises(ServiceError, match="UINT8"):
        request = service_pb2.ModelInferRequest(model_name="m")
        request.inputs.add(name="IMAGE", datatype="UINT8", shape=[2]).contents.uint_contents.extend([1, 300])
        parse_grpc_request(request, LIMIT)


def one_request_both_ways(
    datatype: str, shape: list[int], files: list[bytes], outputs: list[tuple[str, int | None]], top_k: object
) -> tuple[bytes, service_pb2.ModelInferRequest]:
    """The same infer request as HTTP's binary extension and as a ModelInferRequest (raw contents)."""
    raw = b"".join(files) if datatype == "UINT8" else serialize_bytes(files)
    # gRPC sends every output raw: so does this body.
    parameters = {"binary_data_output": True} | ({} if top_k is None else {"top_k": top_k})
    wanted = [
        {"name": name, "parameters": {"binary_data": True, **({} if c is None else {"classification": c})}}
        for name, c in outputs
    ]
    tensor = {"name": "IMAGE", "datatype": datatype, "shape": shape, "parameters": {"binary_data_size": len(raw)}}
    header = json.dumps({"inputs": [tensor], "outputs": wanted, "parameters": parameters}).encode()
    proto = service_pb2.ModelInferRequest(model_name="m")
    proto.inputs.add(name="IMAGE", datatype=datatype, shape=shape)
    proto.raw_input_contents.append(raw)
    for name, classification in outputs:
        output = proto.outputs.add(name=name)
        if classification is not None:
            output.parameters["classification"].int64_param = classification
    if top_k is not None:
        proto.parameters["top_k"].int64_param = top_k
    return header + raw, proto


@pytest.mark.parametrize(
    ("datatype", "shape", "files", "outputs", "top_k"),
    [
        ("BYTES", [2], [b"one", b"two"], [(LABELS, None), (LOGITS, 3)], 7),  # good
        ("UINT8", [2, 3], [b"one", b"two"], [], None),  # good, the default outputs
        ("FP32", [1], [b"one"], [], None),  # the datatype
        ("BYTES", [1, 2], [b"one"], [], None),  # the shape
        ("BYTES", [0], [], [], None),  # no image
        ("BYTES", [LIMIT + 1], [b"x"] * (LIMIT + 1), [], None),  # too many: 413
        ("BYTES", [3], [b"one", b"two"], [], None),  # fewer elements than the shape says
        ("UINT8", [2, 0], [], [], None),  # rows of nothing
        ("BYTES", [1], [b"one"], [("SCORES", None)], None),  # an unknown output, after the input's faults
        ("BYTES", [1], [b"one"], [(LABELS, 2)], None),  # classification on LABELS
        ("BYTES", [1], [b"one"], [(LOGITS, 0)], None),  # classification out of range
        ("BYTES", [1], [b"one"], [(LABELS, None)], 0),  # top_k out of range
        ("FP32", [1], [b"one"], [("SCORES", None)], 0),  # several faults: the input's is the answer
    ],
)
def test_http_and_grpc_build_the_same_call_and_answer_the_same_first_fault(
    datatype, shape, files, outputs, top_k
) -> None:
    """One builder behind both transports: the same request sent either way is the same call, or the
    same error (status and message)."""
    body, proto = one_request_both_ways(datatype, shape, files, outputs, top_k)
    header_length = str(len(body) - len(proto.raw_input_contents[0]))
    answers = []
    for parse in (lambda: parse_infer_body(body, header_length, LIMIT), lambda: parse_grpc_request(proto, LIMIT)):
        try:
            answers.append(parse())
        except ServiceError as error:
            answers.append((error.status, str(error)))
    assert answers[0] == answers[1]


def test_a_huge_shape_is_refused_before_any_work() -> None:
    """[3e9, 1] UINT8 rows of nothing, or a billion BYTES elements: 413 from the shape, at once."""
    for tensor in (
        {"name": "IMAGE", "datatype": "UINT8", "shape": [3_000_000_000, 1], "data": [1]},
        {"name": "IMAGE", "datatype": "BYTES", "shape": [1_000_000_000], "data": ["eA=="]},
    ):
        with pytest.raises(ServiceError) as caught:
            parse_infer_body(json.dumps({"inputs": [tensor]}).encode(), None, LIMIT)
        assert caught.value.status == 413


@pytest.mark.parametrize("header_length", ["\u00b2", "9" * 5000, "-1", "12x"])
def test_odd_header_lengths_are_400(header_length) -> None:
    with pytest.raises(ServiceError) as caught:
        parse_infer_body(b"{}", header_length, LIMIT)
    assert caught.value.status == 400


def test_no_outputs_named_means_all_of_them() -> None:
    request = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["eA=="]}], "outputs": []}
    call = parse_infer_body(json.dumps(request).encode(), None, LIMIT)
    assert [o.name for o in call.outputs] == [LABELS, PROBABILITIES, CLASS_INDICES]


def test_compressed_bodies_inflate_within_the_limit() -> None:
    import gzip
    import zlib

    body, _ = tritonclient_body([bytes_input([b"x"], binary=False)])
    assert decompress(gzip.compress(body), "gzip", 10_000) == body
    assert decompress(zlib.compress(body), "deflate", 10_000) == body
    with pytest.raises(ServiceError) as caught:  # 10 MB of zeros in a few kB: refused past the limit
        decompress(gzip.compress(bytes(10_000_000)), "gzip", 1_000_000)
    assert caught.value.status == 413
    with pytest.raises(ServiceError) as caught:
        decompress(body, "br", 10_000)
    assert caught.value.status == 415


def test_grpc_request_ids_follow_the_http_rules() -> None:
    assert client_request_id("trace-1.2:3") == "trace-1.2:3"
    for bad in ("x\nFAKE LOG LINE", "y" * 200, "", None):
        new = client_request_id(bad)
        assert new != bad and len(new) == 32


# --- LOGITS: the model's whole output, only when named (issue 61, part 5) -------------------------------

ROWS = np.array([[0.5, -2.25, 3.0], [-1.0, 4.5, 0.125]], dtype=np.float32)
THREE = ("cat", "coffee", "rocket")


def logits_answers() -> list[Answer]:
    return [
        Answer(predictions=((2, "rocket", 0.9),), logits=ROWS[0].astype(LOGITS_DTYPE).tobytes()),
        Answer(predictions=((1, "coffee", 0.8),), logits=ROWS[1].astype(LOGITS_DTYPE).tobytes()),
    ]


def test_logits_is_asked_for_only_when_named_and_an_unknown_output_lists_it() -> None:
    request = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["eA=="]}]}
    assert not parse_infer_body(json.dumps(request).encode(), None, LIMIT).wants_logits, "not among the defaults"
    request["outputs"] = [{"name": "LOGITS", "parameters": {"classification": 2}}]
    call = parse_infer_body(json.dumps(request).encode(), None, LIMIT)
    assert call.wants_logits and call.outputs == [RequestedOutput(LOGITS, False, 2)] and call.worker_top_k == 5
    grpc_request = service_pb2.ModelInferRequest(model_name="m")
    grpc_request.inputs.add(name="IMAGE", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"file")
    output = grpc_request.outputs.add(name="LOGITS")
    output.parameters["classification"].int64_param = 3  # what tritonclient.grpc's class_count sends
    assert parse_grpc_request(grpc_request, LIMIT).outputs == [RequestedOutput(LOGITS, True, 3)]
    request["outputs"] = [{"name": "SCORES"}]
    with pytest.raises(ServiceError, match="PROBABILITIES, CLASS_INDICES, LOGITS") as caught:
        parse_infer_body(json.dumps(request).encode(), None, LIMIT)
    assert caught.value.status == 400


def test_logits_tensor_json_and_binary_parse_back_with_tritonclient() -> None:
    for binary in (False, True):
        call = InferCall([b"", b""], 1, [RequestedOutput(LOGITS, binary), RequestedOutput(LABELS)])
        tensors = build_outputs(call, logits_answers(), THREE)
        assert (tensors[0].datatype, tensors[0].shape) == ("FP32", [2, 3])
        body, header_length = encode_infer_response("m", 1, call, tensors)
        result = triton_http.InferResult.from_response_body(body, header_length=header_length)
        (logits_output,) = [o for o in result.get_response()["outputs"] if o["name"] == LOGITS]
        assert ("data" not in logits_output) is binary
        back = result.as_numpy(LOGITS)
        assert back.dtype == np.float32 and np.array_equal(back, ROWS)


def test_classification_of_logits_is_tritons_value_index_label_strings() -> None:
    tensors = build_outputs(InferCall([b"", b""], 1, [RequestedOutput(LOGITS, False, 2)]), logits_answers(), THREE)
    assert tensors[0].datatype == "BYTES" and tensors[0].shape == [2, 2]
    assert tensors[0].values == [
        b"3.000000:2:rocket",
        b"0.500000:0:cat",
        b"4.500000:1:coffee",
        b"0.125000:2:rocket",
    ]
    unlabelled = build_outputs(InferCall([b""], 1, [RequestedOutput(LOGITS, False, 9)]), logits_answers()[1:])
    assert unlabelled[0].values == [b"4.500000:1", b"0.125000:2", b"-1.000000:0"]  # k past C: C, as Triton


def test_model_metadata_lists_logits_with_the_classes() -> None:
    outputs = {o["name"]: o for o in model_metadata("m", [1], "eager", 3)["outputs"]}
    assert outputs[LOGITS] == {"name": LOGITS, "datatype": "FP32", "shape": [-1, 3]}
