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

Inputs of at most `SMALL_GEMM_MAX_ROWS` rows (decode steps) go to neither library when the C
kernel in `csrc/small_gemm.c` is available (fp32, AVX-512, a C compiler): it streams the plain
weight once and was ~1.2-1.5x faster than the packed kernel and ~1.3-2x faster than MKL at
4-16 rows here (`benchmarks/cpu_floor.py` prints all three). ``BATCHGEN_CPU_SMALL_GEMM=0`` turns
it off.
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


# Up to this many rows the C small-row kernel beats both libraries (measured, fp32, 2 threads).
SMALL_GEMM_MAX_ROWS = 16


def small_gemm_available() -> bool:
    """Whether `small_linear` can run here (a C compiler, AVX-512, not switched off, and the
    kernel agrees with `F.linear` on a self-check)."""
    return env.cpu_small_gemm() and _small_gemm_checked()


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def _small_gemm_checked() -> bool:
    lib = cpu_kernels.library()
    if lib is None or not lib.bg_small_gemm_supported():
        return False
    gen = torch.Generator().manual_seed(0)
    # odd sizes on purpose: a weight-row tail (N % 8) and a masked K tail (K % 16)
    weight = torch.randn(37, 53, generator=gen)
    bias = torch.randn(37, generator=gen)
    for rows in (1, 3, 5, SMALL_GEMM_MAX_ROWS):
        x = torch.randn(rows, 53, generator=gen)
        for b in (None, bias):
            if not torch.allclose(small_linear(x, weight, b), F.linear(x, weight, b),
                                  rtol=1e-4, atol=1e-4):
                log.warning("the C small-row matmul disagrees with F.linear; not using it")
                return False
    return True


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through the C small-row kernel: fp32 CPU tensors, `weight`
    [out, in] contiguous. Call only when `small_gemm_available()`."""
    lib = cpu_kernels.library()
    assert lib is not None
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    rows, (out_f, in_f) = x2.shape[0], weight.shape
    if x2.shape[1] != in_f or not weight.is_contiguous() or weight.dtype != torch.float32 \
            or x2.dtype != torch.float32 or (bias is not None and not bias.is_contiguous()):
        raise ValueError(f"small_linear: x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    out = torch.empty(rows, out_f, dtype=torch.float32)
    lib.bg_small_gemm_f32(x2.data_ptr(), weight.data_ptr(),
                          None if bias is None else bias.data_ptr(), out.data_ptr(),
                          rows, out_f, in_f, torch.get_num_threads())
    return out.view(*shape[:-1], out_f)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  weight: torch.Tensor | None = None, small_gemm: bool = False) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [..., in] and a weight packed by `pack_weight`.

    With the plain `weight` given, inputs of at most `SMALL_GEMM_MAX_ROWS` rows use the C
    small-row kernel when `small_gemm` (the caller checked `small_gemm_available()` and that the
    weight is fp32), and inputs of at most `PLAIN_MAX_ROWS` rows otherwise use `F.linear`.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if weight is not None:
        rows = x2.shape[0]
        if small_gemm and rows <= SMALL_GEMM_MAX_ROWS and x.dtype == torch.float32:
            return small_linear(x2, weight, bias).view(*shape[:-1], weight.shape[0])
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

    def __init__(self, linear: nn.Linear, packed: torch.Tensor, keep_plain: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight if keep_plain else None
        self.bias = linear.bias
        self.register_buffer("packed_weight", packed, persistent=False)
        self.small_gemm = (keep_plain and linear.weight.dtype == torch.float32
                           and linear.weight.is_contiguous() and small_gemm_available())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias, self.weight, self.small_gemm)


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
            setattr(parent, name, PackedLinear(child, packed, keep_plain))
            done += 1
        if tied and keep_plain:
            embed = model.embed_tokens.weight
            model.packed_lm_head = pack_weight(embed)
            model.lm_head_small_gemm = (embed.dtype == torch.float32 and embed.is_contiguous()
                                        and small_gemm_available())
            done += 1
    except (RuntimeError, NotImplementedError) as exc:  # op missing or unsupported here
        # layers swapped so far stay swapped: each PackedLinear computes the same function
        log.warning("packed CPU linear unavailable (%s); %d weights packed", exc, done)
    return done
