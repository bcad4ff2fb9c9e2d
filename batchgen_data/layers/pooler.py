"""Pooling over a packed (varlen) batch of hidden states, and non-causal varlen attention.

A step's hidden states are one [T, hidden] tensor: the chunks of several requests one after
another, no padding. `chunk_pools` reduces every chunk at once (its sum, first row and last
row); the engine adds a request's chunks up across steps, so a prompt prefilled in pieces
pools to what one pass would give. `finish_pool` turns those into the pooled vector of
LAST / CLS / MEAN pooling. `varlen_attention` is the encoders' attention: each sequence of the
pack attends to all of its own tokens (no causal mask) and to nothing else.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class PoolingType(str, enum.Enum):
    LAST = "LAST"
    CLS = "CLS"
    MEAN = "MEAN"


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: PoolingType
    normalize: bool

    def __post_init__(self) -> None:
        if not isinstance(self.pooling_type, PoolingType):
            raise TypeError(f"pooling_type={self.pooling_type!r}: must be a PoolingType")


@dataclass
class ChunkPools:
    """Per chunk of a step, in pack order: float32 sums [C, hidden], first rows and last rows."""

    sums: torch.Tensor
    firsts: torch.Tensor
    lasts: torch.Tensor


def chunk_pools(hidden: torch.Tensor, lens: list[int], want_sums: bool) -> ChunkPools:
    """hidden [T, hidden] packed as chunks of `lens` tokens (sum(lens) == T)."""
    dev = hidden.device
    n = torch.tensor(lens, device=dev)
    ends = torch.cumsum(n, 0)
    starts = ends - n
    h32 = hidden.float()
    if want_sums:
        seg = torch.repeat_interleave(torch.arange(len(lens), device=dev), n)
        sums = h32.new_zeros(len(lens), hidden.shape[1]).index_add_(0, seg, h32)
    else:
        sums = h32.new_empty(0, hidden.shape[1])
    return ChunkPools(sums, h32[starts], h32[ends - 1])


def finish_pool(kind: PoolingType, total: torch.Tensor | None, count: int,
                first: torch.Tensor | None, last: torch.Tensor | None) -> torch.Tensor:
    """The pooled [hidden] vector of one request from its chunks' running values."""
    if kind is PoolingType.MEAN:
        assert total is not None and count > 0
        return total / count
    out = first if kind is PoolingType.CLS else last
    assert out is not None
    return out


def matryoshka(vecs: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Truncate [N, hidden] to its first `dimensions` values, then L2-normalise if asked."""
    if dimensions is not None:
        vecs = vecs[..., :dimensions]
    return F.normalize(vecs, p=2, dim=-1) if normalize else vecs


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                     scale: float, window: int | None = None) -> torch.Tensor:
    """q/k/v [T, H, D] packed as sequences of `lens` tokens; bidirectional within each, or
    with `window` only between tokens at most `window` positions apart (a sliding window).
    Sequences of the same length go through SDPA together: fewer calls, no padding."""
    out = torch.empty_like(q)
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lens):
        by_len.setdefault(n, []).append(i)
    for n, idx in by_len.items():
        mask = None
        if window is not None and n > window + 1:
            pos = torch.arange(n, device=q.device)
            mask = (pos.view(-1, 1) - pos.view(1, -1)).abs() <= window  # True: attends
        if len(idx) == 1:
            a = offsets[idx[0]]
            qs, ks, vs = (t[a:a + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            out[a:a + n] = o[0].transpose(0, 1)
            continue
        rows = torch.cat([torch.arange(offsets[i], offsets[i] + n) for i in idx]).to(q.device)
        qs, ks, vs = (t[rows].view(len(idx), n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)  # [B, H, n, D]
        out[rows] = o.transpose(1, 2).reshape(-1, *q.shape[1:])
    return out
