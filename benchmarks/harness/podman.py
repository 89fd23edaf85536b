"""podman driven from Python for the container tests (tests/container) and the image benchmark
(benchmarks/container_images.py): build the images as a user would (`make image`, deploy/podman/image.sh),
run them, wait for them to answer, read their logs."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from service.client.launcher import free_port

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = ROOT / "deploy/podman/containers.conf"
# What the images' volume holds (Dockerfile, Dockerfile.gpu: VOLUME).
VOLUME_PATH = "/var/lib/vision-serve"
CONTAINER_PORT = 8000


class PodmanError(RuntimeError):
    """A podman command failed; the message holds its output."""


def podman_env() -> dict[str, str]:
    """This process's environment, with the project's containers.conf unless CONTAINERS_CONF names one."""
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    return env


def podman(*args: str, timeout: float = 120, check: bool = True) -> str:
    """Run ``podman ARGS``; its stdout. Raises PodmanError with stderr when it fails and ``check``."""
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=podman_env())
    if check and result.returncode != 0:
        raise PodmanError(f"podman {' '.join(args)} exited {result.returncode}:\n{result.stderr[-4000:]}")
    return result.stdout


def clean_checkout(destination: Path, source: Path = ROOT) -> Path:
    """A copy of the files git tracks in ``source`` or would (not ignored), with their working-tree edits:
    what a fresh clone holds once they are committed. No .venv, no artifacts, no build leftovers."""
    command = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    listed = subprocess.run(command, cwd=source, capture_output=True, check=True, timeout=60)
    for name in listed.stdout.decode().split("\0"):
        if not name or not (source / name).exists():
            continue
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / name, target)
    return destination


@dataclass
class Build:
    """An image built by a command: its reference (the command's last line), seconds, and the log."""

    reference: str
    seconds: float
    log: str


def build(command: list[str], cwd: Path, timeout: float = 3600) -> Build:
    """Run an image build (``make image``, ``deploy/podman/image.sh gpu``); its last stdout line is the reference."""
    started = time.monotonic()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=podman_env())
    seconds = time.monotonic() - started
    if result.returncode != 0:
        hint = storage_hint() if "no space left on device" in result.stderr else ""
        raise PodmanError(f"{' '.join(command)} exited {result.returncode}:{hint}\n{result.stderr[-6000:]}")
    lines = result.stdout.strip().splitlines()
    return Build(lines[-1] if lines else "", seconds, result.stderr)


def storage_hint() -> str:
    """Where podman keeps its images and how much room is left there, with what frees it."""
    graph_root = podman("info", "--format", "{{.Store.GraphRoot}}", check=False).strip() or "/var/lib/containers"
    free_gb = shutil.disk_usage(graph_root if os.path.isdir(graph_root) else "/").free / 1e9
    return (
        f" the disk of podman's storage ({graph_root}) is full, {free_gb:.1f} GB free now. A build writes"
        " torch's layer (several GB) and then commits a copy of it. `podman system df` shows what images"
        " hold; `podman image prune` removes those no tag names (older builds)."
    )


def image_size(reference: str) -> int:
    """The image's size in bytes, as `podman images` reports it (all layers, uncompressed)."""
    return int(podman("image", "inspect", "--format", "{{.Size}}", reference).strip())


@dataclass
class Container:
    """A container started by :func:`run_container`, published on 127.0.0.1:``port``."""

    name: str
    port: int
    started: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        """What the container wrote to stdout and stderr, interleaved as it came."""
        result = subprocess.run(
            ["podman", "logs", self.name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=60,
            env=podman_env(),
        )
        return result.stdout

    def state(self) -> str:
        return podman("inspect", "--format", "{{.State.Status}}", self.name, check=False).strip()

    def exit_code(self) -> int:
        return int(podman("inspect", "--format", "{{.State.ExitCode}}", self.name).strip())

    def exec(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["podman", "exec", self.name, *command], capture_output=True, text=True, timeout=60, env=podman_env()
        )

    def stop(self, grace_s: int = 60) -> float:
        """``podman stop -t grace_s``: SIGTERM, then SIGKILL after the grace period. Seconds it took."""
        started = time.monotonic()
        podman("stop", "--time", str(grace_s), self.name, timeout=grace_s + 60)
        return time.monotonic() - started

    def remove(self) -> None:
        podman("rm", "--force", "--time", "0", self.name, check=False, timeout=120)

    def wait_answering(self, path: str = "/ready", timeout_s: float = 900) -> float:
        """Seconds from the container's start until ``path`` answers 200; raises with its log if it
        exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - self.started
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if self.state() not in ("running", "created", "configured", "initialized"):
                raise PodmanError(f"container {self.name} is {self.state()!r}, not answering:\n{self.logs()[-6000:]}")
            time.sleep(0.5)
        raise PodmanError(f"container {self.name}: {path} did not answer in {timeout_s:.0f} s:\n{self.logs()[-6000:]}")


def run_container(
    image: str,
    name: str,
    volume: str,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    read_only: bool = True,
) -> Container:
    """Start ``image`` as a user would: ``--init``, the named volume on the image's state folder, the port
    published on loopback and, with ``read_only``, a read-only root filesystem with a tmpfs /tmp."""
    port = free_port()
    command = ["run", "--detach", "--init", "--name", name, "--publish", f"127.0.0.1:{port}:{CONTAINER_PORT}"]
    command += ["--volume", f"{volume}:{VOLUME_PATH}"]
    if read_only:
        command += ["--read-only", "--tmpfs", "/tmp:rw,size=2g", "--shm-size", "1g"]
    for key, value in (env or {}).items():
        command += ["--env", f"{key}={value}"]
    podman("rm", "--force", "--time", "0", name, check=False)
    container = Container(name, port)
    podman(*command, image, *(args or []))
    return container
