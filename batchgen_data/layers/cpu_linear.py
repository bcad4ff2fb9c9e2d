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


class PackedLinear(nn.Module):
    """Stands in for an `nn.Linear` whose weight is packed; `weight` stays readable."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The plain weight is kept (tests and KV/weight tools read it); the packed copy is what
        # runs. For fp32 this doubles the linear layers' host memory.
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("packed_weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias, self.weight)


def pack_model_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Swaps every `nn.Linear` of `model` for a `PackedLinear` (CPU, fp32/bf16 only).

    Also packs the output projection of a tied-embedding model under `model.packed_lm_head`.
    Returns how many weights were packed (0 when packing is off or not possible here).
    """
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return 0
    if not env.cpu_packed_linear() or not _packed_ops_ok():
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    packed_layers = []
    try:
        for parent, name, child in targets:
            packed = pack_weight(child.weight)
            packed_layers.append((parent, name, child, packed))
        if packed_layers and not _self_check(packed_layers[0][2].weight, packed_layers[0][3],
                                             packed_layers[0][2].bias):
            log.warning("packed CPU linear disagrees with F.linear; using plain layers")
            return 0
        lm_head = None
        if getattr(model, "lm_head", True) is None and hasattr(model, "embed_tokens"):
            lm_head = pack_weight(model.embed_tokens.weight)
    except (RuntimeError, NotImplementedError) as exc:  # op missing or unsupported here
        log.warning("packed CPU linear unavailable (%s); using plain layers", exc)
        return 0
    for parent, name, child, packed in packed_layers:
        setattr(parent, name, PackedLinear(child, packed))
    if lm_head is not None:
        model.packed_lm_head = lm_head
    return len(packed_layers) + (lm_head is not None)
