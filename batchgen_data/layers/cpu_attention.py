"""A C decode-attention kernel for the CPU, compiled on first use and cached.

The torch reference path gathers every decoding sequence's KV blocks into a dense copy and then
runs SDPA over it, so each layer moves the KV three times (read, write, read). The kernel in
`csrc/paged_decode.c` reads each key and value row once, straight out of its block, and shares it
between the query heads of its KV group. At 5-32 sequences this made decode attention
1.2-1.7x faster in our runs (`benchmarks/cpu_floor.py` times both).

The shared library is built with the system C compiler (``$CC``, else ``cc``) into
``<cache_dir>/cpu_kernels/``, keyed by the source, the flags and this CPU's feature flags, so a
cache shared between different machines never loads a binary built for another CPU. Builds are
atomic (temp file + rename), so concurrent Ray/Spark workers are safe. No compiler, a failed
build, ``BATCHGEN_CPU_ATTENTION_KERNEL=0``, or a non-fp32 cache: the torch path runs instead.
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

import torch

from batchgen_data import env

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    compiler = env.c_compiler() or "cc"
    if shutil.which(compiler) is None:
        log.info("no C compiler (%s) for the CPU attention kernel; using the torch path", compiler)
        return None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, *FLAGS, platform.machine(),
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    path = env.cache_dir() / "cpu_kernels" / f"paged_decode-{key}.so"
    try:
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU attention kernel unavailable (%s); using the torch path", detail)
        return None
    fn = lib.bg_paged_decode_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                   ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.bg_paged_decode_supports.argtypes = [i64]
    lib.bg_paged_decode_supports.restype = ctypes.c_int
    return lib


def available(kv: torch.Tensor) -> bool:
    """Whether decode attention over this KV cache ([..., Hkv, head_dim]) runs in the C kernel."""
    if kv.device.type != "cpu" or kv.dtype != torch.float32 or not env.cpu_attention_kernel():
        return False
    lib = _library()
    return lib is not None and bool(lib.bg_paged_decode_supports(kv.shape[-1]))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D] fp32; caches [num_blocks, block_size, Hkv, D]; tables [B, W] and lens [B]
    int32. Returns [B, H, D]. Call only when `available(k_cache)`."""
    lib = _library()
    assert lib is not None
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the paged KV caches must be contiguous")
    num_seqs, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    if num_heads % num_kv or k_cache.shape[3] != head_dim or tables.shape[0] != num_seqs:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, "
                         f"tables {tuple(tables.shape)}")
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    rc = lib.bg_paged_decode_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv, head_dim, k_cache.shape[1], tables.shape[1],
        float(scale), torch.get_num_threads())
    if rc == -2:
        raise ValueError(f"head_dim={head_dim} is not supported by the CPU attention kernel")
    if rc != 0:
        raise MemoryError("CPU attention kernel could not allocate its score buffer")
    return out
