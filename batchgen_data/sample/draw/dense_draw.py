"""The dense race of flat rows (module doc of `sample/draw/token_draw.py`): a row whose top-p band
holds more than `token_draw.FLAT_SHARE` of its vocabulary races over its dense logits, its
nucleus cut from a histogram of its mass by scaled logit, only the bucket where the mass
crosses top_p ranked token by token. Same tokens as the full-vocabulary race."""
from __future__ import annotations

import numpy as np
import torch

from batchgen_data.sample.draw import draw_hash  # looked up at call time: one hash for all paths
from batchgen_data.sample.draw import rows as draw_rows  # CHUNK_ELEMS looked up at call time
from batchgen_data.sample.draw.rows import Rows

# A flat row (more than FLAT_SHARE of its vocabulary inside the top-p band) races over the
# dense logits instead of a listed, sorted band: its nucleus comes from a histogram of the
# row's probability mass by scaled logit, BUCKETS_PER_UNIT buckets per unit below the row's
# best (the last of BUCKETS holds everything lower), and only the bucket where the mass crosses
# top_p is ranked token by token.
BUCKETS_PER_UNIT = 256.0
BUCKETS = 4096


def _bucket(s: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """The histogram bucket of scaled logits ``s`` below the row's best ``top [N, 1]``
    (``s <= top``; ``-inf`` falls in the last bucket)."""
    return ((top - s) * BUCKETS_PER_UNIT).clamp_(0, BUCKETS - 1).long()


def dense_top_p_race(logits: torch.Tensor, rows: Rows, top: torch.Tensor) -> torch.Tensor:
    """Tokens ``[N]`` of rows without top-k whose nucleus is a large share of the vocabulary
    (the same rule and race values as `race_over_candidates` on the ranked band, without
    listing or sorting the band). Two passes over the logits, chunk by chunk:

    1. each token's mass ``exp(s - top)`` summed per (row, bucket) in float64; the bucket
       where the cumulative mass, best bucket first, reaches ``top_p`` of the row's total is
       the row's cut: tokens of better buckets are all in the nucleus (the mass ranked before
       any of them is below top_p), tokens of worse buckets none;
    2. the race over the tokens of the better buckets (min-p applied), each chunk's winner
       kept; the tokens of the cut bucket are listed and ranked (scaled logit, then id) and
       kept while the mass before them is below top_p, then join the race.
    A row with ``top_p >= 1`` keeps every bucket; rows that all have it (a flat row without
    top-p) skip the histogram: one pass, every token in the race."""
    n, vocab = logits.shape
    temp = rows.temperature
    chunks = draw_rows.chunks(n, vocab)
    cuts = rows.top_p is not None and bool((rows.top_p < 1).any())
    if cuts:
        top_p = rows.top_p
        base = (torch.arange(n, device=logits.device) * BUCKETS).unsqueeze(1)
        mass = torch.zeros(n * BUCKETS, dtype=torch.float64, device=logits.device)
        for lo, hi in chunks:
            s = logits[:, lo:hi] / temp
            e = torch.exp(s - top)
            mass += torch.bincount((_bucket(s, top) + base).view(-1),
                                   weights=e.view(-1).double(), minlength=n * BUCKETS)
        cum = mass.view(n, BUCKETS).cumsum(1)
        target = top_p.double() * cum[:, -1:]  # [N, 1]
        cut = (cum < target).sum(1, keepdim=True)  # the first bucket whose cumulative mass reaches it
        cut = torch.where(top_p >= 1, BUCKETS, cut)
        above = torch.where(cut > 0, cum.gather(1, (cut - 1).clamp(0, BUCKETS - 1)), 0.0)

    keys = draw_hash.stream_keys(rows.seeds, rows.steps).unsqueeze(1)
    best = torch.full((n, 1), float("-inf"), device=logits.device)
    win = torch.full((n, 1), vocab, dtype=torch.long, device=logits.device)
    edge_rows, edge_cols, edge_s, edge_race = [], [], [], []
    for lo, hi in chunks:
        s = logits[:, lo:hi] / temp
        cols = torch.arange(lo, hi, device=logits.device).unsqueeze(0)
        race = s - torch.log(-torch.log(draw_hash.keyed_uniform(keys, cols)))
        below_p = torch.exp(s - top) < rows.min_p if rows.min_p is not None else None
        if not cuts:  # no nucleus: every token races (min-p applied)
            if below_p is not None:
                race.masked_fill_(below_p, float("-inf"))
            chunk_best, at = race.max(1, keepdim=True)
            win = torch.where(chunk_best > best, at + lo, win)
            best = torch.maximum(best, chunk_best)
            continue
        key = _bucket(s, top)
        drop = key >= cut
        edge = key == cut
        if below_p is not None:
            drop |= below_p
            edge &= ~below_p
        if bool(edge.any()):
            r, c = edge.nonzero(as_tuple=True)
            edge_rows.append(r)
            edge_cols.append(c + lo)
            edge_s.append(s[r, c])
            edge_race.append(race[r, c])
        race.masked_fill_(drop, float("-inf"))
        chunk_best, at = race.max(1, keepdim=True)  # the first index of the maximum
        better = chunk_best > best  # a tie keeps the earlier chunk's lower id
        win = torch.where(better, at + lo, win)
        best = torch.maximum(best, chunk_best)
    win, best = win.squeeze(1), best.squeeze(1)
    if not edge_rows:
        return win
    r, c, s, race = (torch.cat(x) for x in (edge_rows, edge_cols, edge_s, edge_race))
    # rank the cut bucket's tokens: by row, then best scaled logit first, then lower id
    order = torch.from_numpy(np.lexsort((c.numpy(), (-s).numpy(), r.numpy())))
    r, c, s, race = r[order], c[order], s[order], race[order]
    e = torch.exp(s - top.squeeze(1)[r]).double()
    run = e.cumsum(0)
    counts = torch.bincount(r, minlength=n)
    start = counts.cumsum(0) - counts  # each row's first position
    before_in_row = run - e - torch.where(start[r] > 0, run[(start[r] - 1).clamp(min=0)], 0.0)
    kept = above.squeeze(1)[r] + before_in_row < target.squeeze(1)[r]
    race = race.masked_fill(~kept, float("-inf"))
    edge_best = torch.full((n,), float("-inf"), device=logits.device).scatter_reduce_(
        0, r, race, "amax")
    big = torch.iinfo(torch.long).max
    edge_win = torch.full((n,), big, dtype=torch.long, device=logits.device).scatter_reduce_(
        0, r, torch.where(race == edge_best[r], c, big), "amin")
    take = (edge_best > best) | ((edge_best == best) & (edge_win < win))
    return torch.where(take, edge_win, win)
