"""Two source trees' servers, the same requests, every difference in what they answer.

For refactors that must not change behaviour: a server from each tree (EfficientNet-Lite0, eager, on
the CPU) gets the same exchanges over ``/predict`` (raw, multipart, JSON, bad inputs from the test
corpus, wrong keys, limits), the Open Inference Protocol over HTTP (metadata, infer, bad tensors, the
repository extension's key checks) and over gRPC. Compared: status, headers and body, with what
differs by design masked (dates, request ids, timings, the gRPC port). Exits 1 on any difference.

    python -m benchmarks.protocol_diff --old /tmp/old-tree --new .

Each server runs from its tree (``cwd`` and ``PYTHONPATH``), so the old tree needs no install of its
own; both use this interpreter's packages.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import numpy as np
import tritonclient.grpc as triton_grpc
from PIL import Image

from service.client.launcher import free_port
from service.tune.images import photo_jpegs
from tests.bad_inputs import bad_inputs

logger = logging.getLogger(__name__)

MODEL = "efficientnet-lite0"
KEY, ADMIN_KEY = "inference-key", "admin-key"
MAX_BODY_BYTES = 2 * 1024 * 1024
STARTUP_TIMEOUT_S = 300.0
# What differs between two runs of the same tree: masked before comparing.
VARYING = re.compile(r'"(grpc_port|\w*_ms|\w*time\w*|duration\w*|id|request_id|uptime\w*|pid\w*)": ?[-0-9.e"a-zA-Z_:]+')
VARYING_HEADERS = {"date", "x-request-id", "server-timing", "content-length"}

Exchange = tuple[str, str, str, str]  # name, status, headers, body


def masked(body: bytes) -> str:
    return VARYING.sub(lambda match: f'"{match[1]}": X', body.decode("utf-8", "replace"))


def png_of(jpeg: bytes) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(jpeg)).save(out, "PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def http_exchanges(url: str, cat: bytes, coffee: bytes) -> list[Exchange]:
    key = {"x-api-key": KEY}
    infer = f"/v2/models/{MODEL}/infer"
    json_body = {**key, "content-type": "application/json"}

    def tensor(shape: int, datatype: str, data: list) -> dict:
        return {"inputs": [{"name": "IMAGE", "shape": [shape], "datatype": datatype, "data": data}]}

    two = tensor(2, "BYTES", [b64(cat), b64(coffee)])
    calls: list[tuple[str, Callable[[httpx.Client], httpx.Response]]] = [
        ("health", lambda c: c.get("/health")),
        ("ready", lambda c: c.get("/ready")),
        ("info without key", lambda c: c.get("/info")),
        ("info", lambda c: c.get("/info", headers=key)),
        ("predict raw", lambda c: c.post("/predict", content=cat, headers={**key, "content-type": "image/jpeg"})),
        ("predict top_k=3", lambda c: c.post("/predict?top_k=3", content=coffee, headers=key)),
        ("predict png", lambda c: c.post("/predict", content=png_of(cat), headers=key)),
        ("predict multipart", lambda c: c.post("/predict", files=[("image", cat), ("image", coffee)], headers=key)),
        ("predict json", lambda c: c.post("/predict", json={"image": b64(cat), "top_k": 2}, headers=key)),
        ("predict json many", lambda c: c.post("/predict", json={"images": [b64(cat), "!!"]}, headers=key)),
        ("predict empty", lambda c: c.post("/predict", content=b"", headers=key)),
        ("predict top_k=0", lambda c: c.post("/predict?top_k=0", content=cat, headers=key)),
        ("predict top_k=abc", lambda c: c.post("/predict?top_k=abc", content=cat, headers=key)),
        ("predict unknown model", lambda c: c.post("/predict?model=nope", content=cat, headers=key)),
        ("predict wrong key", lambda c: c.post("/predict", content=cat, headers={"x-api-key": "no"})),
        ("predict bad json", lambda c: c.post("/predict", content=b"{", headers=json_body)),
        ("predict too large", lambda c: c.post("/predict", content=b"x" * (MAX_BODY_BYTES + 1), headers=key)),
        ("v2", lambda c: c.get("/v2", headers=key)),
        ("v2 ready", lambda c: c.get("/v2/health/ready")),
        ("v2 model", lambda c: c.get(f"/v2/models/{MODEL}", headers=key)),
        ("v2 model ready", lambda c: c.get(f"/v2/models/{MODEL}/ready", headers=key)),
        ("v2 unknown model", lambda c: c.get("/v2/models/nope", headers=key)),
        ("oip infer", lambda c: c.post(infer, json=two, headers=key)),
        ("oip infer top_k", lambda c: c.post(infer, json={**two, "parameters": {"top_k": 2}}, headers=key)),
        ("oip FP32 input", lambda c: c.post(infer, json=tensor(1, "FP32", [1.0]), headers=key)),
        ("oip no inputs", lambda c: c.post(infer, json={}, headers=key)),
        ("oip bad json", lambda c: c.post(infer, content=b"{", headers=key)),
        ("oip shape mismatch", lambda c: c.post(infer, json=tensor(3, "BYTES", ["aa"]), headers=key)),
        ("oip unknown model", lambda c: c.post("/v2/models/nope/infer", json=two, headers=key)),
        ("oip not an image", lambda c: c.post(infer, json=tensor(1, "BYTES", [b64(b"no")]), headers=key)),
        ("repository index without key", lambda c: c.post("/v2/repository/index")),
        ("repository index, inference key", lambda c: c.post("/v2/repository/index", headers=key)),
        ("repository index, admin key", lambda c: c.post("/v2/repository/index", headers={"x-api-key": ADMIN_KEY})),
    ]  # fmt: skip
    for bad in bad_inputs():
        calls.append((f"bad input {bad.name}", lambda c, b=bad: c.post("/predict", content=b.body, headers=key)))
    exchanges = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for name, call in calls:
            response = call(client)
            headers = {k: v for k, v in sorted(response.headers.items()) if k.lower() not in VARYING_HEADERS}
            exchanges.append((name, str(response.status_code), json.dumps(headers), masked(response.content)))
    return exchanges


def grpc_exchanges(target: str, cat: bytes, coffee: bytes) -> list[Exchange]:
    client = triton_grpc.InferenceServerClient(target)
    key = {"x-api-key": KEY}

    def infer(files: list[bytes], datatype: str = "BYTES", model: str = MODEL) -> object:
        tensor = triton_grpc.InferInput("IMAGE", [len(files)], datatype)
        values = np.array(files, dtype=np.object_) if datatype == "BYTES" else np.zeros(len(files), np.float32)
        tensor.set_data_from_numpy(values)
        return client.infer(model, [tensor], headers=key).get_response(as_json=True)

    calls: list[tuple[str, Callable[[], object]]] = [
        ("grpc infer", lambda: infer([cat, coffee])),
        ("grpc one bad image", lambda: infer([cat, b"no"])),
        ("grpc FP32 input", lambda: infer([cat], "FP32")),
        ("grpc unknown model", lambda: infer([cat], model="nope")),
        ("grpc metadata", lambda: client.get_model_metadata(MODEL, headers=key, as_json=True)),
        ("grpc index, inference key", lambda: client.get_model_repository_index(headers=key, as_json=True)),
    ]
    calls += [(f"grpc bad input {b.name}", lambda b=b: infer([b.body])) for b in bad_inputs()[:12]]
    exchanges = []
    for name, call in calls:
        try:
            exchanges.append((name, "OK", "", masked(json.dumps(call(), sort_keys=True).encode())))
        except triton_grpc.InferenceServerException as exc:
            exchanges.append((name, str(exc.status()), "", str(exc.message())))
    client.close()
    return exchanges


def serve_and_exchange(tree: Path, log_path: Path) -> list[Exchange]:
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "VISION_SERVE_API_KEY": KEY, "VISION_SERVE_ADMIN_API_KEY": ADMIN_KEY, "PYTHONPATH": str(tree)}
    command = [sys.executable, "-m", "service.cli", "--model", MODEL, "--port", str(port)]
    command += ["--grpc-port", str(grpc_port), "--max-body-bytes", str(MAX_BODY_BYTES), "--api-servers", "1"]
    # One worker: with the default of a worker per core, a lone image runs on every idle worker's
    # threads, and a different thread count sums in another order (probabilities differ in the 7th digit).
    command += ["--workers-per-device", "1"]
    cat, coffee = photo_jpegs(500, 375, ("chelsea", "coffee"))
    with log_path.open("w") as log:
        server = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while time.monotonic() < deadline and server.poll() is None:
                try:
                    if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            else:
                raise RuntimeError(f"the server of {tree} did not get ready: see {log_path}")
            return http_exchanges(url, cat, coffee) + grpc_exchanges(f"127.0.0.1:{grpc_port}", cat, coffee)
        finally:
            server.terminate()
            server.wait(60)


def differences(old: list[Exchange], new: list[Exchange]) -> list[str]:
    found = []
    for before, after in zip(old, new, strict=True):
        if before != after:
            a, b = "|".join(before[1:]), "|".join(after[1:])
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            found.append(
                f"{before[0]}:\n  old: ...{a[max(0, at - 150) : at + 250]}\n  new: ...{b[max(0, at - 150) : at + 250]}"
            )
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="the tree before the change (e.g. a git worktree)")
    parser.add_argument("--new", type=Path, default=Path("."), help="the tree after it (default: this one)")
    parser.add_argument("--logs", type=Path, default=Path("/tmp"), help="where the two servers' logs go")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    old = serve_and_exchange(args.old.resolve(), args.logs / "protocol_diff-old.log")
    new = serve_and_exchange(args.new.resolve(), args.logs / "protocol_diff-new.log")
    found = differences(old, new)
    for difference in found:
        logger.info("DIFFERS %s", difference)
    logger.info("%d exchanges compared, %d differ", len(old), len(found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
