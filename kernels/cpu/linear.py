"""CPU matmul kernels, one per weight layout; `batchgen_data.layers.linear` keeps each weight in
exactly one of these layouts and routes every call to the kernels of that layout.

* oneDNN's blocked layout (`pack_onednn` / `onednn_linear`, fp32 or bf16). MKL's `F.linear` on
  the plain [out, in] layout reaches a fraction of the machine's peak at decode shapes; oneDNN's
  linear with a weight reordered once at load time does better at a few dozen rows, MKL's
  GEMV-like path at one to three (`lab/scripts/cpu_floor.py` times both).
* 48-column panels (`pack_panels`, fp32, AVX-512): `csrc/panel_gemm.c` multiplies them with an
  outer-product micro-kernel (`panel_linear`), faster than MKL and the oneDNN kernel at decode
  row counts (`lab/scripts/cpu_floor.py`). `panel_matmul` runs
  MKL's batched matmul on the same panels (each is a [in, 48] matrix) for larger row counts.
* the plain layout: `csrc/small_gemm.c` (`small_linear`, up to `SMALL_GEMM_MAX_ROWS` rows)
  streams the weight once (AVX-512); `csrc/rows_gemm.c` (`rows_linear`, up to
  `ROWS_GEMM_MAX_ROWS` rows, AVX2 + FMA) does the same on a CPU without AVX-512, where it serves
  every linear layer's decode rows (the "rows" layout, `layers/linear.py`) and the tied output
  projection (the embedding's plain rows; `layers/embedding.py`).

Every kernel changes only the memory layout or the summation order, so results differ from
`F.linear` by float rounding, which a first-use self-check bounds. Whether each runs on this CPU
is `capability`'s answer (the C library's ISA, oneDNN's own per dtype); a packing asked for
where it cannot run is refused naming the CPU feature. A user turns them all off with the
engine's ``cpu_kernels=False``; a test that wants one off patches its ``*_available`` here.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from batchgen_data.kernels.cpu import build as cpu_kernels
from batchgen_data.kernels.cpu import capability

log = logging.getLogger(__name__)

# Up to this many rows the C small-row kernel beats both libraries, and up to PANEL_MAX_ROWS the
# panel kernel does (measured, fp32, 2 threads, SmolLM2-135M shapes: at 8 rows the two C
# kernels tie; at 128 the panel kernel and MKL tie).
SMALL_GEMM_MAX_ROWS = 8
PANEL_MAX_ROWS = 64
PANEL = 48  # output columns per panel (csrc/panel_gemm.c)
# `rows_linear` serves up to 64 rows (decode steps), where streaming each weight row once beats
# MKL's sgemm on a tall, thin weight such as a tied head; prefill chunks keep MKL's
# cache-blocked GEMM
ROWS_GEMM_MAX_ROWS = 64
# multiply-adds under which `rows_linear` runs on one thread (a 32-expert router gate at up to
# 16 rows of 512)
SMALL_PRODUCT = 1 << 18


def _agrees_with_f_linear(name: str, out_f: int, in_f: int, rows: tuple[int, ...],
                          prepare: Callable[[torch.Tensor], torch.Tensor],
                          linear: Callable[..., torch.Tensor], tol: float = 1e-4) -> bool:
    """Self-check of a matmul: `linear(x, prepare(weight), bias)` against F.linear."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_f, in_f, generator=gen)
    bias = torch.randn(out_f, generator=gen)
    prepared = prepare(weight)
    for n in rows:
        x = torch.randn(n, in_f, generator=gen)
        for b in (None, bias):
            if not torch.allclose(linear(x, prepared, b), F.linear(x, weight, b),
                                  rtol=tol, atol=tol):
                log.warning("the CPU %s matmul disagrees with F.linear; not using it", name)
                return False
    return True


