"""Partial rotary embedding: only the first `rotary_dim` channels of each head rotate (NeoX
layout within them), the rest pass through, as `partial_rotary_factor` asks (GLM-4.5: half of
each head, Phi-4-mini: three quarters).

The frequencies are those of a `rotary_dim`-wide head, so the position table is
`RotaryEmbedding`'s built for that width. The Triton kernel rotates the first R channels of
wider heads itself; the C rotation takes whole heads only, so a partial rotation on the CPU
runs on torch (one gather of the table per step, two fused elementwise passes).
"""
from __future__ import annotations

from typing import Any

import torch

from batchgen_data.layers.backend import current
from batchgen_data.layers.rotary import RotaryEmbedding, _rotate, rope_parameters


def rotary_dim(config: Any, head_dim: int) -> int:
    """The rotated channels of a head: `partial_rotary_factor` (rope parameters first, then the
    config's own field) of `head_dim`, HF's int() rounding."""
    factor = rope_parameters(config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None)
    dim = int(head_dim * float(1.0 if factor is None else factor))
    if dim <= 0 or dim % 2 or dim > head_dim:
        raise ValueError(f"partial_rotary_factor={factor} gives {dim} rotary channels of a "
                         f"{head_dim}-wide head: need an even number in [2, {head_dim}]")
    return dim


class PartialRotaryEmbedding(RotaryEmbedding):
    """`RotaryEmbedding` over the first `rotary_dim` of `head_dim` channels."""

    def __init__(self, config: Any, head_dim: int, rotary_dim: int, max_positions: int) -> None:
        super().__init__(config, rotary_dim, max_positions)  # [max_pos, R] table
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        if not current().triton:
            self._forward = self._partial_torch

    def _partial_torch(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._cos_sin(positions)  # [T, 1, R/2]
        r = self.rotary_dim
        return tuple(torch.cat([_rotate(x[..., :r], cos, sin), x[..., r:]], dim=-1)
                     for x in (q, k))  # type: ignore[return-value]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}"
