"""A model repository of N copies of one artifact, a real ``vision-serve --model-repository`` serving it
on loopback, and what the benchmarks ask of it: a photo per model, the server's metrics by model.

The repository is ``ROOT/m001/1 ... ROOT/mNNN/1``, each version folder a symbolic link to the same
compile-trt artifact (the layout follows links: ``service/repository/layout.py`` takes any directory
named by a positive integer), or a copy of it (``copies=True``: no file pages shared between the
models, as different models would have). Every model's ``config.toml`` says ``max_batch_size``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from service.client.launcher import ServerProcess, ServerStartError

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
JPEG = {"Content-Type": "image/jpeg"}
REQUEST_TIMEOUT_S = 300.0  # longer than a model loaded on demand may take: the server's answer, not ours
WARM_PATIENCE_S = 60.0
METRIC_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})? (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def model_names(count: int) -> list[str]:
    """``m001``, ``m002``... : sorted by name as by number, so model 1 is the repository's first."""
    return [f"m{i:03d}" for i in range(1, count + 1)]


def compile_cached(output: Path, *args: str) -> Path:
    """``compile-trt ARGS --device cpu --output OUTPUT``; compile-trt itself finds an identical engine
    already in OUTPUT (a cache hit) and returns at once, so reruns do not recompile."""
    command = [sys.executable, "-m", "compile.cli", *args, "--device", "cpu", "--output", str(output)]
    logger.info("compile-trt %s (into %s)", " ".join(args), output)
    subprocess.run([*command, "--log-level", "warning"], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return output


def make_repository(root: Path, artifact: Path, count: int, max_batch_size: int, copies: bool = False) -> Path:
    """``root`` made afresh holding ``count`` models, each version 1 = ``artifact``."""
    if root.exists():
        shutil.rmtree(root)
    for name in model_names(count):
        folder = root / name
        folder.mkdir(parents=True)
        if copies:
            shutil.copytree(artifact, folder / "1")
        else:
            (folder / "1").symlink_to(artifact.resolve(), target_is_directory=True)
        (folder / "config.toml").write_text(f"max_batch_size = {max_batch_size}\n")
    return root


class ServerDidNotStart(RuntimeError):
    """The server exited or was not ready in time; ``reason`` is the line of its log that says why."""

    def __init__(self, reason: str, log_tail: str) -> None:
        super().__init__(reason)
        self.reason, self.log_tail = reason, log_tail


def start_reason(log_tail: str) -> str:
    """The most telling line of a failed start's log: the last error, or the last line."""
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    for line in reversed(lines):
        if "ERROR" in line or "error:" in line.lower() or "Not enough memory" in line:
            return line[-400:]
    return lines[-1][-400:] if lines else "no log"


def stop_all(server: ServerProcess) -> None:
    """SIGTERM and wait; then SIGKILL to whatever of its process group is still there (a worker left
    behind would hold memory the next measurement counts)."""
    with contextlib.suppress(Exception):
        server.stop()
    if server.process is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server.process.pid, 0)  # raises when no process of the group is left
        time.sleep(2.0)
        os.killpg(server.process.pid, signal.SIGKILL)
        logger.warning("Killed what was left of the server's process group %d.", server.process.pid)


@contextlib.contextmanager
def serving(
    repository: Path,
    extra_args: Sequence[str],
    log_path: Path,
    port: int | None = None,
    start_timeout_s: float = 900.0,
) -> Iterator[tuple[ServerProcess, float]]:
    """``vision-serve --model-repository REPOSITORY EXTRA_ARGS`` until ready; yields the server and
    the seconds it took to start. ``ServerDidNotStart`` if it exits or is not ready in time."""
    args = ["--model-repository", str(repository), "--log-level", "warning", *extra_args]
    server = ServerProcess(args, log_path=log_path, port=port, with_parent=True)
    started = time.monotonic()
    try:
        server.launch()
        try:
            server.wait_ready(start_timeout_s)
        except ServerStartError:
            tail = server.log_tail(60)
            raise ServerDidNotStart(start_reason(tail), tail) from None
        yield server, time.monotonic() - started
    finally:
        stop_all(server)


def predict(url: str, model: str, photo: bytes, client: httpx.Client) -> dict:
    """One photo to ``model``: status, client latency, the top labels, the answering version and the
    Server-Timing entries (whatever names the server sends: a load on demand may add its own)."""
    from service.tune.loadgen import parse_server_timing

    sent = time.perf_counter()
    try:
        response = client.post(f"{url}/predict", params={"model": model}, content=photo, headers=JPEG)
    except httpx.HTTPError as exc:
        return {"model": model, "status": None, "latency_ms": (time.perf_counter() - sent) * 1e3, "error": repr(exc)}
    latency_ms = (time.perf_counter() - sent) * 1e3
    answer = {
        "model": model,
        "status": response.status_code,
        "latency_ms": latency_ms,
        "server_timing_ms": parse_server_timing(response.headers.get("Server-Timing")),
    }
    if response.status_code == 200:
        body = response.json()
        answer["labels"] = [p["label"] for p in body.get("predictions", [])]
        answer["version"] = body.get("model_version")
    else:
        answer["error"] = response.text[:300]
    return answer


def warm_each(url: str, names: Sequence[str], photo: bytes, patience_s: float = WARM_PATIENCE_S) -> list[dict]:
    """One photo to each model in turn (every model warm), each answer as :func:`predict`'s, with
    ``retries_503``: /ready is one HTTP process's view, and another one may still see a model's
    worker as starting for a moment, so a 503 is retried for up to ``patience_s``."""
    answers = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        for name in names:
            deadline, retries = time.monotonic() + patience_s, 0
            answer = predict(url, name, photo, client)
            while answer["status"] == 503 and time.monotonic() < deadline:
                time.sleep(0.2)
                retries += 1
                answer = predict(url, name, photo, client)
            answers.append({**answer, "retries_503": retries})
    return answers


def metrics(url: str) -> list[tuple[str, dict[str, str], float]]:
    """``GET /metrics`` as ``(name, labels, value)`` samples."""
    samples = []
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        match = METRIC_LINE.match(line)
        if match:
            name, labels, value = match.groups()
            with contextlib.suppress(ValueError):
                samples.append((name, dict(LABEL.findall(labels or "")), float(value)))
    return samples


def images_by_model(url: str) -> dict[str, float]:
    """Images answered 200 so far per model (``vision_serve_model_images_total``)."""
    counts: dict[str, float] = {}
    for name, labels, value in metrics(url):
        if name == "vision_serve_model_images_total" and labels.get("code") == "200":
            counts[labels["model"]] = counts.get(labels["model"], 0.0) + value
    return counts
