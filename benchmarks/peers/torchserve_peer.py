"""TorchServe as the peer in our benchmarks, set up the way the well-known TorchServe blog did it.

The blog's setup: a plain ``torch.jit.trace`` of ResNet-152, TorchServe's built-in ``image_classifier``
handler, batch size 8 (or no batching), TorchServe's default queue settings. This module builds that
model from *our* weights (``compile.weights.load_model``, so both servers serve the same function),
archives it with ``torch-model-archiver``, and runs ``torchserve`` as a child process we own.

What TorchServe 0.12.0 does by default on a CPU-only machine (read from the installed ``ts`` package
and the frontend's ``ConfigManager``/``WorkerLifeCycle`` classes in ``model-server.jar``):

* Workers per model: ``default_workers_per_model`` if set, else the number of GPUs, else the JVM's
  ``Runtime.availableProcessors()``, i.e. one Python worker process per logical core (2 here).
  ``minWorkers``/``maxWorkers`` in the ``models`` JSON override it for one model.
* Torch threads per worker: TorchServe sets none. Neither the worker (``ts/model_service_worker.py``)
  nor the handlers call ``torch.set_num_threads``; the frontend only sets ``OMP_NUM_THREADS`` for
  ``torchrun`` (multi-process "parallelType") models, and the CPU launcher that pins cores
  (``cpu_launcher_enable``) is off by default. So each worker uses torch's default intra-op pool, one
  thread per core: the default N workers x N threads oversubscribes an N-core machine.
* Queue: ``job_queue_size`` 100 per model (requests beyond it get 503), ``maxBatchDelay`` 100 ms,
  ``batchSize`` 1, response timeout 120 s.
* The handler (``ts/torch_handler/image_classifier.py`` on ``vision_handler.py`` and
  ``base_handler.py``): ``torch.jit.load`` of the ``.pt`` file, run as TorchScript under
  ``torch.inference_mode()``; no ``torch.compile``, no channels_last (only its IPEX path, off unless
  ``TS_IPEX_ENABLE=true``, converts to channels_last). Preprocessing per image in Python with PIL:
  ``Image.open`` and a full-size decode (no JPEG draft mode), torchvision ``Resize(256)`` (bilinear,
  antialiased, on the PIL image), ``CenterCrop(224)``, ``ToTensor``, ImageNet ``Normalize``, then
  ``torch.stack`` of the batch. No ``.convert("RGB")``: grayscale or RGBA images fail. Postprocessing:
  softmax and top-5, answered as ``{"label": probability}`` JSON per request.
* ``vision_handler.py`` imports ``captum`` at module level (for its explanations API), so the default
  image handler needs the ``captum`` package installed next to TorchServe even though it never uses it.

Quirks this module works around:

* ``torchserve --start`` keeps a pid file at ``$TMPDIR/.model_server.pid`` and refuses to start a
  second server while it names a live one; the frontend puts its worker sockets
  (``.ts.sock.9000``, ...) and unpacked archives in ``java.io.tmpdir``. We give each run its own
  temporary folder (``TMPDIR`` and ``TEMP``, which the launcher passes on as ``-Djava.io.tmpdir``).
* Logs go to ``$LOG_LOCATION``/``$METRICS_LOCATION``, else to ``./logs`` in the working directory; we
  set both and run in ``workdir``.
* Token authorization is on by default since 0.11 (keys in ``key_file.json`` in the working directory);
  ``disable_token_authorization=true`` turns it off.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import psutil
import torch

from compile import sample_photo_file

logger = logging.getLogger(__name__)

MODEL_NAME = "resnet152"
MODEL_VERSION = "1.0"
HANDLER = "image_classifier"
STARTUP_TIMEOUT_S = 300.0  # JVM start + two workers each loading a 230 MB TorchScript file on 2 cores
STOP_TIMEOUT_S = 60.0
# TorchServe's own defaults, restated so that callers can record what the peer ran with.
TORCHSERVE_DEFAULT_MAX_BATCH_DELAY_MS = 100
# A worker whose handler cannot load is restarted forever with back-off; after this many deaths
# during startup we stop waiting and show the log instead of sitting out the whole timeout.
MAX_WORKER_DEATHS_WHILE_STARTING = 4


def _console_script(name: str) -> Path:
    """A console script of this virtualenv: the one installed next to the running interpreter."""
    return Path(sys.executable).parent / name


# ---- the model ----------------------------------------------------------------------------------


def export_torchscript(model_name: str, weights: str, path: Path) -> Path:
    """Trace ``model_name`` with our loader's ``weights`` on a 1x3x224x224 input and save it to ``path``."""
    from compile import get_model_entry, load_model

    module = load_model(get_model_entry(model_name), weights).module.eval()
    example = torch.zeros(1, 3, 224, 224)
    # A plain trace, as in the blog: no freezing, no channels_last, no optimize_for_inference.
    with torch.no_grad():
        traced = torch.jit.trace(module, example)
    path.parent.mkdir(parents=True, exist_ok=True)
    traced.save(str(path))
    logger.info("Saved TorchScript %s (%s weights) to %s", model_name, weights, path)
    return path


