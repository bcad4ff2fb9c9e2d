"""Builds and loads the C kernels for the CPU (`csrc/*.c` next to this file, with the shared
`*.h`), and the callers' own C sources over them (`extension`: the runner's C decode stack).

The kernels are plain C (no torch headers) and build in about a second with the system C
compiler (``$CC``, else ``cc``) into one shared library under ``<cache_dir>/cpu_kernels/``. The
file name is keyed by the sources, the flags and this CPU's feature flags, so a cache shared
between different machines never loads a binary built for another CPU (``-march=native``).
``BATCHGEN_CPU_ISA`` caps the build (`isa.kernel_march`: ``-march=x86-64-v3`` for an
AVX2-only build on an AVX-512 machine; ``none``: no library), to emulate a lesser CPU kind.
Builds are atomic (temp file + rename), so concurrent Ray/Spark workers are safe. With no
compiler or a failed build, `library()` returns None and every caller keeps its torch path.

The library's OpenMP calls resolve to the ``libgomp.so.1`` that torch has already loaded, so
the kernels and torch share one thread pool.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from batchgen_data import env
from batchgen_data.kernels.cpu import isa

log = logging.getLogger(__name__)

SOURCES = tuple(sorted((Path(__file__).with_name("csrc")).glob("*.c")))
HEADERS = tuple(sorted((Path(__file__).with_name("csrc")).glob("*.h")))  # in the cache key
# -ffp-contract=off: no multiply-adds fused behind the code's back (norm_rope.c relies on it to
# match torch bit for bit; the vector kernels spell their FMAs out).
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-ffp-contract=off"]


def _flags() -> list[str]:
    """`FLAGS` with ``-march=native`` replaced by the capped level's ``-march`` when
    ``BATCHGEN_CPU_ISA`` is below this CPU's (`isa.kernel_march`)."""
    march = isa.kernel_march()
    return [f"-march={march}" if f == "-march=native" and march else f for f in FLAGS]


def _cpu_signature() -> str:
    flags = isa.cpu_flags()
    return " ".join(sorted(flags)) if flags else platform.processor()


def _build(compiler: str, out: Path, sources: tuple[Path, ...] = SOURCES,
           link: tuple[str, ...] = ()) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_flags(), *map(str, sources), "-o", tmp, *link, "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.bg_paged_decode_f32.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64,
                                        i64, ctypes.c_float, c_int]
    lib.bg_paged_decode_f32.restype = c_int
    lib.bg_paged_decode_supports.argtypes = [i64]
    lib.bg_paged_decode_supports.restype = c_int
    lib.bg_small_gemm_f32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, c_int]
    lib.bg_small_gemm_f32.restype = c_int
    lib.bg_small_gemm_supported.argtypes = []
    lib.bg_small_gemm_supported.restype = c_int
    lib.bg_panel_gemm_f32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, c_int]
    lib.bg_panel_gemm_f32.restype = c_int
    lib.bg_panel_gemm_supported.argtypes = []
    lib.bg_panel_gemm_supported.restype = c_int
    lib.bg_panel_pack_f32.argtypes = [ptr, ptr, i64, i64, c_int]
    lib.bg_panel_pack_f32.restype = None
    lib.bg_panel_packed_floats.argtypes = [i64, i64]
    lib.bg_panel_packed_floats.restype = i64
    lib.bg_add_rms_norm_f32.argtypes = [ptr, ptr, ptr, ctypes.c_float, ptr, ptr, i64, i64, c_int]
    lib.bg_add_rms_norm_f32.restype = None
    lib.bg_rotate_f32.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr]
    lib.bg_rotate_f32.restype = None
    lib.bg_silu_mul_f32.argtypes = [ptr, ptr, i64, i64, c_int]
    lib.bg_silu_mul_f32.restype = None
    lib.bg_rows_gemm_supported.argtypes = []
    lib.bg_rows_gemm_supported.restype = c_int
    lib.bg_rows_gemm_f32.argtypes = [ptr, ptr, ptr, i64, i64, i64, c_int]
    lib.bg_rows_gemm_f32.restype = c_int
    lib.bg_moe_experts_supported.argtypes = []
    lib.bg_moe_experts_supported.restype = c_int
    lib.bg_moe_experts_workspace.argtypes = [i64] * 4
    lib.bg_moe_experts_workspace.restype = i64
    lib.bg_moe_experts_f32.argtypes = [ptr] * 7 + [i64] * 5 + [c_int]
    lib.bg_moe_experts_f32.restype = c_int
    lib.bg_quant_gemm_supported.argtypes = []
    lib.bg_quant_gemm_supported.restype = c_int
    lib.bg_quant_gemm_f32.argtypes = [ptr] * 4 + [ctypes.c_float, ptr] + [i64] * 4 + [c_int] * 2
    lib.bg_quant_gemm_f32.restype = c_int
    lib.bg_quant_dequant_f32.argtypes = [ptr] * 3 + [ctypes.c_float, ptr] + [i64] * 3 + [c_int] * 2
    lib.bg_quant_dequant_f32.restype = c_int
    lib.bg_lora_supported.argtypes = []
    lib.bg_lora_supported.restype = c_int
    lib.bg_lora_f32.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, ptr, ptr,
                                ptr, i64, c_int]
    lib.bg_lora_f32.restype = c_int


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first use; None when it cannot be built here or
    ``BATCHGEN_CPU_ISA=none`` keeps the C kernels out."""
    if isa.kernel_isa() == "none":
        log.info("BATCHGEN_CPU_ISA=none: no CPU kernels; using the torch paths")
        return None
    compiler = env.c_compiler() or "cc"
    if shutil.which(compiler) is None:
        log.info("no C compiler (%s) for the CPU kernels; using the torch paths", compiler)
        return None
    parts = [p.read_text() for p in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*parts, compiler, *_flags(), platform.machine(),
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    path = env.cache_dir() / "cpu_kernels" / f"batchgen_cpu-{key}.so"
    try:
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU kernels unavailable (%s); using the torch paths", detail)
        return None
    return lib


def extension(sources: tuple[Path, ...]) -> ctypes.CDLL | None:
    """A library of a caller's own C sources over the kernels (a fast path's, kept beside it):
    compiled with the kernels' flags, linked against the kernel library whose ``bg_*``
    functions it calls, and cached beside that library, keyed by its sources and by it. None
    without the kernel library or when the build fails: the caller keeps its torch path. The
    caller declares its functions' argument types."""
    lib = library()
    if lib is None:
        return None
    return _extension(tuple(sources), lib._name)


@functools.lru_cache(maxsize=None)
def _extension(sources: tuple[Path, ...], base: str) -> ctypes.CDLL | None:
    compiler = env.c_compiler() or "cc"
    parts = [p.read_text() for p in sources]
    key = hashlib.sha256("\0".join([*parts, base, compiler, *_flags()]).encode()).hexdigest()[:16]
    path = Path(base).with_name(f"batchgen_ext-{key}.so")
    try:
        if not path.exists():  # the library's full path becomes the extension's dependency
            _build(compiler, path, sources, (base,))
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("C extension %s unavailable (%s)", [p.name for p in sources], detail)
        return None
