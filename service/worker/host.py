"""A worker process, from its start to its end: it holds the engines of one or more models, each
a *model slot* with its own worker id, channel, batches and heartbeat, and serves them in turn.

The main process spawns each worker process with ``run_host`` as its target (service/supervisor/
pool/hosts.py) and sends it more slots to load, or slots to stop, over a pipe of its own
(``LoadSlot``, ``StopSlot``). Every slot tells the main process over the control channel
(service/transport/control_channel.py) that it is ready (with the memory its load took), or why its
load failed, and that its loop ended (EXITED): its version drained, or the main process stopped it.

Each slot's loop runs in a thread of its own (service/worker/loop.py); their batches take turns
(service/worker/turns.py), so one process serves many models one batch at a time, as one worker
serves one model. What the slots share: the process (torch, its allocator and threads, a GPU's CUDA
context), so a model's engine costs its weights and workspace, not a process. What they do not:
their queues, batches and failures. A model whose engine raises fails its own batches (500); one
that fails to load fails its own load; one that breaks the device (a sticky CUDA error) ends the
process, whose other models the main process then loads again in a new one, as when a process
crashes. A model that must not share that fate gets a process of its own (``isolation = "process"``:
``exit_when_empty``, the process ends with its only slot).
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import sys
import threading
from collections.abc import MutableSequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

from service.heap import load_malloc_trim
from service.parent_watch import exit_with_parent
from service.settings import ServeSettings
from service.transport.channels import ChannelConfig
from service.transport.control_channel import ERROR, EXITED, READY, WorkerReport, report_to_main_process
from service.worker.contract import BatchPolicy
from service.worker.entry import CLASSIFIER, WorkerEntry
from service.worker.loop import GreedyBatchedLoop
from service.worker.turns import ModelTurns, NoTurns

logger = logging.getLogger(__name__)

EXIT_SETUP_FAILED = 1
# What a setup error's message may take of the load call's answer (the traceback is in the log).
MAX_DETAIL_CHARS = 2000
# How often the process looks for a command while none comes (and whether its parent is gone).
COMMAND_POLL_S = 0.5


@dataclass(frozen=True)
class SlotSpec:
    """What a model version's workers run, the same in each of its worker processes."""

    settings: ServeSettings
    policy: BatchPolicy
    model: str = CLASSIFIER  # "module:Class" whose ``load(settings, device)`` returns the BatchedModel


@dataclass(frozen=True)
class LoadSlot:
    """Load ``spec``'s model in this process and serve it as worker ``worker_id``."""

    worker_id: int
    spec: SlotSpec


@dataclass(frozen=True)
class StopSlot:
    """Stop serving worker ``worker_id`` (what it still holds gets 503 from its HTTP process)."""

    worker_id: int


@dataclass(frozen=True)
class HostResources:
    """What every slot of a worker process shares, handed over at spawn (shared memory can only be
    inherited): the channels, the running-batch and heartbeat arrays, the main process's pid."""

    channels: ChannelConfig
    running: MutableSequence[int] | None
    heartbeats: MutableSequence[float] | None
    main_pid: int


def resident_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``), 0 where it cannot be read."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def device_free_bytes(device: object) -> int:
    """The free memory of ``device`` if it is a GPU (cudaMemGetInfo: what every library's allocations
    take, not torch's alone), else 0. Loads in other processes on the same GPU blur it."""
    if "cuda" not in str(device):
        return 0
    try:
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(str(device)))
        return int(free)
    except Exception:  # no CUDA here after all: the budget then counts nothing for it
        return 0


