"""The random draw of the sampler: temperature, top-k / top-p / min-p truncation and the
exponential race, touching each logit a few times and hashing only the tokens that could win.

The rule. A row draws ``argmax_v (logit_v / T + g_v)`` over the tokens its truncation keeps,
with ``g_v = -log(-log u_v)`` (a Gumbel variate) and ``u_v`` a counter-based hash of
(sequence seed, output index, token id): (seed, output index) mixed into one key first, then the
token id (so consecutive steps draw independent noise; tests/unit/engine/
test_sampling_statistics.py checks it). A tie goes to the lower token id. ``u`` is a 24-bit
uniform, ``(z + 0.5) / 2**24`` in float32, at most ``1 - 2**-24``: float32 rounds the top value
``z = 2**24 - 1`` to exactly 1.0, which made ``g = +inf`` (and NaN on a masked token), so one
draw in ~110 at a 151,936 vocabulary picked a token whatever its logit; that one value is
clamped to the largest float below 1. Every other uniform is unchanged.
Truncation, in vLLM's order: top-k keeps the ``top_k`` best logits; top-p then keeps a token
while the probability mass of the tokens ranked before it (softmax over the top-k set, or the
whole vocabulary without top-k; ties ranked by token id) is below ``top_p``; min-p drops a
token with ``exp(s_v - s_max) < min_p``, ``s = logit / T``.

Because ``u`` depends on the token id alone, the race can run over any subset of tokens that
holds every kept token that could win, and it picks the same token as a race over the whole
vocabulary. ``g`` is bounded, ``G_MIN <= g <= G_MAX`` (-2.85 and 16.6), so once some kept
token's race value ``L`` is known, a token with ``s < L - G_MAX`` cannot win. So:
  * rows with top_k race over ``K`` candidates from one ``topk`` call (``K`` the largest top_k
    of the batch);
  * the other rows take the tokens within ``BAND`` of their best logit (``BAND_TOP_P`` for
    top-p rows) in one compare over the logits; their race gives ``L``. A top-p row whose band
    holds ``top_p`` of the mass is done (its nucleus is inside). The others take, in a second
    compare, the tokens with ``s >= max(L - G_MAX, the min-p floor, the nucleus floor)``: the
    nucleus floor is ``p >= (1 - top_p) / (2 V)``, below which a token's better-ranked mass
    exceeds ``top_p``. Only those candidates are hashed: for the peaked logits of a trained
    model, a small share of the vocabulary instead of all of it.
  * a flat row, whose band holds more than ``FLAT_SHARE`` of the vocabulary (a broad
    distribution, a random model, a high temperature), would list (and, with top-p, sort) most
    of its vocabulary that way; on the CPU it races over its dense logits instead
    (`sample/draw/dense_draw.py`): its nucleus cut from a histogram of its mass by scaled logit, only
    the one bucket where the mass crosses top_p ranked. Same tokens (a test draws both ways
    against the full sort).
A compare and its listing are `sample/draw/candidate_scan.py`'s: on the CPU a few rows at a time,
the rows still in cache while their candidates are listed and top-p's mass summed, so the
first compare, the count of each row's band and the mass are one pass over the logits.
Same tokens as the full-vocabulary race: candidates get the same float operations. The floors
are lowered by a margin far above float rounding, so they only ever take more candidates.
The probabilities that top-p and min-p compare are computed from ``exp(s - s_max)``, so a
token whose cumulative mass lies within float rounding (~1e-7) of top_p, or whose probability
lies that close to the min-p floor, may fall on the other side of it than in another sum order.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from batchgen_data.sample.draw import candidate_scan, dense_draw
from batchgen_data.sample.draw import rows as draw_rows  # CHUNK_ELEMS looked up at call time
from batchgen_data.sample.draw.candidate_scan import Listing
from batchgen_data.sample.draw.candidate_scan import flat_race, padded, top_k_by_id
from batchgen_data.sample.draw.draw_hash import G_MAX, hash_uniform_at
from batchgen_data.sample.draw.rows import Rows

BAND_TOP_P = 10.0  # top-p rows: first candidates within this of the best scaled logit


def scaled_sumexp(logits: torch.Tensor, temperature: torch.Tensor, top: torch.Tensor
                  ) -> torch.Tensor:
    """``sum_v exp(logits[:, v] / T - top)`` ``[N, 1]`` over the whole vocabulary, chunk by
    chunk into one reused buffer (no ``[N, V]`` temporary)."""
    total = torch.zeros_like(top)
    parts = draw_rows.chunks(*logits.shape)
    buf = torch.empty(logits.shape[0], parts[0][1], device=logits.device)
    for lo, hi in parts:
        b = torch.div(logits[:, lo:hi], temperature, out=buf[:, :hi - lo])
        total += b.sub_(top).exp_().sum(-1, keepdim=True)
    return total


def race_over_candidates(vals: torch.Tensor, ids: torch.Tensor, rows: Rows,
                         total: torch.Tensor | None, ranked: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-row work on candidates: truncation and the race.

    vals ``[N, C]`` the candidates' logits (``-inf`` padding), ids ``[N, C]`` their token ids
    (padding ``>= V``); every row holds its best logit. ``ranked``: each row sorted best
    first, ties by id (needed for top-k and top-p). total ``[N, 1]``: the mass
    ``sum exp(s - s_max)`` that top-p divides by; None: the mass of the row's top-k candidates.
    Returns the token ``[N]`` int64, its race value ``[N]`` and ``settled [N]`` bool: the
    candidates hold top_p of the mass (so the nucleus lies inside them)."""
    n, c = vals.shape
    s = vals / rows.temperature  # [N, C]: the same division as a race over the vocabulary
    keep = s > float("-inf")
    if rows.min_p is not None or (ranked and rows.top_p is not None):
        top = s[:, :1] if ranked else s.amax(-1, keepdim=True)  # [N, 1]
        e = torch.exp(s - top)  # [N, C]: probability relative to the row's best
    settled = torch.ones(n, dtype=torch.bool, device=vals.device)
    if ranked:
        keep &= torch.arange(c, device=vals.device).unsqueeze(0) < rows.top_k
    if ranked and rows.top_p is not None:
        e_k = e.masked_fill(~keep, 0.0)
        mass = e_k.sum(-1, keepdim=True) if total is None else total
        probs = e_k / mass
        cum = probs.cumsum(-1)
        settled = (cum[:, -1:] >= rows.top_p).squeeze(1) | (rows.top_p >= 1).squeeze(1)
        nucleus = (cum - probs) < rows.top_p  # mass of the better-ranked tokens
        nucleus[:, 0] = True
        keep &= nucleus | (rows.top_p >= 1)  # no cut where the rounded sum passes 1
    if rows.min_p is not None:
        keep &= ~(e < rows.min_p)
    u = hash_uniform_at(rows.seeds, rows.steps, ids)
    race = (s - torch.log(-torch.log(u))).masked_fill_(~keep, float("-inf"))
    best = race.amax(-1, keepdim=True)  # [N, 1]
    big = torch.iinfo(torch.long).max
    token = torch.where(race == best, ids, big).amin(-1)  # a tie: the lower id
    return token, best.squeeze(1), settled


