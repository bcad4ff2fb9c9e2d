"""Weight-only quantized matmuls on the CPU: `csrc/quant_gemm.c` behind checked launchers.

A weight is kept in its stored bytes (INT8, INT4 two per byte, FP8 e4m3 bit patterns) with
fp32 scales (and zeros) per group of input columns; `quant_linear` widens it to fp32 inside the
product (16 lanes on AVX-512, 8 on AVX2), `dequantize` writes the whole fp32 weight (for
prefill chunks, which MKL multiplies faster than the row kernel can). The formats are those of
`kernels/reference.py` (`dequantize`, `quant_linear`), which the self-check compares against.
"""
from __future__ import annotations

import functools
import logging

import torch

from batchgen_data.kernels import reference
from batchgen_data.kernels.cpu import build as cpu_kernels

log = logging.getLogger(__name__)

KINDS = {"int8": 0, "int4": 1, "fp8": 2}
# rows up to which `quant_linear` runs the C kernel; above, dequantize once and use MKL
MAX_ROWS = 64
# multiply-adds under which one thread is faster than waking the pool (see linear.py)
SMALL_PRODUCT = 1 << 18


def available() -> bool:
    """Whether the C kernel runs here (a C compiler, AVX2 + FMA) and agrees with the reference
    on a self-check (odd shapes, a short last group)."""
    return _checked()


def vector_lanes() -> int:
    """16 on an AVX-512 build, 8 on an AVX2 one, 0 without the kernel."""
    lib = cpu_kernels.library()
    return 0 if lib is None else int(lib.bg_quant_gemm_supported())


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def _checked() -> bool:
    if vector_lanes() == 0:
        return False
    gen = torch.Generator().manual_seed(0)
    n, k, group = 37, 53, 20
    for kind in KINDS:
        codes = random_codes(kind, n, k, gen)
        scales = torch.rand(n, -(-k // group), generator=gen) + 0.5
        zeros = torch.rand(n, -(-k // group), generator=gen) * 4
        for z in (None, zeros if kind != "fp8" else None):
            for rows in (1, 5, 33):
                x = torch.randn(rows, k, generator=gen)
                want = reference.quant_linear(x, codes, scales, z, kind, group)
                if not torch.allclose(quant_linear(x, codes, scales, z, kind, group), want,
                                      rtol=1e-4, atol=1e-3):
                    log.warning("the CPU %s quantized matmul disagrees with the reference; "
                                "using the torch path", kind)
                    return False
    return True


def random_codes(kind: str, n: int, k: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """Random stored codes of an [n, k] weight of `kind` (tests and self-checks)."""
    if kind == "int8":
        return torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int16).to(torch.int8)
    if kind == "int4":
        return torch.randint(0, 256, (n, -(-k // 2)), generator=gen, dtype=torch.int16
                             ).to(torch.uint8)
    w = torch.randn(n, k, generator=gen).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w.view(torch.uint8)


def _check(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, kind: str,
           group: int, k: int) -> None:
    n = codes.shape[0]
    cols = -(-k // 2) if kind == "int4" else k
    g = -(-k // group) if group >= 1 else 0
    if kind not in KINDS or group < 1:
        raise ValueError(f"quantized matmul: kind={kind!r}, group={group}")
    if codes.shape != (n, cols) or codes.element_size() != 1 or not codes.is_contiguous():
        raise ValueError(f"quantized matmul: codes {tuple(codes.shape)} {codes.dtype}, want "
                         f"[{n}, {cols}] one byte each, contiguous ({kind}, k={k})")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is not None and (t.shape != (n, g) or t.dtype != torch.float32
                              or not t.is_contiguous()):
            raise ValueError(f"quantized matmul: {name} {tuple(t.shape)} {t.dtype}, want "
                             f"[{n}, {g}] float32 contiguous")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def quant_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, kind: str, group: int) -> torch.Tensor:
    """x [..., k] fp32 times the dequantized weight [N, k]^T: [..., N]. Up to `MAX_ROWS` rows
    in the C kernel, more through `dequantize` + MKL. Call only when `available()`."""
    lib = cpu_kernels.library()
    assert lib is not None
    k = x.shape[-1]
    _check(codes, scales, zeros, kind, group, k)
    if x.dtype != torch.float32:
        raise ValueError(f"quantized matmul: x is {x.dtype}, want float32")
    n = codes.shape[0]
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
    rows = x2.shape[0]
    if rows > MAX_ROWS:
        out = torch.nn.functional.linear(x2, dequantize(codes, scales, zeros, kind, group, k))
    else:
        out = x2.new_empty((rows, n))
        threads = 1 if rows * n * k < SMALL_PRODUCT else torch.get_num_threads()
        rc = lib.bg_quant_gemm_f32(x2.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                                   _ptr(zeros), reference.DEFAULT_ZERO[kind], out.data_ptr(),
                                   rows, n, k, group, KINDS[kind], threads)
        if rc != 0:
            raise RuntimeError(f"quantized matmul failed (code {rc})")
    return out if out.shape[:-1] == x.shape[:-1] else out.view(*x.shape[:-1], n)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               kind: str, group: int, k: int) -> torch.Tensor:
    """The fp32 weight [N, k] of a quantized one (as `reference.dequantize`)."""
    lib = cpu_kernels.library()
    assert lib is not None
    _check(codes, scales, zeros, kind, group, k)
    out = torch.empty(codes.shape[0], k, dtype=torch.float32)
    rc = lib.bg_quant_dequant_f32(codes.data_ptr(), scales.data_ptr(), _ptr(zeros),
                                  reference.DEFAULT_ZERO[kind], out.data_ptr(), codes.shape[0],
                                  k, group, KINDS[kind], torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"quantized dequantize failed (code {rc})")
    return out
