"""What this CPU is and the level the C kernels are built for: the flags, the ISA levels, the cap.

The C kernels (`csrc/`) are compiled for an ISA level, `kernel_isa()`: "avx512" (AVX-512
F/BW/DQ/VL: the panel and small-row matmuls, 16-lane loops), "avx2" (AVX2 + FMA: the row, MoE,
quantized and LoRA kernels, 8-lane loops), "baseline" (scalar C only) or "none" (no library).
It is the CPU's level from its flags, capped by ``BATCHGEN_CPU_ISA``, so any box can emulate a
lesser CPU kind (docs/cpu.md, "CPU kinds"). The build (`build.py`) asks here; what the built
library, oneDNN and ATen then run is `capability.py`'s question, above the build.
"""
from __future__ import annotations

import functools
import platform

from batchgen_data import env

# lowest first; a cap picks the lower of the CPU's level and the cap
LEVELS = ("none", "baseline", "avx2", "avx512")
# the flags each level needs (Linux /proc/cpuinfo names); x86-64-v3 / -v4 are the compilers'
# names for the same sets, so a capped build never uses an instruction the level lacks
NEEDS = {"avx2": ("avx2", "fma"),
         "avx512": ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl")}
MARCH = {"avx2": "x86-64-v3", "avx512": "x86-64-v4"}


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo has none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def native_isa() -> str:
    """The highest level of `LEVELS` this CPU runs ("baseline" off x86-64)."""
    flags = cpu_flags()
    for level in ("avx512", "avx2"):
        if _x86() and all(f in flags for f in NEEDS[level]):
            return level
    return "baseline"


def missing(level: str) -> list[str]:
    """The flags of `level` this CPU lacks (empty when it has them all)."""
    if level not in NEEDS:
        return []
    flags = cpu_flags()
    return [f for f in NEEDS[level] if f not in flags]


def kernel_isa() -> str:
    """The level the C kernels are built for: this CPU's, capped by ``BATCHGEN_CPU_ISA`` (a cap
    above the CPU changes nothing: a build never uses an instruction the CPU lacks)."""
    cap = env.cpu_isa()
    native = native_isa()
    if cap == "native":
        return native
    return LEVELS[min(LEVELS.index(cap), LEVELS.index(native))]


def kernel_march() -> str | None:
    """The ``-march`` of the C kernels' build: None for ``native`` (the CPU's own level), else
    the capped level's name (``x86-64-v3`` for "avx2")."""
    isa = kernel_isa()
    return None if isa == native_isa() else MARCH.get(isa)