# ---- oneDNN blocked layout -----------------------------------------------------------------
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether `onednn_linear` runs here in `dtype` (float32 or bfloat16): oneDNN packs and
    multiplies a weight of that dtype on this CPU (`capability.onednn`) and the fp32 kernel
    agrees with F.linear on a self-check."""
    return capability.onednn(dtype).ok and (dtype != torch.float32 or _onednn_checked())


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def _onednn_checked() -> bool:
    try:
        return _agrees_with_f_linear("oneDNN", 37, 53, (1, 5, 33), pack_onednn, onednn_linear)
    except (RuntimeError, NotImplementedError) as exc:  # op missing or unsupported here
        log.warning("packed CPU linear unavailable (%s)", exc)
        return False


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] reordered for `onednn_linear` (an opaque blocked layout); ValueError
    naming what the CPU lacks where oneDNN has no path for its dtype (bf16 without AVX-512
    BW/VL/DQ or AVX-NE-CONVERT)."""
    support = capability.onednn(weight.dtype)
    if not support.ok:
        raise ValueError(f"pack_onednn: no packed {weight.dtype} linear on this CPU: "
                         f"{support.reason}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [..., in] with `packed = pack_onednn(weight)`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return out.view(*shape[:-1], out.shape[-1])


# ---- C kernels (fp32, AVX-512) -------------------------------------------------------------
def _c_linear(kernel: Callable[..., int], x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, out_f: int) -> torch.Tensor:
    """Runs a C matmul with the `bg_*_gemm_f32(X, W, bias, Y, M, N, K, threads)` signature on
    x [..., in]; leading dims are flattened into rows and restored."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], out_f, dtype=torch.float32)
    kernel(x2.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
           out.data_ptr(), x2.shape[0], out_f, x2.shape[1], torch.get_num_threads())
    return out.view(*shape[:-1], out_f)


def small_gemm_available() -> bool:
    """Whether `small_linear` can run here (a C compiler, AVX-512, and the kernel agrees with
    `F.linear` on a self-check)."""
    return _small_gemm_checked()


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def _small_gemm_checked() -> bool:
    lib = cpu_kernels.library()
    if lib is None or not lib.bg_small_gemm_supported():
        return False
    # odd sizes on purpose: a weight-row tail (N % 6) and a masked K tail (K % 16)
    return _agrees_with_f_linear("small-row", 37, 53, (1, 3, 5, SMALL_GEMM_MAX_ROWS),
                                 lambda w: w, small_linear)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through the C small-row kernel: fp32 CPU tensors, `weight`
    [out, in] contiguous. Call only when `small_gemm_available()`."""
    lib = cpu_kernels.library()
    assert lib is not None
    out_f, in_f = weight.shape
    if x.shape[-1] != in_f or not weight.is_contiguous() or weight.dtype != torch.float32 \
            or x.dtype != torch.float32 or (bias is not None and not bias.is_contiguous()):
        raise ValueError(f"small_linear: x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    return _c_linear(lib.bg_small_gemm_f32, x, weight, bias, out_f)


def rows_gemm_available() -> bool:
    """Whether `rows_linear` can run here (a C compiler, AVX2 + FMA, and the kernel agrees with
    `F.linear` on a self-check)."""
    return _rows_gemm_checked()


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def _rows_gemm_checked() -> bool:
    lib = cpu_kernels.library()
    if lib is None or not lib.bg_rows_gemm_supported():
        return False
    # a K tail (K % 8), a partial weight-row block and a partial 3-row tile
    return _agrees_with_f_linear("plain-row", 37, 53, (1, 5, 33), lambda w: w,
                                 lambda x, w, b: rows_linear(x, w) if b is None else
                                 rows_linear(x, w) + b)


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` through the AVX2 row kernel: fp32 CPU tensors, `weight` [out, in]
    contiguous. Call only when `rows_gemm_available()`."""
    lib = cpu_kernels.library()
    assert lib is not None
    out_f, in_f = weight.shape
    if (x.shape[-1] != in_f or not weight.is_contiguous() or weight.dtype != torch.float32
            or x.dtype != torch.float32):
        raise ValueError(f"rows_linear: x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    # this runs a few times per layer per decode step: skip the copies a 2-D contiguous x
    # (the common case) does not need
    flat = x.dim() == 2 and x.is_contiguous()
    x2 = x if flat else x.reshape(-1, in_f).contiguous()
    rows = x2.shape[0]
    out = x2.new_empty((rows, out_f))
    # waking the second thread costs more than a small product gains from it (a router gate)
    threads = 1 if rows * out_f * in_f < SMALL_PRODUCT else torch.get_num_threads()
    lib.bg_rows_gemm_f32(x2.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, out_f, in_f,
                         threads)
    return out if flat else out.view(*x.shape[:-1], out_f)


def panel_gemm_available() -> bool:
    """Whether `panel_linear` can run here (as `small_gemm_available`, for the panel kernel)."""
    return _panel_gemm_checked()


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def _panel_gemm_checked() -> bool:
    lib = cpu_kernels.library()
    if lib is None or not lib.bg_panel_gemm_supported():
        return False
    # a partial last panel and an odd K
    return _agrees_with_f_linear("panel", 53, 37, (1, 7, 9, PANEL_MAX_ROWS),
                                 pack_panels, lambda x, p, b: panel_linear(x, p, b, 53))


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] fp32 repacked into panels [ceil(out / 48), in, 48] (the last one
    zero-padded), the layout of `panel_linear`. ValueError naming what is missing where the
    C library has no AVX-512 panel kernel."""
    lib = cpu_kernels.library()
    if lib is None or not lib.bg_panel_gemm_supported():
        raise ValueError(f"pack_panels: no panel kernel here: {capability.needs('avx512')}")
    weight = weight.detach().contiguous()
    out_f, in_f = weight.shape
    panels = torch.empty(-(-out_f // PANEL), in_f, PANEL, dtype=torch.float32)
    assert panels.numel() == lib.bg_panel_packed_floats(out_f, in_f)
    lib.bg_panel_pack_f32(weight.data_ptr(), panels.data_ptr(), out_f, in_f,
                          torch.get_num_threads())
    return panels


def _check_panels(x: torch.Tensor, panels: torch.Tensor, out_features: int, what: str) -> None:
    if (panels.dim() != 3 or panels.shape[0] != -(-out_features // PANEL)
            or panels.shape[1:] != (x.shape[-1], PANEL) or not panels.is_contiguous()
            or x.dtype != torch.float32 or panels.dtype != torch.float32):
        raise ValueError(f"{what}: x {tuple(x.shape)} {x.dtype} against panels "
                         f"{tuple(panels.shape)} {panels.dtype} for {out_features} outputs")


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for fp32 CPU tensors, with `panels = pack_panels(weight)`.
    Call only when `panel_gemm_available()`."""
    lib = cpu_kernels.library()
    assert lib is not None
    _check_panels(x, panels, out_features, "panel_linear")
    if bias is not None and not bias.is_contiguous():
        raise ValueError("panel_linear: bias must be contiguous")
    return _c_linear(lib.bg_panel_gemm_f32, x, panels, bias, out_features)


def panel_matmul(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on `panels = pack_panels(weight)` through torch's batched
    matmul (panel p is the [in, 48] matrix weight[48p:48p + 48].T): the path for row counts
    beyond `PANEL_MAX_ROWS`, where a library GEMM's cache blocking pays off."""
    _check_panels(x, panels, out_features, "panel_matmul")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.matmul(x2, panels)  # [P, M, 48]
    out = out.transpose(0, 1).reshape(x2.shape[0], -1)[:, :out_features]
    if bias is not None:
        out = out + bias
    elif not out.is_contiguous():
        out = out.contiguous()
    return out.view(*shape[:-1], out_features)


def panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight packed into `panels`: [len(ids), in] (an embedding lookup on a
    tied embedding kept in the panel layout)."""
    return panels[ids // PANEL, :, ids % PANEL]
