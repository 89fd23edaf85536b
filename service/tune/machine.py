"""What this machine offers the grid: its device, bf16 units, preprocessing libraries; and the defaults.

The defaults are what a user gets without tuning, resolved here: ``compile-trt --model X`` (its
``auto`` engine at fp32, batch 1,8,32) served by ``vision-serve --artifact`` with every default.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from compile.devices import cpu_has_bf16_units, cpu_name, parse_device
from compile.settings_errors import SettingsError
from service import _defaults as serve_defaults
from service.supervisor.planning.cores import usable_cores
from service.tune import _defaults
from service.tune.settings import TuneSettings
from service.tune.space import Candidate, SearchSpace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Machine:
    accelerator: str  # "cpu" or "cuda": where the tuned server runs
    gpu_count: int
    cpu_count: int
    bf16_native: bool  # CPU: AVX-512 bf16 or AMX units (else bf16 runs emulated)
    name: str

    @property
    def default_device(self) -> str:
        """What ``--device auto`` means to the server here."""
        return "cuda" if self.accelerator == "cuda" else "cpu"


def probe_machine(device_flag: str) -> Machine:
    gpus = torch.cuda.device_count()
    index = parse_device(device_flag, gpus)  # ValueError: a GPU asked for where there is none
    accelerator = "cpu" if index is None else "cuda"
    bf16 = cpu_has_bf16_units()
    name = torch.cuda.get_device_name(0) if accelerator == "cuda" else cpu_name()
    return Machine(accelerator, gpus, usable_cores(), bf16, name)


def default_engine(machine: Machine) -> str:
    """compile-trt's ``--backend auto`` at its default precision, on this machine."""
    from compile import _defaults as compile_defaults
    from compile.backends import resolve_compile_backend

    device = torch.device("cuda:0" if machine.accelerator == "cuda" else "cpu")
    backend, _ = resolve_compile_backend("auto", device, compile_defaults.DEFAULT_PRECISION)
    return f"{backend}-{compile_defaults.DEFAULT_PRECISION}"


def default_preprocess(machine: Machine) -> str:
    from preprocessing.registry import resolve_preprocess_backend

    backend, _ = resolve_preprocess_backend("auto", torch.device(machine.default_device.replace("cuda", "cuda:0")))
    return backend


def default_candidate(machine: Machine) -> Candidate:
    """The configuration of the defaults, with ``auto`` values resolved as the server resolves them."""
    return Candidate(
        engine=default_engine(machine),
        max_batch_size=serve_defaults.MAX_BATCH_SIZE,
        workers_per_device=serve_defaults.WORKERS_PER_DEVICE,
        batch_timeout_ms=serve_defaults.BATCH_TIMEOUT_MS,
        api_servers=serve_defaults.API_SERVERS,
        pipeline_depth=serve_defaults.PIPELINE_DEPTH,
        preprocess=default_preprocess(machine),
        device=machine.default_device,
    )


def preprocess_problem(backend: str, machine: Machine) -> str | None:
    from preprocessing.registry import backend_problem

    return backend_problem(backend, "cuda:0" if machine.accelerator == "cuda" else "cpu")


def build_grid(settings: TuneSettings, machine: Machine) -> tuple[SearchSpace, list[str]]:
    """The grid to search: the flags' lists, else this machine's defaults; and notes on what the
    defaults left out here and why."""
    given = settings.grid_values()
    gpu = machine.accelerator == "cuda"
    notes: list[str] = []
    engines = given.get("engines")
    if engines is None:
        engines = _defaults.GPU_ENGINES if gpu else _defaults.CPU_ENGINES
        if not gpu and not machine.bf16_native:
            engines = tuple(e for e in engines if not e.endswith("-bf16"))
            notes.append(
                "inductor-bf16 left out: this CPU has no AVX-512 bf16 or AMX units, so bf16 would run emulated "
                "(--engines inductor-bf16 measures it anyway)."
            )
        int8 = _defaults.GPU_INT8_ENGINES if gpu else _defaults.CPU_INT8_ENGINES
        if settings.calibration:
            engines = (*engines, *int8)
            notes.append(f"{', '.join(int8)} added: --calibration was given (calibrated on {settings.calibration}).")
        else:
            notes.append(
                f"{', '.join(int8)} left out: int8 engines are calibrated on images like the served ones; "
                "--calibration DIR adds them."
            )
    preprocess = given.get("preprocess")
    if preprocess is None:
        usable = []
        for backend in _defaults.GPU_PREPROCESS if gpu else _defaults.CPU_PREPROCESS:
            problem = preprocess_problem(backend, machine)
            if problem:
                notes.append(f"preprocessing {backend} left out: {problem}.")
            else:
                usable.append(backend)
        preprocess = tuple(usable) or ("pil",)
    else:
        for backend in preprocess:
            problem = preprocess_problem(backend, machine)
            if problem:
                raise SettingsError(
                    "--preprocess",
                    backend,
                    f"--preprocess {backend} cannot run here: {problem}.",
                    "Leave --preprocess out to try those this machine can run.",
                )
    devices = given.get("devices")
    if devices is None:
        devices = ("cuda:0", "cuda") if gpu and machine.gpu_count > 1 else (machine.default_device,)
    for device in devices:
        if (device == "cpu") == gpu:
            raise SettingsError(
                "--devices",
                device,
                f"--devices {device}: the tune runs on {machine.accelerator} (--device {settings.device}).",
                "Name devices of that kind, or change --device.",
            )
        parse_device(device, machine.gpu_count)
    pick = (lambda gpu_value, cpu_value: gpu_value) if gpu else (lambda gpu_value, cpu_value: cpu_value)
    values = {
        "engine": engines,
        "max_batch_size": given.get(
            "max_batch_sizes", pick(_defaults.GPU_MAX_BATCH_SIZES, _defaults.CPU_MAX_BATCH_SIZES)
        ),
        "workers_per_device": given.get(
            "workers_per_device", pick(_defaults.GPU_WORKERS_PER_DEVICE, _defaults.CPU_WORKERS_PER_DEVICE)
        ),
        "batch_timeout_ms": given.get(
            "batch_timeouts_ms", pick(_defaults.GPU_BATCH_TIMEOUTS_MS, _defaults.CPU_BATCH_TIMEOUTS_MS)
        ),
        "api_servers": given.get("api_servers", pick(_defaults.GPU_API_SERVERS, _defaults.CPU_API_SERVERS)),
        "pipeline_depth": given.get(
            "pipeline_depths", pick(_defaults.GPU_PIPELINE_DEPTHS, _defaults.CPU_PIPELINE_DEPTHS)
        ),
        "preprocess": preprocess,
        "device": devices,
    }
    values["batch_timeout_ms"] = tuple(float(v) for v in values["batch_timeout_ms"])
    return SearchSpace(values), notes


def engine_batch(space: SearchSpace) -> tuple[int, int, int]:
    """MIN,OPT,MAX of every engine compiled: compile-trt's default where the grid's batches fit in it."""
    largest = max([*space.values["max_batch_size"], _defaults.ENGINE_BATCH_MAX_AT_LEAST])
    return (_defaults.ENGINE_BATCH_MIN, _defaults.ENGINE_BATCH_OPT, largest)