def index_to_name(labels: Sequence[str]) -> dict[str, str]:
    """TorchServe's ``index_to_name.json`` content: ``{"0": "tench", ...}``.

    ``ts.utils.util.load_label_mapping`` accepts a label or a list whose last item is the label
    (``["n01440764", "tench"]``); our catalog has names only, so we write plain strings.
    """
    return {str(index): label for index, label in enumerate(labels)}


def build_mar(
    torchscript_path: Path,
    model_store: Path,
    model_name: str = MODEL_NAME,
    *,
    labels: Sequence[str] | None = None,
) -> Path:
    """Archive ``torchscript_path`` with the default ``image_classifier`` handler into ``model_store``.

    ``labels`` default to the catalog's labels of ``model_name``.
    """
    # BaseHandler picks TorchScript only for a file named *.pt; anything else fails to load.
    if torchscript_path.suffix != ".pt":
        raise ValueError(f"TorchServe loads TorchScript only from a '.pt' file, not {torchscript_path.name!r}")
    if labels is None:
        from compile import get_model_entry

        labels = get_model_entry(model_name).labels
    model_store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ts-extra-") as extra_dir:
        # The handler looks for exactly this file name at the archive's root.
        mapping_path = Path(extra_dir) / "index_to_name.json"
        mapping_path.write_text(json.dumps(index_to_name(labels)))
        command = [
            str(_console_script("torch-model-archiver")),
            "--model-name",
            model_name,
            "--version",
            MODEL_VERSION,
            "--serialized-file",
            str(torchscript_path),
            "--handler",
            HANDLER,
            "--extra-files",
            str(mapping_path),
            "--export-path",
            str(model_store),
            "--force",
        ]
        logger.info("Archiving: %s", " ".join(command))
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"torch-model-archiver failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    mar = model_store / f"{model_name}.mar"
    if not mar.is_file():
        raise RuntimeError(f"torch-model-archiver succeeded but wrote no {mar}")
    return mar


# ---- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TorchServeConfig:
    batch_size: int = 8  # 1 = no batching (TorchServe's default)
    max_batch_delay_ms: int = TORCHSERVE_DEFAULT_MAX_BATCH_DELAY_MS
    workers: int | None = None  # None = TorchServe's default (one per core on a CPU machine)
    model_name: str = MODEL_NAME
    vmargs: str | None = None  # JVM options, e.g. "-Xmx1g"; None = the JVM's defaults, as TorchServe ships

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {self.batch_size}")
        if self.max_batch_delay_ms < 0:
            raise ValueError(f"max_batch_delay_ms must be 0 or more, not {self.max_batch_delay_ms}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be at least 1 or None, not {self.workers}")


@dataclass(frozen=True)
class TorchServePorts:
    inference: int
    management: int
    metrics: int

    @classmethod
    def free(cls, host: str = "127.0.0.1") -> TorchServePorts:
        # All three sockets stay bound until all are chosen, so the OS cannot hand out one port twice.
        with contextlib.ExitStack() as stack:
            sockets = [stack.enter_context(socket.socket()) for _ in range(3)]
            for sock in sockets:
                sock.bind((host, 0))
            inference, management, metrics = (sock.getsockname()[1] for sock in sockets)
        return cls(inference=inference, management=management, metrics=metrics)


def _properties_value(value: str) -> str:
    # java.util.Properties treats a backslash as an escape; nothing else in our values is special.
    return value.replace("\\", "\\\\")


