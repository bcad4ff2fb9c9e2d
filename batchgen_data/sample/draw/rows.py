"""What every path of the draw shares (`token_draw`, `candidate_scan`, `dense_draw`): the
per-row parameters of the rows one draw covers, and the column chunks a vocabulary-wide pass
goes through, so that no pass makes an ``[N, V]`` temporary."""
from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK_ELEMS = 1 << 21  # rows x columns per pass of a vocabulary-wide sum


def chunks(rows: int, vocab: int) -> list[tuple[int, int]]:
    """Column ranges ``[lo, hi)`` covering ``vocab`` columns, about ``CHUNK_ELEMS`` logits of
    ``rows`` rows each (at least 1024 columns)."""
    width = max(1024, CHUNK_ELEMS // max(rows, 1))
    return [(c, min(c + width, vocab)) for c in range(0, vocab, width)]


@dataclass(frozen=True)
class Rows:
    """The per-row parameters of the rows one draw covers (``[N]`` or ``[N, 1]``)."""
    seeds: torch.Tensor  # [N] int64
    steps: torch.Tensor  # [N] int64: the output index being drawn
    temperature: torch.Tensor  # [N, 1] float32, > 0
    top_k: torch.Tensor  # [N, 1] int64, >= V when off
    top_p: torch.Tensor | None  # [N, 1] float32, None when no row has top_p < 1
    min_p: torch.Tensor | None  # [N, 1] float32, None when no row has min_p > 0

    def take(self, idx: torch.Tensor) -> "Rows":
        """The rows ``idx [M]`` of these."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx]
        return Rows(*(pick(t) for t in (self.seeds, self.steps, self.temperature, self.top_k,
                                        self.top_p, self.min_p)))
