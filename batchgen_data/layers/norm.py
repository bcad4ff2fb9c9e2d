"""RMSNorm, computed in fp32 like the HF reference: the fused Triton kernel on CUDA, one C loop
on an fp32 CPU (no per-op dispatch for the few rows of a decode step), torch elsewhere."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen_data.layers.backend import current


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        b = current()
        self._forward = self._triton if b.triton else self._c if b.c_ops else self._torch

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        return self._forward(x, residual)

    def _triton(self, x: torch.Tensor, residual: torch.Tensor | None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from batchgen_data.kernels import fused_add_rms_norm, rms_norm
        shape = x.shape
        if residual is None:  # q/k norms see [T, H, D]: the kernel wants rows
            return rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)
        # in place: residual += x; x = norm(residual)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def _c(self, x: torch.Tensor, residual: torch.Tensor | None
           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from batchgen_data.kernels.cpu import ops
        return ops.add_rms_norm(x, residual, self.weight, self.eps)

    def _torch(self, x: torch.Tensor, residual: torch.Tensor | None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:  # one fused op, bitwise equal to the steps below in fp32
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return out if residual is None else (out, residual)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