def config_properties(config: TorchServeConfig, ports: TorchServePorts, model_store: Path) -> str:
    """The ``config.properties`` text that serves ``config.model_name`` from ``model_store``.

    Only what the benchmark needs differs from TorchServe's defaults; ``job_queue_size`` and the
    response timeout are left at theirs.
    """
    model: dict[str, object] = {
        "defaultVersion": True,
        "marName": f"{config.model_name}.mar",
        "batchSize": config.batch_size,
        "maxBatchDelay": config.max_batch_delay_ms,
    }
    if config.workers is not None:
        model["minWorkers"] = config.workers
        model["maxWorkers"] = config.workers
    models = {config.model_name: {MODEL_VERSION: model}}
    lines = [
        "# Written by benchmarks/peers/torchserve_peer.py",
        f"inference_address=http://127.0.0.1:{ports.inference}",
        f"management_address=http://127.0.0.1:{ports.management}",
        f"metrics_address=http://127.0.0.1:{ports.metrics}",
        f"model_store={_properties_value(str(model_store))}",
        f"load_models={config.model_name}.mar",
        f"models={json.dumps(models, separators=(',', ':'))}",
        # Token auth (on by default since 0.11) would demand a generated key on every request.
        "disable_token_authorization=true",
        # The model is registered at startup through load_models; the management API's
        # register/unregister calls are not needed, so it keeps its default (disabled).
        "enable_model_api=false",
    ]
    if config.workers is not None:
        lines.append(f"default_workers_per_model={config.workers}")
    if config.vmargs:
        lines.append(f"vmargs={config.vmargs}")
    return "\n".join(lines) + "\n"


# ---- the server process -------------------------------------------------------------------------


class TorchServeStartError(RuntimeError):
    pass


def _probe_jpeg() -> bytes:
    """A small real JPEG for the readiness check: the full decode/preprocess/model path must work."""
    from PIL import Image

    gradient = Image.linear_gradient("L").resize((320, 240))
    image = Image.merge("RGB", (gradient, gradient.rotate(90), gradient.rotate(180)))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


