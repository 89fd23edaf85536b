"""Images per request: the same photo sent as single requests and as requests of many, one server.

    python -m benchmarks.images_per_request                  # no-op model: the serving cost itself
    python -m benchmarks.images_per_request --duration 5

Does a request of 64 images cost the server less than 64 requests of one? vision-serve with a no-op
decoder and model (benchmarks.frontend_server, ``--api-servers 2``), so what is measured is what
every image costs around the model: HTTP, parsing, header checks, admission, the trip to the worker
and back, JSON. ``wrk`` sends, for ``--duration`` seconds each:

- ``predict-1``: ``POST /predict`` with the JPEG as the body, 64 connections;
- ``predict-64``: ``POST /predict`` multipart with 64 ``image`` fields, 1 and 2 connections;
- ``oip-64``: ``POST /v2/models/{name}/infer``, BYTES ``[64]`` in the binary extension, 1 and 2 connections.

For each: images per second, and the server's CPU time per image (every process of the server,
from /proc, wrk excluded). Results: ``images_per_request.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from benchmarks.frontend import (
    MODEL,
    WARMUP_S,
    Request,
    check_answer,
    image_request,
    make_target,
    run_wrk,
    running,
)
from benchmarks.harness.common import machine_record, results_dir, write_results
from service.client.launcher import free_port
from service.tune.images import IMAGENET_SIZE, photo_jpegs
from service.tune.loadgen import oip_images

logger = logging.getLogger(__name__)

IMAGES = 64
DURATION_S = 10.0
API_SERVERS = 2  # the best no-op configuration on 2 cores (frontend.md)
FORMS = {"predict-1": (1, (64,)), "predict-64": (IMAGES, (1, 2)), "oip-64": (IMAGES, (1, 2))}


@dataclass
class Row:
    form: str
    images_per_request: int
    connections: int
    requests_per_s: float
    images_per_s: float
    p50_ms: float
    p99_ms: float
    server_cpu_ms_per_image: float
    errors: int


def multipart_request(image: bytes, count: int) -> Request:
    boundary = uuid.uuid4().hex
    part = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="photo.jpg"\r\n'
        "Content-Type: image/jpeg\r\n\r\n"
    ).encode()
    body = b"".join(part + image + b"\r\n" for _ in range(count)) + f"--{boundary}--\r\n".encode()
    return Request("/predict", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})


def oip_request(image: bytes, count: int, model: str = MODEL) -> Request:
    """The binary tensor extension as tritonclient sends it: JSON header, then the BYTES elements."""
    body, headers = oip_images(image, count)
    return Request(f"/v2/models/{model}/infer", body, headers)


def request_for(form: str, image: bytes) -> Request:
    count = FORMS[form][0]
    if form == "predict-1":
        return image_request(image)
    return multipart_request(image, count) if form == "predict-64" else oip_request(image, count)


def server_cpu_s(pid: int) -> float:
    """User + system CPU seconds of the server's process and every descendant alive now."""
    total = 0.0
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def to_row(form: str, connections: int, raw: dict, cpu_s: float) -> Row:
    images = FORMS[form][0]
    seconds = raw["duration_us"] / 1e6
    images_done = raw["requests"] * images
    return Row(
        form=form,
        images_per_request=images,
        connections=connections,
        requests_per_s=round(raw["requests"] / seconds, 1),
        images_per_s=round(images_done / seconds, 1),
        p50_ms=round(raw["p50_us"] / 1e3, 2),
        p99_ms=round(raw["p99_us"] / 1e3, 2),
        server_cpu_ms_per_image=round(cpu_s * 1e3 / max(images_done, 1), 4),
        errors=raw["non_2xx"] + raw["socket_errors"],
    )


def measure(duration_s: float, forms: Sequence[str], workdir: Path) -> list[Row]:
    width, height = IMAGENET_SIZE
    image = photo_jpegs(width, height, ("chelsea",))[0]
    target = make_target(f"vision-serve-{API_SERVERS}", image, free_port(), lambda: Path())
    # The limit on images in flight must hold two 64-image requests; the default 256 does.
    url = f"http://127.0.0.1:{target.port}"
    rows = []
    with running(target, url, workdir / "server.log"):
        pid = _server_pid(target.port)
        for form in forms:
            request = request_for(form, image)
            check_answer(url, request)
            run_wrk(url, request, max(FORMS[form][1]), WARMUP_S, workdir)
            for connections in FORMS[form][1]:
                cpu_before = server_cpu_s(pid)
                raw = run_wrk(url, request, connections, duration_s, workdir)
                row = to_row(form, connections, raw, server_cpu_s(pid) - cpu_before)
                logger.info(
                    "%-10s %2d conn: %8.1f img/s  %.3f ms CPU/image  p50 %.2f ms  errors %d",
                    form,
                    connections,
                    row.images_per_s,
                    row.server_cpu_ms_per_image,
                    row.p50_ms,
                    row.errors,
                )
                rows.append(row)
    return rows


def _server_pid(port: int) -> int:
    """The main process of the server listening on ``port`` (the one whose children are the rest)."""
    for connection in psutil.net_connections("tcp"):
        if connection.laddr and connection.laddr.port == port and connection.status == psutil.CONN_LISTEN:
            process = psutil.Process(connection.pid)
            while process.parent() is not None and "frontend_server" in " ".join(process.parent().cmdline()):
                process = process.parent()
            return process.pid
    raise RuntimeError(f"no process listens on port {port}")


def render(rows: Sequence[Row], duration_s: float) -> str:
    lines = [
        f"# Images per request: no-op decoder and model, --api-servers {API_SERVERS}, wrk, {duration_s:g} s per row",
        "",
        "| form | images/request | connections | img/s | req/s | p50 ms | p99 ms | server CPU ms/image | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.form} | {r.images_per_request} | {r.connections} | {r.images_per_s:,.0f} | {r.requests_per_s:,.1f} | "
        f"{r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.server_cpu_ms_per_image:.3f} | {r.errors} |"
        for r in rows
    ]
    single = [r for r in rows if r.images_per_request == 1]
    if single:
        base = single[0]
        lines += ["", f"Against `predict-1` at {base.connections} connections (same run):", ""]
        lines += [
            f"- `{r.form}` x{r.connections}: {r.images_per_s / base.images_per_s:.2f}x the images per second, "
            f"{r.server_cpu_ms_per_image / base.server_cpu_ms_per_image:.2f}x the server CPU per image"
            for r in rows
            if r.images_per_request > 1
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=DURATION_S, help="seconds per row")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated (default: {','.join(FORMS)})")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if shutil.which("wrk") is None:
        parser.error("wrk is not installed: apt-get install wrk")
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        parser.error(f"unknown form(s) {unknown}: use {', '.join(FORMS)}")
    with tempfile.TemporaryDirectory(prefix="images-per-request-") as tmp:
        rows = measure(args.duration, forms, Path(tmp))
    record = {"machine": machine_record(), "duration_s": args.duration, "rows": [asdict(r) for r in rows]}
    out = results_dir(args.out)
    write_results(out, "images_per_request", record, render(rows, args.duration), text_suffix=".md")
    print(render(rows, args.duration))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
