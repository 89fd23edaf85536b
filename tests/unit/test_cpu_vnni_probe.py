"""Which CPUs count as having VNNI (compile/devices.py ``cpu_has_vnni``): where it answers no, int8
weights are quantized to 7 bits (compile/quantization/), which costs accuracy for nothing on a CPU that
has it. Fed /proc/cpuinfo texts of real processor families."""

from __future__ import annotations

from pathlib import Path

import pytest

from compile.devices import cpu_has_vnni

BASE_FLAGS = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2"
CPUS = {
    # Alder Lake and later client cores: AVX-VNNI (VEX-encoded) without AVX-512 (issue 64).
    "alder-lake": (f"{BASE_FLAGS} avx_vnni", True),
    # Sapphire Rapids, Zen 4: both.
    "sapphire-rapids": (f"{BASE_FLAGS} avx512f avx512bw avx512_vnni avx_vnni amx_int8", True),
    # Cascade Lake: AVX-512 VNNI only.
    "cascade-lake": (f"{BASE_FLAGS} avx512f avx512bw avx512_vnni", True),
    # Zen 2/3 EPYC, Haswell to Comet Lake: neither.
    "zen-3": (BASE_FLAGS, False),
    # A flag whose name only contains the word is not the extension.
    "lookalike": (f"{BASE_FLAGS} avx512vnni_unrelated", False),
}


@pytest.mark.parametrize("cpu", list(CPUS))
def test_vnni_is_read_from_either_flag(tmp_path: Path, cpu: str) -> None:
    flags, expected = CPUS[cpu]
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: {cpu}\nflags\t\t: {flags}\n\n")
    assert cpu_has_vnni(cpuinfo) is expected
