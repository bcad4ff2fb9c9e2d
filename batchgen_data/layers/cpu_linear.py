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
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from batchgen_data import env

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


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  weight: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [..., in] and a weight packed by `pack_weight`.

    With the plain `weight` given, inputs of at most `PLAIN_MAX_ROWS` rows use it instead.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if weight is not None and x2.shape[0] <= PLAIN_MAX_ROWS:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias, self.weight)


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
            model.packed_lm_head = pack_weight(model.embed_tokens.weight)
            done += 1
    except (RuntimeError, NotImplementedError) as exc:  # op missing or unsupported here
        # layers swapped so far stay swapped: each PackedLinear computes the same function
        log.warning("packed CPU linear unavailable (%s); %d weights packed", exc, done)
    return done