class WorkerHost:
    """The slots of one worker process: loads them (one at a time, so each load's memory is its
    own), runs each one's loop in a thread, stops them, and frees each once its loop ended."""

    def __init__(self, resources: HostResources, device: object, shared: bool) -> None:
        self.resources = resources
        self.device = device
        self.turns: ModelTurns | NoTurns = ModelTurns() if shared else NoTurns()
        self._load_lock = threading.Lock()
        self._lock = threading.Lock()
        self._stops: dict[int, threading.Event] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._trim = load_malloc_trim()
        self.setup_failed = False  # a slot's model failed to load (a process of its own then exits 1)

    @property
    def slots(self) -> int:
        with self._lock:
            return len(self._threads)

    def start(self, slot: LoadSlot) -> None:
        stop = threading.Event()
        thread = threading.Thread(target=self._serve, args=(slot, stop), name=f"model-{slot.worker_id}", daemon=True)
        with self._lock:
            self._stops[slot.worker_id] = stop
            self._threads[slot.worker_id] = thread
        thread.start()

    def stop(self, worker_id: int) -> None:
        with self._lock:
            stop = self._stops.get(worker_id)
        if stop is not None:
            stop.set()

    def _report(self, report: WorkerReport) -> bool:
        return report_to_main_process(self.resources.channels.directory, report)

    def _serve(self, slot: LoadSlot, stop: threading.Event) -> None:
        worker_id, spec = slot.worker_id, slot.spec
        resources = self.resources
        loop = GreedyBatchedLoop(resources.channels, spec.policy, resources.running, heartbeats=resources.heartbeats)
        entry = WorkerEntry(spec.settings, loop, spec.model)
        entry.worker_id = worker_id
        exit_code = 0
        try:
            with self._load_lock:
                try:
                    # The model's libraries first: the memory a load takes is then its engine's, not torch's.
                    importlib.import_module(spec.model.partition(":")[0])
                    before, device_before = resident_bytes(), device_free_bytes(self.device)
                    entry.load_model(self.device)
                except Exception as exc:
                    logger.exception("Inference worker %d could not load its model.", worker_id)
                    self.setup_failed = True
                    exit_code = EXIT_SETUP_FAILED
                    detail = f"{type(exc).__name__}: {exc}"[:MAX_DETAIL_CHARS]
                    self._report(WorkerReport(worker_id, ERROR, detail))
                    return
                grown = max(0, resident_bytes() - before)
                device_grown = max(0, device_before - device_free_bytes(self.device))
            entry.device = self.device
            report = WorkerReport(worker_id, READY, memory_bytes=grown, device_memory_bytes=device_grown)
            if not self._report(report):
                logger.warning("Inference worker %d: the main process did not take its ready report.", worker_id)
                return
            loop.serve(entry.model, worker_id, stop, self.turns)
        finally:
            self._free(entry)
            with self._lock:
                self._stops.pop(worker_id, None)
                self._threads.pop(worker_id, None)
            self._report(WorkerReport(worker_id, EXITED, exit_code=exit_code))

    def _free(self, entry: WorkerEntry) -> None:
        """What the slot's model held goes back to the process, and what the allocator can return,
        to the machine: the process may hold other models for weeks."""
        try:
            entry.release_model()
        except Exception:
            logger.exception("Releasing worker %s's model failed; its memory may stay taken.", entry.worker_id)
        gc.collect()
        if self._trim is not None:
            self._trim(0)


def run_host(resources: HostResources, device: object, commands: Connection, first: LoadSlot, shared: bool) -> None:
    """The worker process's target: set the process up, load ``first``, then take commands until
    the main process closes the pipe (or, in a process of one model's own, ``shared`` False, until
    that model's loop ended). It ends by itself if the main process is killed (service/parent_watch.py)."""
    exit_with_parent(resources.main_pid)
    process_entry = WorkerEntry(first.spec.settings, None, first.spec.model)
    process_entry.worker_id = first.worker_id  # names the process in its traces
    process_entry.setup_process()
    host = WorkerHost(resources, device, shared)
    host.start(first)
    while True:
        try:
            if commands.poll(COMMAND_POLL_S):
                command = commands.recv()
                if isinstance(command, LoadSlot):
                    host.start(command)
                elif isinstance(command, StopSlot):
                    host.stop(command.worker_id)
        except (EOFError, OSError):
            logger.info("Worker process %d: the main process closed its pipe; exiting.", os.getpid())
            return
        if not shared and host.slots == 0:
            sys.exit(EXIT_SETUP_FAILED if host.setup_failed else 0)
