"""SwiGLU's activation on a fused gate|up output: silu(x[..., :I]) * x[..., I:] (and GeGLU's,
`GeluTanhAndMul`).

One pass instead of torch's three (chunk, silu, mul), which each read and write the whole
[T, 2I] activation in a long prefill step: the Triton kernel on CUDA, a C loop on an fp32 CPU,
torch elsewhere; chosen when the layer is built.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen_data.layers.backend import current


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        b = current()
        self._forward = self._triton if b.triton else self._c if b.c_ops else self._torch

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2I] -> [..., I]."""
        return self._forward(gate_up)

    @staticmethod
    def _triton(gate_up: torch.Tensor) -> torch.Tensor:
        from batchgen_data.kernels import silu_and_mul
        return silu_and_mul(gate_up)

    @staticmethod
    def _c(gate_up: torch.Tensor) -> torch.Tensor:
        from batchgen_data.kernels.cpu import ops
        return ops.silu_mul(gate_up)

    @staticmethod
    def _torch(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """GeGLU's activation on a fused gate|up output (Gemma): gelu_tanh(x[..., :I]) * x[..., I:],
    with GELU's tanh approximation as HF's `gelu_pytorch_tanh`. Torch on every backend: the
    kernels fuse SiLU only."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2I] -> [..., I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
