"""The sampler's per-row work on its candidates in one kernel: temperature, top-k, top-p, min-p,
the counter-based hash and the exponential race (sample/draw/token_draw.py states the rule).

One program per row walks the row's candidates (``vals, ids [N, C]``, best first when
``ranked``, ``-inf`` padding) in blocks: the scaled logits, the mass top-p divides by, the
running cumulative mass, the masks, the hash of (seed, step, token) and the running best race
value, so a step launches this once instead of the ~30 elementwise ops of the torch path.

The hash is splitmix64 in uint64 arithmetic (wrapping multiplies, logical shifts), bit for
bit the int64 one of the torch path: the stream key ``mix(mix(seed * 0x2545F4914F6CDD1D +
GOLDEN) + step * GOLDEN)``, then ``mix(token * GOLDEN + key)``, its top 24 bits as
``(z + 0.5) / 2**24`` clamped below 1. Sums (the mass, the cumulative mass) add in another
order than torch's, so a token within float rounding of the top-p or min-p cut may fall on
the other side of it; the race itself is elementwise and picks the same token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_contiguous, check_device, check_shape, check_tensor

_U_MAX = 1.0 - 2.0**-24


@triton.jit
def _mix64(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _race_kernel(
    vals_ptr,  # [N, C] float32 logits of the candidates, -inf padding
    ids_ptr,  # [N, C] int64 token ids
    temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr,  # [N] float32, int64, float32, float32
    seed_ptr, step_ptr,  # [N] int64
    total_ptr,  # [N] float32: the mass top-p divides by (MASS_FROM_ROW False)
    token_ptr, best_ptr, settled_ptr,  # [N] int64, float32, int8 outputs
    n_cols,
    RANKED: tl.constexpr, USE_P: tl.constexpr, USE_MIN_P: tl.constexpr,
    MASS_FROM_ROW: tl.constexpr, U_MAX: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols
    temp = tl.load(temp_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    golden = 0x9E3779B97F4A7C15
    seed = tl.load(seed_ptr + row).to(tl.uint64, bitcast=True)
    step = tl.load(step_ptr + row).to(tl.uint64, bitcast=True)
    key = _mix64(_mix64(seed * 0x2545F4914F6CDD1D + golden) + step * golden)
    neg_inf = float("-inf")
    offs = tl.arange(0, BLOCK)
    # the best scaled logit: the first candidate when ranked, else a max over the row
    if RANKED:
        top = tl.load(vals_ptr + base) / temp
    else:
        top = neg_inf
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + offs
            v = tl.load(vals_ptr + base + cols, mask=cols < n_cols, other=neg_inf)
            top = tl.maximum(top, tl.max(v / temp, 0))
    top = tl.where(top > neg_inf, top, 0.0)  # a row without candidates: no NaN below
    mass = 1.0
    if USE_P:
        if MASS_FROM_ROW:  # the top-k candidates' mass
            mass = 0.0
            for c0 in range(0, n_cols, BLOCK):
                cols = c0 + offs
                v = tl.load(vals_ptr + base + cols, mask=cols < n_cols, other=neg_inf)
                s = v / temp
                inside = (cols < top_k) & (s > neg_inf)
                mass += tl.sum(tl.where(inside, tl.exp(s - top), 0.0), 0)
        else:
            mass = tl.load(total_ptr + row)
    cut = tl.where(top_p >= 1.0, float("inf"), top_p)  # no cut where a rounded sum passes 1
    cum = 0.0
    best = neg_inf
    token = tl.full((), 0x7FFFFFFFFFFFFFFF, tl.int64)
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + offs
        inb = cols < n_cols
        v = tl.load(vals_ptr + base + cols, mask=inb, other=neg_inf)
        ids = tl.load(ids_ptr + base + cols, mask=inb, other=0)
        s = v / temp
        keep = s > neg_inf
        if RANKED:
            keep = keep & (cols < top_k)
        if USE_P:
            p = tl.where(keep, tl.exp(s - top), 0.0) / mass
            run = tl.cumsum(p, 0) + cum
            keep = keep & (((run - p) < cut) | (cols == 0))
            cum += tl.sum(p, 0)
        if USE_MIN_P:
            keep = keep & (tl.exp(s - top) >= min_p)
        z = _mix64(ids.to(tl.uint64, bitcast=True) * golden + key)
        u = ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        u = tl.minimum(u, U_MAX)
        race = tl.where(keep, s - tl.log(-tl.log(u)), neg_inf)
        b_best = tl.max(race, 0)
        b_tok = tl.min(tl.where(race == b_best, ids, 0x7FFFFFFFFFFFFFFF), 0)
        token = tl.where(b_best > best, b_tok,
                         tl.where(b_best == best, tl.minimum(token, b_tok), token))
        best = tl.maximum(best, b_best)
    tl.store(token_ptr + row, token)
    tl.store(best_ptr + row, best)
    settled = tl.where(top_p >= 1.0, 1, (cum >= top_p).to(tl.int32))
    tl.store(settled_ptr + row, settled.to(tl.int8))


def race_candidates(
    vals: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
    top_p: torch.Tensor | None, min_p: torch.Tensor | None, seeds: torch.Tensor,
    steps: torch.Tensor, total: torch.Tensor | None, ranked: bool, block: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ``[N]`` int64, best race value ``[N]`` float32 and settled ``[N]`` bool (the
    candidates hold top_p of the mass) of each row's candidates.

    vals ``[N, C]`` float32 logits (``-inf`` padding), ids ``[N, C]`` int64; temperature,
    top_k, top_p, min_p ``[N]`` or ``[N, 1]`` (top_k ``>= C`` when off; top_p / min_p None
    when no row uses them); seeds, steps ``[N]`` int64; total ``[N]`` the mass top-p divides
    by, None for the mass of the row's top-k candidates. ``ranked``: rows best first (needed
    for top-k and top-p)."""
    check_tensor("vals", vals, 2, (torch.float32,))
    n, c = vals.shape
    check_tensor("ids", ids, 2, (torch.int64,))
    check_shape("ids", ids, (n, c))
    check_contiguous("vals", vals)
    check_contiguous("ids", ids)
    if top_p is not None and not ranked:
        raise ValueError("top_p needs ranked candidates (best first)")

    def row_vec(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = t.reshape(-1).to(dtype).contiguous()
        check_shape(name, t, (n,))
        return t

    temp = row_vec("temperature", temperature, torch.float32)
    k = row_vec("top_k", top_k, torch.int64)
    p = row_vec("top_p", top_p if top_p is not None else torch.ones(n, device=vals.device),
                torch.float32)
    m = row_vec("min_p", min_p if min_p is not None else torch.zeros(n, device=vals.device),
                torch.float32)
    sd = row_vec("seeds", seeds, torch.int64)
    st = row_vec("steps", steps, torch.int64)
    tot = row_vec("total", total, torch.float32) if total is not None else p
    check_device(_race_kernel, ["vals", "ids", "temperature", "seeds"], [vals, ids, temp, sd])
    token = torch.empty(n, dtype=torch.int64, device=vals.device)
    best = torch.empty(n, dtype=torch.float32, device=vals.device)
    settled = torch.empty(n, dtype=torch.int8, device=vals.device)
    if n:
        _race_kernel[(n,)](
            vals, ids, temp, k, p, m, sd, st, tot, token, best, settled, c,
            RANKED=ranked, USE_P=top_p is not None, USE_MIN_P=min_p is not None,
            MASS_FROM_ROW=total is None, U_MAX=_U_MAX,
            BLOCK=min(block, triton.next_power_of_2(max(c, 16))),
        )
    return token, best, settled.bool()
