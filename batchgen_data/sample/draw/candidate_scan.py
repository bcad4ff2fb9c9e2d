"""The candidates of the draw (`sample/draw/token_draw.py`): the tokens whose logit is at least their
row's floor, listed row-major, and, for top-p, each row's softmax mass, in one pass over the
logits (`scan`); those candidates padded per row for the per-row race (`padded`), or raced as
listed (`flat_race`, the rows without top-k and top-p).

On the CPU the pass goes a few rows at a time: the compare's mask of a block of rows, and the
rows themselves for the mass, stay in the core's cache while numpy lists the mask's true
entries, instead of a ``[N, V]`` bool mask written to memory and read back (twice: counted,
then listed). numpy's compare against a per-row floor is also several times faster than
torch's broadcast compare there. Elsewhere (or for logits numpy cannot view) one torch compare
and ``nonzero``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen_data.sample.draw import draw_hash  # looked up at call time: one hash for all paths
from batchgen_data.sample.draw.rows import Rows

# logits per block of rows on the CPU (at least one row): 1 MiB of float32, which with its
# mask and the mass's buffer stays within a core's L2 cache (a smaller block only adds calls)
SCAN_ELEMS = 1 << 18


@dataclass(frozen=True)
class Listing:
    """The candidates of a scan."""
    flat: torch.Tensor  # [M] int64: row * V + token id, ascending
    vals: torch.Tensor  # [M] float32: their logits
    counts: torch.Tensor  # [N] int64: how many of each row's tokens ``flat`` lists
    over: torch.Tensor | None  # [N] bool: rows over the cap, not listed; None without a cap
    total: torch.Tensor | None  # [N, 1] float32: sum_v exp(logit_v / T - top), when asked

    def each(self, t: torch.Tensor) -> torch.Tensor:
        """``[N] -> [M]``: each candidate's copy of its row's value (numpy's repeat on the
        CPU, ten times torch's ``repeat_interleave`` there)."""
        if t.device.type == "cpu":
            return torch.from_numpy(np.repeat(t.numpy(), self.counts.numpy()))
        return t.repeat_interleave(self.counts, output_size=self.flat.shape[0])

    def rows_cols(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each candidate's row and token id ``[M]``."""
        rows = self.each(torch.arange(self.counts.shape[0], device=self.flat.device))
        return rows, self.flat - rows * vocab


def scan(logits: torch.Tensor, lowest: torch.Tensor, cap: float | None = None,
         temp: torch.Tensor | None = None, top: torch.Tensor | None = None) -> Listing:
    """The tokens with ``logits [N, V] >= lowest [N, 1]`` (``+inf``: none of the row's). A row
    with a finite floor and more than ``cap`` of them is flagged in ``over`` and left out of
    the listing. With ``temp`` and ``top`` (``[N, 1]``), also the mass
    ``sum exp(logits / T - top)`` of each row that lists candidates (1 for the others on the
    CPU): a few rows at a time there, of the whole ``[N, V]`` elsewhere (the caller's block)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 \
            and logits.is_contiguous() and logits.shape[1] > 0:
        return _scan_cpu(logits, lowest, cap, temp, top)
    mask = logits >= lowest
    counts = torch.count_nonzero(mask, -1)
    over = None
    if cap is not None:
        over = (counts > cap) & ~torch.isposinf(lowest.reshape(-1))
        mask[over] = False
        counts = counts.masked_fill(over, 0)
    flat = mask.view(-1).nonzero().squeeze(1)
    total = None
    if temp is not None and top is not None:
        total = torch.exp(logits / temp - top).sum(-1, keepdim=True)
    return Listing(flat, logits.reshape(-1).index_select(0, flat), counts, over, total)


def _scan_cpu(logits: torch.Tensor, lowest: torch.Tensor, cap: float | None,
              temp: torch.Tensor | None, top: torch.Tensor | None) -> Listing:
    n, vocab = logits.shape
    x = logits.numpy()
    low = lowest.reshape(n, 1).numpy()
    step = max(1, SCAN_ELEMS // vocab)
    mask = np.empty((min(step, n), vocab), dtype=bool)
    counts = np.zeros(n, dtype=np.int64)
    over = np.zeros(n, dtype=bool)
    parts: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    want_total = temp is not None and top is not None
    total = torch.ones(n, 1)
    buf = torch.empty(mask.shape) if want_total else None
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        if np.isposinf(low[r0:r1]).all():  # rows that list nothing (greedy, top-k)
            continue
        if buf is not None:  # the same float operations as `token_draw.scaled_sumexp`
            b = torch.div(logits[r0:r1], temp[r0:r1], out=buf[:r1 - r0])
            total[r0:r1] = b.sub_(top[r0:r1]).exp_().sum(-1, keepdim=True)
        m = mask[:r1 - r0]
        np.greater_equal(x[r0:r1], low[r0:r1], out=m)
        c = np.array([np.count_nonzero(row) for row in m])  # 8x faster than axis=1
        if cap is not None:  # a flat row: not listed (most of its vocabulary)
            big = (c > cap) & ~np.isposinf(low[r0:r1, 0])
            if big.any():
                over[r0:r1] = big
                m[big] = False
                c[big] = 0
        idx = np.flatnonzero(m)
        counts[r0:r1] = c
        vals.append(x[r0:r1].reshape(-1)[idx])  # from the cache, not a gather from memory later
        parts.append(idx + r0 * vocab if r0 else idx)
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    val = np.concatenate(vals) if vals else np.zeros(0, dtype=np.float32)
    return Listing(torch.from_numpy(flat), torch.from_numpy(val), torch.from_numpy(counts),
                   torch.from_numpy(over) if cap is not None else None,
                   total if want_total else None)


def padded(listing: Listing, vocab: int, ranked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates of ``listing`` as ``vals, ids [N, C]`` (`band_candidates`)."""
    counts = listing.counts
    n, device = counts.shape[0], counts.device
    rows, cols = listing.rows_cols(vocab)
    width = max(1, int(counts.max())) if rows.numel() else 1
    pos = torch.arange(rows.numel(), device=device) - listing.each(counts.cumsum(0) - counts)
    vals = torch.full((n, width), float("-inf"), device=device)
    ids = torch.full((n, width), vocab, dtype=torch.long, device=device)
    vals[rows, pos] = listing.vals
    ids[rows, pos] = cols
    if ranked:
        vals, order = vals.sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, order)
    return vals, ids


def flat_race(logits: torch.Tensor, listing: Listing, rows: Rows, top: torch.Tensor
              ) -> torch.Tensor:
    """The race over the candidates of ``listing``, for rows without top-k and top-p (the same
    float operations as the race over the whole vocabulary): ``top [N, 1]`` each row's best
    scaled logit. Tokens ``[N]`` (a row without
    candidates gets ``V``-or-more)."""
    n, vocab = logits.shape
    m = listing.flat.shape[0]
    at_row, cols = listing.rows_cols(vocab)
    s = listing.vals / rows.temperature.squeeze(1)[at_row]
    u = draw_hash.keyed_uniform(draw_hash.stream_keys(rows.seeds, rows.steps)[at_row], cols)
    race = s - torch.log(-torch.log(u))  # [M]: the same float operations as the full race
    if rows.min_p is not None:
        drop = torch.exp(s - top.squeeze(1)[at_row]) < rows.min_p.squeeze(1)[at_row]
        race.masked_fill_(drop, float("-inf"))
    big = torch.iinfo(torch.long).max
    if race.device.type == "cpu" and m:  # numpy's segment reductions over the sorted rows
        c = listing.counts.numpy()
        live = c > 0
        starts = (np.cumsum(c) - c)[live]
        best = np.maximum.reduceat(race.numpy(), starts)
        win = np.where(race.numpy() == np.repeat(best, c[live]), cols.numpy(), big)
        token = np.full(n, big, dtype=np.int64)
        token[live] = np.minimum.reduceat(win, starts)  # a tie: the lower id
        return torch.from_numpy(token)
    best = torch.full((n,), float("-inf"), device=logits.device).scatter_reduce_(
        0, at_row, race, "amax")
    win = torch.where(race == best[at_row], cols, big)  # a tie: the lower id
    return torch.full((n,), big, dtype=torch.long, device=logits.device).scatter_reduce_(
        0, at_row, win, "amin")


def top_k_by_id(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule's ``k`` best of each row (`token_draw`'s top-k), ``vals, ids [N, k]`` best first with ties ranked by
    token id. ``topk`` alone orders tied values as its kernel happens to, on each device its own
    way, and a tie across the k-th place may keep a higher id; bf16 logits tie often. So: one
    ``topk`` of ``k + 1``; a row whose k-th and next values tie takes the tokens above the tie
    plus the lowest ids of the tie (one compare over that row); then a stable re-rank by id."""
    vocab = logits.shape[1]
    vals, ids = logits.topk(min(k + 1, vocab), -1)
    if vals.shape[1] > k:
        cross = vals[:, k - 1] == vals[:, k]
        vals, ids = vals[:, :k].clone(), ids[:, :k].clone()
        if bool(cross.any()):
            idx = cross.nonzero().squeeze(1)
            sub = logits[idx]  # [M, V]
            cut = vals[idx, k - 1:k]  # [M, 1] the tied value at the k-th place
            above = sub > cut
            tied = sub == cut
            need = k - above.sum(-1, keepdim=True)  # [M, 1] tied tokens to keep
            keep = above | (tied & (tied.cumsum(-1) <= need))  # exactly k a row, id order
            cols = keep.nonzero()[:, 1].view(-1, k)
            ids[idx] = cols
            vals[idx] = sub.gather(1, cols)
    by_id = ids.argsort(-1)
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    vals, order = vals.sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, order)