class TorchServeProcess:
    """``with TorchServeProcess(config, model_store, workdir) as ts: httpx.post(ts.predict_url, ...)``

    Runs ``torchserve --start --foreground`` in its own session: the launcher (Python) starts the
    Java frontend, which starts one Python worker per model worker. Everything it writes (logs,
    ``config.properties``, the pid file, worker sockets, unpacked archives) lands under ``workdir``.
    """

    def __init__(self, config: TorchServeConfig, model_store: Path, workdir: Path) -> None:
        self.config = config
        self.model_store = model_store.resolve()
        self.workdir = workdir.resolve()
        self.ports = TorchServePorts.free()
        self.config_path = self.workdir / "config.properties"
        self.log_path = self.workdir / "torchserve.log"  # the frontend's stdout: its log and the workers'
        self.logs_dir = self.workdir / "logs"  # log4j's files: ts_log, model_log, access_log, metrics
        self.tmp_dir = self.workdir / "tmp"
        self.inference_url = f"http://127.0.0.1:{self.ports.inference}"
        self.management_url = f"http://127.0.0.1:{self.ports.management}"
        self.predict_url = f"{self.inference_url}/predictions/{config.model_name}"
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._java: psutil.Process | None = None
        self._log: IO[bytes] | None = None

    # -- start ------------------------------------------------------------------------------------

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> TorchServeProcess:
        for directory in (self.workdir, self.logs_dir, self.tmp_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(config_properties(self.config, self.ports, self.model_store))
        env = {
            **os.environ,
            "LOG_LOCATION": str(self.logs_dir),
            "METRICS_LOCATION": str(self.logs_dir),
            # The launcher's pid file (tempfile.gettempdir()) and the JVM's java.io.tmpdir (from TEMP):
            # private to this run, so a second TorchServe on the machine cannot collide with it.
            "TMPDIR": str(self.tmp_dir),
            "TEMP": str(self.tmp_dir),
        }
        command = [
            str(_console_script("torchserve")),
            "--start",
            "--foreground",
            "--ncs",
            "--model-store",
            str(self.model_store),
            "--ts-config",
            str(self.config_path),
        ]
        self._log = self.log_path.open("wb")
        logger.info("Starting: %s (in %s)", " ".join(command), self.workdir)
        started = time.monotonic()
        # A new session: every process TorchServe starts stays in it, so teardown can find them all
        # even after the frontend dies and its workers are re-parented.
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            env=env,
            start_new_session=True,
        )
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        logger.info("TorchServe ready in %.1f s; workers %s", self.startup_s, self.pids()[1:])
        return self

    def wait_ready(self, timeout: float) -> None:
        """Until every worker the model wants is READY and one real prediction has succeeded."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as client:
            while True:
                self._check_alive()
                if self._workers_ready(client):
                    break
                if time.monotonic() > deadline:
                    raise TorchServeStartError(
                        f"TorchServe's workers were not ready after {timeout:.0f} s:\n{self.log_tail()}"
                    )
                time.sleep(1.0)
            # The first request also pays for TorchScript's profiling runs; allow it the rest of the time.
            remaining = max(deadline - time.monotonic(), 30.0)
            response = client.post(
                self.predict_url,
                content=_probe_jpeg(),
                headers={"Content-Type": "image/jpeg"},
                timeout=remaining,
            )
            if response.status_code != 200:
                raise TorchServeStartError(
                    f"TorchServe's workers are ready but a prediction failed: {response.status_code} "
                    f"{response.text[:500]}\n{self.log_tail()}"
                )

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise TorchServeStartError(
                f"torchserve exited with code {self.process.returncode} while starting:\n{self.log_tail()}"
            )
        lines = self._log_lines()
        deaths = sum("Backend worker process died" in line for line in lines)
        if deaths >= MAX_WORKER_DEATHS_WHILE_STARTING:
            # The first failure shows the handler's traceback; later ones repeat it.
            first = next((i for i, line in enumerate(lines) if "Failed to load model" in line), max(len(lines) - 40, 0))
            excerpt = "\n".join(lines[first : first + 40])
            raise TorchServeStartError(
                f"TorchServe's workers died {deaths} times while loading the model; the first failure "
                f"(full log: {self.log_path}):\n{excerpt}"
            )

    def _workers_ready(self, client: httpx.Client) -> bool:
        try:
            response = client.get(f"{self.management_url}/models/{self.config.model_name}")
        except httpx.TransportError:
            return False  # the frontend is not listening yet
        if response.status_code != 200:
            return False  # 404 until load_models has registered it
        description = response.json()[0]
        statuses = [worker.get("status") for worker in description.get("workers", [])]
        wanted = max(int(description.get("minWorkers", 1)), 1)
        return statuses.count("READY") >= wanted

    # -- inspection -------------------------------------------------------------------------------

    def java_process(self) -> psutil.Process | None:
        """The frontend JVM: the launcher's child running org.pytorch.serve.ModelServer."""
        if self._java is not None and self._java.is_running():
            return self._java
        if self.process is None or self.process.poll() is not None:
            return None
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.process.pid).children():
                if "org.pytorch.serve.ModelServer" in child.cmdline():
                    self._java = child
                    return child
        return None

    def pids(self) -> list[int]:
        """The JVM's pid, then its descendants' (Python workers, metric collectors) at this moment.

        Workers can be restarted with new pids, so take this when the measurement starts. The
        launcher process only waits for the JVM and is left out.
        """
        java = self.java_process()
        if java is None:
            return []
        with contextlib.suppress(psutil.Error):
            return [java.pid, *(child.pid for child in java.children(recursive=True))]
        return [java.pid]

    def session_processes(self) -> list[psutil.Process]:
        """Every live process in the session we started (empty after a clean stop)."""
        if self.process is None:
            return []
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if os.getsid(proc.pid) == self.process.pid and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        return found

    def _log_lines(self) -> list[str]:
        """The frontend's stdout without the access and request-metric lines our own polling causes."""
        if self._log is not None:
            self._log.flush()
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return [line for line in text.splitlines() if " ACCESS_LOG - " not in line and " TS_METRICS - " not in line]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self._log_lines()[-lines:])

    # -- stop -------------------------------------------------------------------------------------

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> list[int]:
        """Stop the JVM with SIGTERM (its shutdown hook stops the workers), then kill any leftover.

        ``torchserve --stop`` is not used: it finds the server through the pid file and would only
        do the same SIGTERM. Returns the pids that had to be killed (empty on a clean stop).
        """
        if self.process is None:
            return []
        java = self.java_process()
        if java is not None:
            with contextlib.suppress(psutil.Error):
                java.terminate()
                try:
                    java.wait(timeout)
                except psutil.TimeoutExpired:
                    logger.error("TorchServe's JVM did not stop within %.0f s of SIGTERM; killing it.", timeout)
                    java.kill()
        # The launcher returns once the JVM has exited; SIGTERM it in case the JVM was never found.
        if self.process.poll() is None:
            try:
                self.process.wait(10.0)
            except subprocess.TimeoutExpired:
                self.process.terminate()
                self.process.wait(10.0)
        killed = self._kill_leftovers()
        if self._log is not None:
            self._log.close()
            self._log = None
        return killed

    def _kill_leftovers(self) -> list[int]:
        leftovers = self.session_processes()
        if not leftovers:
            return []
        logger.warning(
            "TorchServe left processes behind: %s; terminating them.",
            ", ".join(f"{p.pid} ({p.name()})" for p in leftovers),
        )
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(leftovers, timeout=10.0)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=10.0)
        still = self.session_processes()
        if still:
            logger.error("Processes of TorchServe's session still alive after SIGKILL: %s", [p.pid for p in still])
        return [p.pid for p in leftovers]

    def __enter__(self) -> TorchServeProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# ---- smoke test ---------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe_workers(server: TorchServeProcess) -> None:
    """What TorchServe chose on its own: worker count and each worker's thread settings."""
    description = httpx.get(f"{server.management_url}/models/{server.config.model_name}", timeout=10).json()[0]
    print(
        f"model: batchSize={description.get('batchSize')} maxBatchDelay={description.get('maxBatchDelay')} "
        f"minWorkers={description.get('minWorkers')} maxWorkers={description.get('maxWorkers')} "
        f"workers={len(description.get('workers', []))}"
    )
    java = server.java_process()
    if java is not None:
        print(f"JVM pid {java.pid}: RSS {java.memory_info().rss / 2**20:.0f} MiB")
    for child in java.children() if java else []:
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(child.cmdline())
            if "model_service_worker" not in cmdline:
                continue
            omp = child.environ().get("OMP_NUM_THREADS", "unset")
            print(
                f"worker pid {child.pid}: RSS {child.memory_info().rss / 2**20:.0f} MiB, "
                f"OS threads={child.num_threads()}, OMP_NUM_THREADS={omp}"
            )


