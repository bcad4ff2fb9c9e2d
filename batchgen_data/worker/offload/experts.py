"""Expert-granular streaming: an offloaded MoE layer copies in only the experts its tokens chose.

A streamed MoE layer's stacked expert weights (`FusedMoE.w13` [E, 2I, H], `w2` [E, H, I]) stay in
host memory (pinned on CUDA) outside the layer's slot. When the layer runs, its router picks each
token's experts; `FusedMoE.experts_for` then asks its `ExpertSource` for those ids. The
streamer copies the *routed* experts (ascending id, contiguous runs of ids in one copy) into the
front of a device expert set, and hands back views of the first n experts of that set plus the
ids remapped to 0..n-1. The remap keeps the experts' order, so the expert kernel visits the same
(token, expert) pairs in the same order as with the layer's own weights: outputs are bit-identical.

A step that routes its tokens to n of E experts moves n/E of the expert bytes. A batch of one
decode token moves k experts per layer instead of E; as the batch grows, more experts are hit,
but each copy serves more tokens, so bytes per token still fall (`tests/unit/worker/offload/`).

There are `num_sets` expert sets (one per layer slot, so double-buffered when the layer store is):
consecutive MoE layers alternate between them. On CUDA a copy into a set waits for the set's
`free` event (the last compute that read it), and the expert kernel waits for the copies' `ready`
event (`copy.StreamCopier`). The routed ids are known only once the router has run, so these
copies sit on the step's critical path; what overlaps them is the next layer's dense weights
copying on the same stream (`store.py`). docs/offload.md, "Expert-granular streaming".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen_data.layers.moe import FusedMoE
from batchgen_data.worker.offload.copy import Copier, host_buffer, make_copier

_ALIGN = 256


@dataclass
class _HostExperts:
    """One streamed MoE layer's experts in host memory."""

    w13: torch.Tensor  # [E, 2I, H] host
    w2: torch.Tensor  # [E, H, I] host

    @property
    def expert_bytes(self) -> int:
        return (self.w13[0].numel() * self.w13.element_size()
                + self.w2[0].numel() * self.w2.element_size())


def expert_set_bytes(w13: torch.Tensor, w2: torch.Tensor) -> int:
    """Device bytes of an expert set able to hold all experts of `w13` [E, 2I, H] and `w2`
    [E, H, I]: the w13 region, padded to the alignment, then the w2 region."""
    return _w2_offset(w13) + w2.numel() * w2.element_size()


def _w2_offset(w13: torch.Tensor) -> int:
    return -(-w13.numel() * w13.element_size() // _ALIGN) * _ALIGN


def _to_host(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    nbytes = t.numel() * t.element_size()
    buf = host_buffer(nbytes, device)
    buf.copy_(t.detach().reshape(-1).view(torch.uint8))
    return buf.view(t.dtype).view(t.shape)


class ExpertStreamer:
    """Streams the experts of the MoE layers `moes` (their weights leave the layers here): an
    `ExpertSource` (`layers/moe.py`), given to each layer by the weight store."""

    def __init__(self, moes: list[FusedMoE], num_sets: int, device: torch.device) -> None:
        assert moes and num_sets >= 1
        self.device = device
        self.host: dict[int, _HostExperts] = {}
        for moe in moes:
            self.host[id(moe)] = _HostExperts(_to_host(moe.w13, device), _to_host(moe.w2, device))
            for p in (moe.w13, moe.w2):
                p.data = torch.empty(0, dtype=p.dtype)  # placeholder: the bytes live in `host`
        self.set_bytes = max(expert_set_bytes(h.w13, h.w2) for h in self.host.values())
        self.sets = [torch.empty(self.set_bytes, dtype=torch.uint8, device=device)
                     for _ in range(num_sets)]
        self.copier: Copier = make_copier(device, num_sets)
        self.held = [0] * num_sets  # expert bytes each set holds now
        self.bytes_moved = 0
        self._last: int | None = None  # the set the last MoE layer computed from

    @property
    def workspace_bytes(self) -> int:
        return self.set_bytes * len(self.sets)

    @property
    def held_bytes(self) -> int:
        return sum(self.held)

    def experts_for(self, moe: FusedMoE, ids: torch.Tensor, counts: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(w13 [n, 2I, H], w2 [n, H, I], ids remapped to 0..n-1, counts of those n) for the n
        experts `ids` [T, k] routes to, copied into the next expert set."""
        host = self.host[id(moe)]
        active = torch.unique(ids)  # sorted ascending: the remap keeps the experts' order
        chosen = active.tolist()  # the one host sync: which experts to copy
        n = len(chosen)
        if self._last is not None:  # all of the previous MoE layer's work is enqueued
            self.copier.release(self._last)
        s = 0 if self._last is None else (self._last + 1) % len(self.sets)
        w13, w2 = self._views(s, host, n)
        for first, run in _runs(chosen):
            dst = slice(first[1], first[1] + run)
            src = slice(first[0], first[0] + run)
            self.copier.copy(s, w13[dst], host.w13[src])
            self.copier.copy(s, w2[dst], host.w2[src])
        self.held[s] = n * host.expert_bytes
        self.bytes_moved += n * host.expert_bytes
        self.copier.wait_ready(s)
        self._last = s
        lut = torch.zeros(moe.num_experts, dtype=ids.dtype, device=ids.device)
        lut[active] = torch.arange(n, dtype=ids.dtype, device=ids.device)
        return w13, w2, lut[ids], None if counts is None else counts[active]

    def _views(self, s: int, host: _HostExperts, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `n` experts' w13 and w2 of set `s`, laid out as `host`'s."""
        base = self.sets[s]
        off = _w2_offset(host.w13)
        per13 = host.w13[0].numel() * host.w13.element_size()
        per2 = host.w2[0].numel() * host.w2.element_size()
        w13 = base[:n * per13].view(host.w13.dtype).view(n, *host.w13.shape[1:])
        w2 = base[off:off + n * per2].view(host.w2.dtype).view(n, *host.w2.shape[1:])
        return w13, w2


def _runs(chosen: list[int]) -> list[tuple[tuple[int, int], int]]:
    """((expert id, slot) of each run's first expert, run length) for runs of consecutive ids:
    the experts [e, e+r) land in slots [s, s+r), so each run is one copy per tensor."""
    runs: list[tuple[tuple[int, int], int]] = []
    for slot, e in enumerate(chosen):
        if runs and runs[-1][0][0] + runs[-1][1] == e:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append(((e, slot), 1))
    return runs
