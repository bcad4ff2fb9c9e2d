"""A C decode-attention kernel for the CPU, compiled on first use and cached.

The torch reference path gathers every decoding sequence's KV blocks into a dense copy and then
runs SDPA over it, so each layer moves the KV three times (read, write, read). The kernel in
`csrc/paged_decode.c` reads each key and value row once, straight out of its block, and shares it
between the query heads of its KV group (`lab/scripts/cpu_floor.py` times both paths).

The kernel is built on first use by `build.library()` (the system C compiler, cached per CPU).
No compiler, a failed build or a model that is not fp32: the layer keeps the torch path (`batchgen_data.layers.backend` decides). An
FP8 cache (float8_e4m3fn codes with a per-layer `k_scale` / `v_scale`, `layers/kv_quant.py`)
runs `bg_paged_decode_fp8`: the same loops, each code widened in registers. A sliding window,
attention sinks (gpt-oss) or logit soft-capping (Gemma 2) run `bg_paged_decode_windowed`, either cache: the window's tasks start
at its first token and the sinks join the merge's denominator.
"""
from __future__ import annotations

import ctypes

import torch

from batchgen_data.kernels.cpu import build as cpu_kernels


def supports(head_dim: int) -> bool:
    """Whether decode attention with heads of `head_dim` runs in the C kernel here (the library
    built; the caller checks that q is fp32 on the CPU, the cache fp32 or FP8)."""
    lib = cpu_kernels.library()
    return lib is not None and bool(lib.bg_paged_decode_supports(head_dim))


def _fp8_kernel(lib: ctypes.CDLL) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = lib.bg_paged_decode_fp8
    if fn.argtypes is None:  # declared here, on first use
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        fn.argtypes = [ptr] * 6 + [i64] * 6 + [f32] * 3 + [ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def _windowed_kernel(lib: ctypes.CDLL) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = lib.bg_paged_decode_windowed
    if fn.argtypes is None:  # declared here, on first use
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        fn.argtypes = ([ptr] * 3 + [ctypes.c_int] + [ptr] * 3 + [i64] * 6 + [f32] * 3
                       + [i64, ptr, f32, ctypes.c_int])
        fn.restype = ctypes.c_int
    return fn


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 k_scale: float = 1.0, v_scale: float = 1.0, sliding_window: int | None = None,
                 sinks: torch.Tensor | None = None, softcap: float | None = None
                 ) -> torch.Tensor:
    """q [B, H, D] fp32; caches [num_blocks, block_size, Hkv, D] fp32, or both float8_e4m3fn
    (K = code * k_scale, V = code * v_scale); tables [B, W] and lens [B] int32. Returns
    [B, H, D]. `sliding_window`: each query sees its last that many tokens (None: all);
    `sinks`: [H] logits joining each head's softmax with no value; `softcap`: each score s
    becomes softcap * tanh(s / softcap) (Gemma 2). Call only when
    `supports(head_dim)`."""
    lib = cpu_kernels.library()
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
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if q.dtype != torch.float32 or v_cache.dtype != k_cache.dtype \
            or not (fp8 or k_cache.dtype == torch.float32):
        raise ValueError(f"the CPU attention kernel takes fp32 q and fp32 or float8_e4m3fn "
                         f"caches; got q {q.dtype}, caches {k_cache.dtype}/{v_cache.dtype}")
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv, head_dim,
            k_cache.shape[1], tables.shape[1], float(scale))
    if sliding_window or sinks is not None or softcap:
        sink = None if sinks is None else sinks.to(torch.float32).contiguous()
        if sink is not None and sink.shape != (num_heads,):
            raise ValueError(f"sinks must be [num_heads={num_heads}], got {tuple(sink.shape)}")
        rc = _windowed_kernel(lib)(*args[:3], int(fp8), *args[3:], float(k_scale),
                                   float(v_scale), int(sliding_window or 0),
                                   None if sink is None else sink.data_ptr(),
                                   float(softcap or 0.0), torch.get_num_threads())
    elif fp8:
        rc = _fp8_kernel(lib)(*args, float(k_scale), float(v_scale), torch.get_num_threads())
    else:
        rc = lib.bg_paged_decode_f32(*args, torch.get_num_threads())
    if rc == -2:
        raise ValueError(f"head_dim={head_dim} is not supported by the CPU attention kernel")
    if rc != 0:
        raise MemoryError("CPU attention kernel could not allocate its score buffer")
    return out
