"""CPU matmuls on weights pre-packed into oneDNN's blocked layout.

A decode step multiplies a few rows by every weight matrix. MKL's `F.linear` on the plain
[out, in] layout reaches a fraction of the machine's peak at those shapes; oneDNN's linear with a
weight reordered once at load time was up to ~25% faster at 4-32 rows in our runs
(`benchmarks/cpu_floor.py` prints both). Packing changes only the memory layout, not the math:
the result differs from `F.linear` by float rounding (summation order), which the pack-time
self-check bounds.

Packing is on by default on the CPU for fp32 and bf16; ``BATCHGEN_CPU_PACKED_LINEAR=0`` turns it
off. Any failure (no oneDNN, an op missing in this torch build, a self-check miss) leaves the
plain layers in place.

Decode steps (few rows) go to neither library when the C kernels are available (fp32, AVX-512,
a C compiler): up to `SMALL_GEMM_MAX_ROWS` rows, `csrc/small_gemm.c` streams the plain weight
once; up to `PANEL_MAX_ROWS` rows, `csrc/panel_gemm.c` multiplies a third copy of the weight,
repacked into 48-column panels, with an outer-product micro-kernel. At 4-64 rows they were
1.2-2x faster than MKL and the packed oneDNN kernel here (`benchmarks/cpu_floor.py` prints all
of them). ``BATCHGEN_CPU_SMALL_GEMM=0`` turns both off. The panel copy is made only while all
the extra copies fit the same 2 GiB budget as the plain ones.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from batchgen_data import env
from batchgen_data.layers import cpu_kernels

log = logging.getLogger(__name__)


def _packed_ops_ok() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] reordered for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


# At 1-3 rows MKL's plain GEMV-like path beats the packed kernel; from 4 rows on the packed one
# wins (measured on this project's CPU machines, fp32, 2 threads).
PLAIN_MAX_ROWS = 3


# Up to this many rows the C small-row kernel beats both libraries, and up to PANEL_MAX_ROWS the
# panel kernel does (measured, fp32, 2 threads, SmolLM2-135M shapes: at 8 rows the two C
# kernels tie; at 128 the panel kernel and MKL tie).
SMALL_GEMM_MAX_ROWS = 8
PANEL_MAX_ROWS = 64


def small_gemm_available() -> bool:
    """Whether `small_linear` can run here (a C compiler, AVX-512, not switched off, and the
    kernel agrees with `F.linear` on a self-check)."""
    return env.cpu_small_gemm() and _small_gemm_checked()


def _agrees_with_f_linear(name: str, out_f: int, in_f: int, rows: tuple[int, ...],
                          prepare, linear) -> bool:  # type: ignore[no-untyped-def]
    """Self-check of a C matmul: `linear(x, prepare(weight), bias)` against F.linear."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_f, in_f, generator=gen)
    bias = torch.randn(out_f, generator=gen)
    prepared = prepare(weight)
    for n in rows:
        x = torch.randn(n, in_f, generator=gen)
        for b in (None, bias):
            if not torch.allclose(linear(x, prepared, b), F.linear(x, weight, b),
                                  rtol=1e-4, atol=1e-4):
                log.warning("the C %s matmul disagrees with F.linear; not using it", name)
                return False
    return True


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def _small_gemm_checked() -> bool:
    lib = cpu_kernels.library()
    if lib is None or not lib.bg_small_gemm_supported():
        return False
    # odd sizes on purpose: a weight-row tail (N % 6) and a masked K tail (K % 16)
    return _agrees_with_f_linear("small-row", 37, 53, (1, 3, 5, SMALL_GEMM_MAX_ROWS),
                                 lambda w: w, small_linear)


def _c_linear(kernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              out_f: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
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


def panel_gemm_available() -> bool:
    """Whether `panel_linear` can run here (as `small_gemm_available`, for the panel kernel)."""
    return env.cpu_small_gemm() and _panel_gemm_checked()


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] fp32 repacked for `panel_linear` (a flat tensor)."""
    lib = cpu_kernels.library()
    assert lib is not None
    weight = weight.detach().contiguous()
    out_f, in_f = weight.shape
    panels = torch.empty(lib.bg_panel_packed_floats(out_f, in_f), dtype=torch.float32)
    lib.bg_panel_pack_f32(weight.data_ptr(), panels.data_ptr(), out_f, in_f,
                          torch.get_num_threads())
    return panels


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for fp32 CPU tensors, with `panels = pack_panels(weight)`.
    Call only when `panel_gemm_available()`."""
    lib = cpu_kernels.library()
    assert lib is not None
    if (panels.numel() != lib.bg_panel_packed_floats(out_features, x.shape[-1])
            or x.dtype != torch.float32 or (bias is not None and not bias.is_contiguous())):
        raise ValueError(f"panel_linear: x {tuple(x.shape)} {x.dtype} against {panels.numel()} "
                         f"packed floats for {out_features} outputs")
    return _c_linear(lib.bg_panel_gemm_f32, x, panels, bias, out_features)


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def _panel_gemm_checked() -> bool:
    lib = cpu_kernels.library()
    if lib is None or not lib.bg_panel_gemm_supported():
        return False
    # a partial last panel and an odd K
    return _agrees_with_f_linear("panel", 53, 37, (1, 7, 9, PANEL_MAX_ROWS),
                                 pack_panels, lambda x, p, b: panel_linear(x, p, b, 53))


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  weight: torch.Tensor | None = None, small_gemm: bool = False,
                  panels: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [..., in] and a weight packed by `pack_weight`.

    Fewer rows take faster paths when their inputs are given: up to `SMALL_GEMM_MAX_ROWS` rows
    the C small-row kernel on the plain `weight` (when `small_gemm`: the caller checked
    `small_gemm_available()` and that the weight is fp32), up to `PANEL_MAX_ROWS` rows the C
    panel kernel on `panels` (from `pack_panels`), and otherwise up to `PLAIN_MAX_ROWS` rows
    `F.linear` on the plain `weight`.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows = x2.shape[0]
    if weight is not None:
        if small_gemm and rows <= SMALL_GEMM_MAX_ROWS and x.dtype == torch.float32:
            return small_linear(x, weight, bias)
        if panels is not None and rows <= PANEL_MAX_ROWS and x.dtype == torch.float32:
            return panel_linear(x, panels, bias, weight.shape[0])
        if rows <= PLAIN_MAX_ROWS:
            return F.linear(x, weight, bias)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return out.view(*shape[:-1], out.shape[-1])


