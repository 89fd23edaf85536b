"""What a device is: the ``--device`` flag, the CPU or GPU an engine is built for, and where its code runs."""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path

import torch

from compile.settings_errors import SettingsError

logger = logging.getLogger(__name__)

CPUINFO = Path("/proc/cpuinfo")


def cpu_name() -> str:
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_device(device: torch.device) -> dict[str, str]:
    """What an engine compiled for ``device`` is tied to: the type, a name, and the capability.

    CPU code from AOTInductor uses the vector ISA of the build machine (AVX512 here); GPU code
    (TensorRT engines, Triton kernels) is built for one compute capability.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return {"type": "cuda", "name": torch.cuda.get_device_name(index), "capability": f"sm_{major}{minor}"}
    return {
        "type": "cpu",
        "name": cpu_name(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "isa": cpu_isa(),
    }


@functools.cache
def cpu_isa() -> str:
    """The instruction sets AOTInductor compiles CPU code for here, e.g. ``avx512 avx512_vnni avx512_bf16``.

    Finer than torch's capability: an AVX-512 CPU without VNNI, bf16 or AMX (Skylake-SP) reports
    the same ``AVX512`` but cannot run code built with those extensions.
    """
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        tokens = str(pick_vec_isa()).split()
    except Exception as exc:  # torch._inductor.exc.InvalidCxxCompiler: inductor test-builds with g++
        # Images without a C++ compiler (the CPU image) still describe their CPU: inductor's names from
        # torch's own probes. AOTInductor itself needs the compiler and says so when it runs.
        logger.debug("inductor cannot probe the vector ISA (%s): reading torch's CPU probes instead", exc)
        tokens = probed_vec_isa()
    tokens += [token for token in ("avx512_bf16", "amx_tile") if token not in tokens and cpu_has(token)]
    return " ".join(tokens)


def probed_vec_isa() -> list[str]:
    """Inductor's vector-ISA names for this CPU (``avx512 avx512_vnni``, ``avx2``), from torch's CPU
    probes rather than a test build: what pick_vec_isa answers where a compiler is present."""
    import torch.cpu

    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        if not torch.cpu._is_vnni_supported():
            return ["avx512"]
        # inductor's VecAMX (an AVX512-VNNI CPU with AMX tiles) names itself "avx512 avx512_vnni amx_tile".
        return ["avx512", "avx512_vnni", "amx_tile"] if cpu_has("amx_tile") else ["avx512", "avx512_vnni"]
    if capability == "AVX2":
        return ["avx2"]
    return [capability.lower()] if capability not in ("DEFAULT", "") else []


def cpu_flags(cpuinfo: str) -> set[str] | None:
    """The first processor's ``flags`` in ``/proc/cpuinfo``'s text; ``None`` when it has none."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


@functools.cache
def cpu_has_vnni(cpuinfo: Path = CPUINFO) -> bool:
    """Whether this CPU has VNNI (AVX512-VNNI or AVX-VNNI): integer dot products that sum u8 x s8 pairs in
    32 bits. Without it ONNX Runtime's int8 kernels sum pairs in 16 bits, which saturates with full-range
    int8 weights (quantization/onnx_qdq.py then quantizes weights to 7 bits). ``cpuinfo``: the text to
    read the flags from (a test's); torch's probe where it has none."""
    try:
        flags = cpu_flags(cpuinfo.read_text())
    except OSError:
        flags = None
    if flags is not None:
        return "avx512_vnni" in flags or "avx_vnni" in flags
    import torch.cpu

    return bool(torch.cpu._is_vnni_supported())


# CPU extensions torch can probe, by their /proc/cpuinfo name: the probe's name in torch.cpu (torch 2.11
# onwards) or, in older releases, in torch._C._cpu.
CPU_FEATURE_PROBES = {"avx512_bf16": "_is_avx512_bf16_supported", "amx_tile": "_is_amx_tile_supported"}


def cpu_has(feature: str) -> bool:
    """Whether this CPU has ``feature`` (a key of CPU_FEATURE_PROBES), as torch sees it."""
    import torch.cpu

    probe = CPU_FEATURE_PROBES[feature]
    for module in (torch.cpu, torch._C._cpu):
        if hasattr(module, probe):
            return bool(getattr(module, probe)())
    return False


def cpu_has_bf16_units() -> bool:
    """Whether this CPU runs bf16 math in hardware (AVX-512 bf16 or AMX); elsewhere torch emulates it."""
    return cpu_has("avx512_bf16") or cpu_has("amx_tile")


def emulated_bf16(precision: str, device_type: str) -> str | None:
    """Why a ``precision`` engine on a ``device_type`` device runs slowly here, or None when it does not:
    bf16 on a CPU without bf16 units runs emulated."""
    if precision != "bf16" or device_type != "cpu" or cpu_has_bf16_units():
        return None
    return (
        "bf16 runs emulated on this CPU: it has no AVX-512 bf16 or AMX units, so each bf16 operation "
        "goes through conversions to fp32 and back, and the engine runs many times slower than in fp32. "
        "bf16 pays off on CPUs with those units (Intel Cooper Lake, Sapphire Rapids and later; AMD Zen 4 "
        "and later) and on GPUs."
    )


ALL_GPUS = -1


def parse_device(device: str, cuda_count: int) -> int | None:
    """``--device`` -> None for the CPU, ``ALL_GPUS`` for ``cuda``, N for ``cuda:N``; errors say how to fix.

    ``auto`` is every GPU torch sees, else the CPU. GPU numbers are torch's (within CUDA_VISIBLE_DEVICES).
    """
    if device == "auto":
        device = "cuda" if cuda_count > 0 else "cpu"
    if device == "cpu":
        return None
    if cuda_count == 0:
        raise SettingsError(
            "--device", device, f"--device {device} asks for a GPU, but torch sees none.", "Use --device cpu or auto."
        )
    if device == "cuda":
        return ALL_GPUS
    index = device.removeprefix("cuda:")
    if not index.isdigit() or int(index) >= cuda_count:
        raise SettingsError(
            "--device",
            device,
            f"--device {device}: there are {cuda_count} GPUs.",
            f"Use cuda:0 .. cuda:{cuda_count - 1}, or cuda for every one.",
        )
    return int(index)


# torch's CPU capabilities from least to most: code built for one runs where a later one is reported.
CPU_CAPABILITY_ORDER = ("DEFAULT", "AVX2", "AVX512")


def cpu_isa_runs_here(built_for: str, here: str) -> bool:
    """Whether CPU code built for the ISA tokens ``built_for`` runs on a CPU offering ``here``."""
    return set(built_for.split()) <= set(here.split())


def cpu_capability_runs_here(built_for: str, here: str) -> bool:
    if built_for == here:
        return True
    if built_for in CPU_CAPABILITY_ORDER and here in CPU_CAPABILITY_ORDER:
        return CPU_CAPABILITY_ORDER.index(built_for) <= CPU_CAPABILITY_ORDER.index(here)
    return False
