"""The token embedding, which a tied-embedding model also uses as its output projection.

Tied models (SmolLM2, Qwen2 small sizes) would otherwise need the [vocab, hidden] matrix twice:
plain rows for the lookup and a packed copy for the logits. On a "panels" backend the one copy
is kept in the panel layout (the lookup gathers rows out of the panels, a strided copy of a few
KB per token); on the others the plain copy serves both (logits through `F.linear`, or for a
decode step's few rows the AVX2 row kernel `kernels.cpu.linear.rows_linear`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen_data.kernels.cpu import linear as cpu_linear
from batchgen_data.layers.backend import current
from batchgen_data.layers.linear import packed_forward, unpack_weight


class VocabEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, tied_head: bool = False) -> None:
        super().__init__()
        self.vocab, self.hidden = vocab, hidden
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(vocab, hidden))
        # only a tied head benefits from a packed layout: a lookup alone wants plain rows
        self.layout = "panels" if tied_head and current().linear == "panels" else "plain"
        self.register_buffer("packed", None, persistent=False)
        # a tied head on plain rows: few-row logits through the AVX2 C kernel where it runs
        self.c_rows = tied_head and self.layout == "plain" and current().c_rows

    def process_weights_after_loading(self) -> None:
        if self.layout != "panels" or self.weight is None:
            return
        self.packed = cpu_linear.pack_panels(self.weight.detach())
        self.weight = None

    def plain_weight(self) -> torch.Tensor:
        """The [vocab, hidden] rows, whatever the layout (a re-partition reads them back)."""
        if self.packed is None:
            return self.weight.detach()
        return unpack_weight(self.packed, self.layout, self.vocab, self.hidden)

    def release_weight(self) -> None:
        """Drops the rows in every form (once a re-partition has copied them)."""
        self.weight, self.packed = None, None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]."""
        if self.packed is None:
            return F.embedding(input_ids, self.weight)
        return cpu_linear.panel_rows(self.packed, input_ids)

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied output projection: [N, hidden] -> logits [N, vocab]."""
        if self.packed is None:
            few = hidden.dim() == 2 and hidden.shape[0] <= cpu_linear.ROWS_GEMM_MAX_ROWS
            if self.c_rows and few:
                return cpu_linear.rows_linear(hidden, self.weight)
            return F.linear(hidden, self.weight)
        return packed_forward(hidden, self.packed, None, self.vocab, self.layout)