RaceFn = Callable[[torch.Tensor, torch.Tensor, Rows, "torch.Tensor | None", bool],
                  "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]


def band_candidates(logits: torch.Tensor, floor: torch.Tensor, ranked: bool,
                    listing: Listing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens with ``logits >= floor [N, 1]`` (``+inf``: none), as padded
    ``vals, ids [N, C]`` with ``C`` the largest count of a row: in id order, or best first
    (ties by id) when ``ranked``. Padding: ``-inf`` and id ``V``. ``listing``: that scan,
    when the caller has it already."""
    listing = candidate_scan.scan(logits, floor) if listing is None else listing
    return padded(listing, logits.shape[1], ranked)


def row_argmax(logits: torch.Tensor, block: int = 128, others: int = 8
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the first index of each row's largest logit ``[N]``, that logit ``[N, 1]``, the
    largest logit's index in each of the ``others`` best blocks ``[N, B]``): the max of blocks
    of ``block`` columns, then argmaxes inside the best blocks. torch's CPU argmax is several
    times slower than its max, and this is one max pass plus small work."""
    n, vocab = logits.shape
    main = vocab - vocab % block
    if main == 0:
        top, at = logits.max(-1, keepdim=True)
        return at.squeeze(1), top, at
    blocks = logits[:, :main].view(n, main // block, block)  # [N, B, block]
    block_max = blocks.amax(-1)  # [N, B]
    first = block_max.argmax(-1)  # [N]: the first block holding the max
    rows = torch.arange(n, device=logits.device)
    inner = blocks[rows, first]  # [N, block]
    at = first * block + inner.argmax(-1)
    top = inner.amax(-1, keepdim=True)
    best = block_max.topk(min(others, block_max.shape[1]), -1).indices  # [N, B]
    near = best * block + blocks[rows.unsqueeze(1), best].argmax(-1)
    if main < vocab:  # the last columns, when the vocabulary is no multiple of the block
        tail = logits[:, main:]
        t_top, t_at = tail.max(-1, keepdim=True)
        later = t_top > top  # strictly: a tie keeps the earlier index
        at = torch.where(later.squeeze(1), t_at.squeeze(1) + main, at)
        top = torch.maximum(top, t_top)
        near = torch.cat([near, t_at + main], 1)
    return at, top, near


def _margin(top: torch.Tensor) -> torch.Tensor:
    """How far below a floor candidates are taken: far above the float rounding of the race
    values (~1e-7 of their size), far below any logit gap that matters."""
    return 1e-4 * (1.0 + top.abs() + G_MAX)


def threshold_race(logits: torch.Tensor, rows: Rows, active: torch.Tensor,
                   race: RaceFn = race_over_candidates, flat: bool = True) -> torch.Tensor:
    """Tokens ``[N]`` for the ``active [N]`` rows of ``logits [N, V]`` whose top_k is off
    (the others get a value the caller discards): the floor from the best logit's race value,
    the band for top-p rows, and a second pass where a nucleus is wider (module doc). Rows
    without top-p race over their candidates listed flat (``flat``), or padded through
    ``race``."""
    n, vocab = logits.shape
    logits = logits.contiguous()  # the scan views it flat
    temp = rows.temperature
    at, l_top, near = row_argmax(logits)
    top = l_top / temp  # [N, 1]: the best scaled logit
    # the best race value of some kept tokens: the winner's is at least this. The best
    # logit is always kept; the best of other blocks too, without top-p (and above min-p)
    s_near = logits.gather(1, near) / temp  # [N, B]
    race_near = s_near - torch.log(-torch.log(hash_uniform_at(rows.seeds, rows.steps, near)))
    lost = torch.zeros_like(race_near, dtype=torch.bool)
    if rows.min_p is not None:
        lost |= torch.exp(s_near - top) < rows.min_p
    if rows.top_p is not None:
        lost |= rows.top_p < 1
    race_at = top - torch.log(-torch.log(hash_uniform_at(rows.seeds, rows.steps,
                                                         at.unsqueeze(1))))
    known = torch.maximum(race_at, race_near.masked_fill(lost, float("-inf")).amax(
        -1, keepdim=True))
    margin = _margin(top)
    inf = torch.full_like(top, float("inf"))
    uses_p = rows.top_p is not None
    floor = known - G_MAX
    if rows.min_p is not None:
        floor = torch.maximum(floor, top + torch.log(rows.min_p))
    if uses_p:
        floor = torch.where(rows.top_p < 1, torch.maximum(floor, top - BAND_TOP_P), floor)
    lowest = torch.where(active.unsqueeze(1), (floor - margin) * temp, inf)
    # flat rows (over the cap) race over the dense logits (dense_top_p_race), the rest over
    # their listed candidates, a block of rows at a time
    cap = FLAT_SHARE * vocab if flat else None
    token = torch.empty(n, dtype=torch.long, device=logits.device)
    best = torch.empty(n, device=logits.device)
    settled = torch.ones(n, dtype=torch.bool, device=logits.device)
    over = torch.zeros(n, dtype=torch.bool, device=logits.device)
    threads = torch.get_num_threads() if logits.device.type == "cpu" else 0
    # top-p's mass: on one thread the scan sums it while each row is in cache; with more,
    # every row-sized op would wake the thread pool (slow under OMP_WAIT_POLICY=PASSIVE), so
    # it is summed up front in scaled_sumexp's large chunks
    fused_mass = uses_p and threads == 1
    total = scaled_sumexp(logits, temp, top) if uses_p and not fused_mass else \
        torch.ones_like(top)
    step = max(1, _BLOCK_ELEMS * threads * threads // vocab) if threads else n
    for r0 in range(0, n, step):
        part = slice(r0, min(r0 + step, n))
        sub = rows.take(torch.arange(part.start, part.stop, device=logits.device))
        listing = candidate_scan.scan(logits[part], lowest[part], cap,
                                      temp[part] if fused_mass else None, top[part])
        if listing.over is not None:
            over[part] = listing.over
        if not uses_p:
            token[part] = flat_race(logits[part], listing, sub, top[part]) if flat else \
                race(*padded(listing, vocab, False), sub, None, False)[0]
            continue
        if fused_mass:
            total[part] = listing.total
        vals, ids = band_candidates(logits[part], lowest[part], True, listing)
        token[part], best[part], settled[part] = race(vals, ids, sub, total[part], True)
    token = _with_dense(token, over, logits, rows, top)
    if not uses_p:
        return token
    # a top-p row whose band holds less than top_p of the mass: its nucleus floor, in one
    # more pass (every token below it has more than top_p of better-ranked mass)
    wide = best.unsqueeze(1) - G_MAX
    if rows.min_p is not None:
        wide = torch.maximum(wide, top + torch.log(rows.min_p))
    wide = torch.maximum(wide, top + torch.log(total) + torch.log((1 - rows.top_p) / (2 * vocab)))
    again = active & ~over & (rows.top_p < 1).squeeze(1) & ~settled & (wide < floor).squeeze(1)
    if not bool(again.any()):
        return token
    vals, ids = band_candidates(
        logits, torch.where(again.unsqueeze(1), (wide - margin) * temp, inf), True)
    wider, _, _ = race(vals, ids, rows, total, True)
    return torch.where(again, wider, token)


# logits per block of rows in `threshold_race` on the CPU, times the square of torch's threads:
# each block's candidates are listed and raced before the next block's, because the
# temporaries of a whole batch's list (a dozen of [M] tensors) took fresh pages on every call,
# which cost more than their math; with more threads, larger blocks, so that each op of a
# block wakes the pool for enough work
_BLOCK_ELEMS = 1 << 21


def _with_dense(token: torch.Tensor, over: torch.Tensor | None, logits: torch.Tensor,
                rows: Rows, top: torch.Tensor) -> torch.Tensor:
    """``token`` with the rows ``over`` the cap (flat rows) drawn by the dense race."""
    if over is None or not bool(over.any()):
        return token
    idx = over.nonzero().squeeze(1)
    return token.index_copy(0, idx, dense_draw.dense_top_p_race(logits[idx], rows.take(idx),
                                                                top[idx]))


FLAT_SHARE = 0.125  # a row with more of its vocabulary than this in its band is flat


def top_k_race(logits: torch.Tensor, rows: Rows, k: int,
               race: RaceFn = race_over_candidates) -> torch.Tensor:
    """Tokens ``[N]`` of rows that all have top_k (``<= k``): ``k`` candidates from one
    ``topk``, every truncation exact inside them."""
    vals, ids = top_k_by_id(logits, min(k, logits.shape[1]))
    return race(vals, ids, rows, None, True)[0]