@torch.no_grad()
def _self_check(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> bool:
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 5, 33):
        x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype)
        want = F.linear(x, weight, bias).float()
        got = packed_linear(x, packed, bias).float()
        tol = 1e-4 if weight.dtype == torch.float32 else 5e-2
        if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
            return False
    return True


# Keeping the plain weights next to the packed ones (for the 1-3-row path, and the tied output
# projection's packed copy) costs a second copy of those weights in host memory; it is kept only
# while that copy stays under this many bytes. Larger models run packed weights alone.
PLAIN_COPY_BUDGET_BYTES = 2 << 30


class PackedLinear(nn.Module):
    """Stands in for an `nn.Linear` whose weight is packed.

    With `keep_plain`, `weight` stays readable and serves inputs of at most `PLAIN_MAX_ROWS`
    rows; without it, `weight` is None and the plain copy is freed.
    """

    def __init__(self, linear: nn.Linear, packed: torch.Tensor, keep_plain: bool = True,
                 panels: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight if keep_plain else None
        self.bias = linear.bias
        self.register_buffer("packed_weight", packed, persistent=False)
        fp32 = keep_plain and linear.weight.dtype == torch.float32 and linear.weight.is_contiguous()
        self.small_gemm = fp32 and small_gemm_available()
        self.register_buffer("panel_weight", pack_panels(linear.weight)
                             if panels and fp32 and panel_gemm_available() else None,
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias, self.weight, self.small_gemm,
                             self.panel_weight)


def pack_model_linears(model: nn.Module, device: torch.device, dtype: torch.dtype,
                       plain_copy_budget: int = PLAIN_COPY_BUDGET_BYTES) -> int:
    """Swaps every `nn.Linear` of `model` for a `PackedLinear` (CPU, fp32/bf16 only).

    While the plain copies fit `plain_copy_budget` bytes they are kept, and the output projection
    of a tied-embedding model is packed too (`model.packed_lm_head`). Layers are swapped one at
    a time, so peak memory grows by one layer's weight at most when the plain copies are dropped.
    Returns how many weights were packed (0 when packing is off or not possible here).
    """
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return 0
    if not env.cpu_packed_linear() or not _packed_ops_ok():
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    if not targets:
        return 0
    tied = getattr(model, "lm_head", True) is None and hasattr(model, "embed_tokens")
    copy_bytes = sum(c.weight.numel() * c.weight.element_size() for _, _, c in targets)
    if tied:
        embed = model.embed_tokens.weight
        copy_bytes += embed.numel() * embed.element_size()
    keep_plain = copy_bytes <= plain_copy_budget
    # the panel copies (fp32 only) cost as much again
    panels = dtype == torch.float32 and 2 * copy_bytes <= plain_copy_budget
    done = 0
    try:
        first = targets[0][2]
        packed = pack_weight(first.weight)
        if not _self_check(first.weight, packed, first.bias):
            log.warning("packed CPU linear disagrees with F.linear; using plain layers")
            return 0
        for i, (parent, name, child) in enumerate(targets):
            if i:
                packed = pack_weight(child.weight)
            setattr(parent, name, PackedLinear(child, packed, keep_plain, panels))
            done += 1
        if tied and keep_plain:
            embed = model.embed_tokens.weight
            model.packed_lm_head = pack_weight(embed)
            fp32 = embed.dtype == torch.float32 and embed.is_contiguous()
            model.lm_head_small_gemm = fp32 and small_gemm_available()
            model.panel_lm_head = (pack_panels(embed) if panels and fp32 and panel_gemm_available()
                                   else None)
            done += 1
    except (RuntimeError, NotImplementedError) as exc:  # op missing or unsupported here
        # layers swapped so far stay swapped: each PackedLinear computes the same function
        log.warning("packed CPU linear unavailable (%s); %d weights packed", exc, done)
    return done
