"""What each process imports, and the contracts between the roles (issue 28).

The main process and the HTTP processes forked from it must not import torch (nor OpenAI Triton
through it): hundreds of MB per process and library noise at exit. The client must import with httpx
alone. Each case runs a fresh interpreter in which the blocked packages cannot be imported, so a
stray import anywhere along the chain fails here with the module that made it.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

from service.worker.classifier import Classifier
from service.worker.loop import BatchedModel

BLOCKING = """
import sys, traceback
BLOCKED = set(sys.argv[1].split(","))
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this process role")
sys.meta_path.insert(0, Blocked())
import importlib
failed = []
for module in sys.argv[2:]:
    try:
        importlib.import_module(module)
    except ImportError:
        failed.append(module)
        traceback.print_exc()
print("FAILED:", " ".join(failed), file=sys.stderr)
sys.exit(1 if failed else 0)
"""
TORCH = ["torch", "torchvision", "triton"]
# The client's own: what `pip install --no-deps vision-serve` plus httpx has (docs/http-api.md#clients).
SERVER_STACK = [*TORCH, "numpy", "PIL", "litserve", "fastapi", "starlette", "zmq", "prometheus_client", "grpc"]

MAIN_AND_HTTP_PROCESS_MODULES = [
    "service.cli",
    "service.supervisor.server",
    "service.http.process",
    "service.http.routes",
    "service.http.predict.routes",
    "service.http.oip.routes",
    "service.http.grpc.service",
    "service.transport.channels",
    "service.worker.entry",  # what LitServe unpickles in the main process and starts in each worker
]


def import_with_blocked(blocked: list[str], modules: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", BLOCKING, ",".join(blocked), *modules]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_main_and_http_process_modules_import_without_torch() -> None:
    # One interpreter for all of them (each import is tried on its own): a second per module would
    # cost a second each in the unit tier.
    run = import_with_blocked(TORCH, MAIN_AND_HTTP_PROCESS_MODULES)
    assert run.returncode == 0, f"these pull in torch:\n{run.stderr[-3000:]}"


def test_the_client_and_vision_classify_import_with_httpx_alone() -> None:
    run = import_with_blocked(SERVER_STACK, ["service.client.vision_client", "service.client.cli"])
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_blocker_itself_catches_a_torch_import() -> None:
    """The two tests above pass only because the blocker works: a module that needs torch fails."""
    run = import_with_blocked(TORCH, ["service.worker.classifier"])
    assert run.returncode != 0 and "torch" in run.stderr and "blocked in this process role" in run.stderr


def test_the_classifier_has_what_the_worker_loop_calls() -> None:
    """``Classifier`` is the loop's ``BatchedModel``: same methods, same parameters."""
    for name, member in inspect.getmembers(BatchedModel, inspect.isfunction):
        if name.startswith("_"):
            continue
        ours = getattr(Classifier, name, None)
        assert ours is not None, f"Classifier has no {name}()"
        wanted = list(inspect.signature(member).parameters)
        assert len(inspect.signature(ours).parameters) == len(wanted), (name, wanted)