def smoke(batch_size: int, requests: int, weights: str, workdir: Path | None) -> int:
    with contextlib.ExitStack() as stack:
        root = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ts-peer-")))
        started = time.monotonic()
        torchscript = export_torchscript(MODEL_NAME, weights, root / "artifacts" / f"{MODEL_NAME}.pt")
        print(f"exported TorchScript in {time.monotonic() - started:.1f} s: {torchscript}")
        started = time.monotonic()
        mar = build_mar(torchscript, root / "model_store")
        print(f"built {mar.name} ({mar.stat().st_size / 1e6:.0f} MB) in {time.monotonic() - started:.1f} s")

        config = TorchServeConfig(batch_size=batch_size)
        server = TorchServeProcess(config, root / "model_store", root / "torchserve")
        server.start()
        try:
            print(f"TorchServe ready in {server.startup_s:.1f} s at {server.predict_url}; pids {server.pids()}")
            _describe_workers(server)
            image = sample_photo_file("chelsea")
            with httpx.Client(timeout=120.0) as client, ThreadPoolExecutor(max_workers=requests) as pool:

                def post(_: int) -> httpx.Response:
                    return client.post(server.predict_url, content=image, headers={"Content-Type": "image/jpeg"})

                started = time.monotonic()
                # Concurrent, so that the frontend can form batches of batch_size.
                responses = list(pool.map(post, range(requests)))
                wall = time.monotonic() - started
            print(f"status codes: {[r.status_code for r in responses]}")
            print(f"first response: {responses[0].text.strip()}")
            print(f"{requests} concurrent requests took {wall:.2f} s (functional check, not a benchmark)")
            pids = server.pids()
        finally:
            started = time.monotonic()
            killed = server.stop()
        print(f"stopped in {time.monotonic() - started:.1f} s; had to kill: {killed or 'none'}")
        left = sorted({*(pid for pid in pids if _alive(pid)), *(p.pid for p in server.session_processes())})
        print(f"TorchServe processes left: {left or 'none'} (checked {pids} and the session)")
        print(f"logs: {server.logs_dir}" if workdir else "logs: removed with the temporary folder")
        ok = all(r.status_code == 200 for r in responses) and not left
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="export, archive, start, send requests, stop")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--weights", default="random", help="'random', 'imagenet' or a state_dict path")
    parser.add_argument("--workdir", type=Path, help="keep everything here instead of a temporary folder")
    args = parser.parse_args(argv)
    if not args.smoke:
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the output
    return smoke(args.batch_size, args.requests, args.weights, args.workdir)


if __name__ == "__main__":
    sys.exit(main())
