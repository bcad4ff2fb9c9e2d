"""The random draw of the sampler: top-k / top-p / min-p truncation and the exponential race,
in memory that grows with the rows times the candidates, not with the rows times the vocabulary.

The race picks ``argmax(logit / T - log(-log u))`` with ``u`` a counter-based hash of
(sequence seed, output index, token id): (seed, output index) mixed into one key first, then
the token id (so consecutive steps draw independent noise; tests/unit/engine/
test_sampling_statistics.py checks it). Because ``u`` depends on the token id alone, the race
can run over any subset of tokens that holds every token the truncation keeps, and it picks the
same token as a race over the whole vocabulary. So:
  * rows that truncate (top-k, top-p) race over ``K`` candidates from one ``topk`` call, with
    ``K`` the largest top_k of the batch; a top-p row without top_k starts from
    ``NUCLEUS_GUESS`` candidates and widens (x4) only while its nucleus is not inside them;
  * rows that do not truncate race over the vocabulary in column chunks of at most
    ``_CHUNK_ELEMS / rows`` columns, keeping a running best.
At 256 rows and a 128k vocabulary the old path held several ``[rows, vocab]`` int64
temporaries (268 MB each) and a full sort; this one holds ``[rows, K]`` tensors and chunks of
``_CHUNK_ELEMS`` elements.

Same tokens as the full-vocabulary path: the race values of the candidates are computed by the
same float operations. The probabilities that top-p and min-p compare are a softmax over the
candidates (for a top-p row without top_k: over the vocabulary, summed in chunks), so a token
whose cumulative mass lies within float rounding (~1e-7) of top_p, or whose probability lies
that close to the min-p floor, may fall on the other side of it than before.
"""
from __future__ import annotations

import torch

_M1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9 as signed int64
_M2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB
_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15
_SEED_MIX = 0x2545F4914F6CDD1D
NUCLEUS_GUESS = 1024  # first candidate count for top-p rows without top_k
_CHUNK_ELEMS = 1 << 21  # rows x columns per pass of the full-vocabulary race


def _shr_xor_(z: torch.Tensor, s: int) -> torch.Tensor:
    """In place: ``z ^= z >>> s`` (a logical shift; torch's >> on int64 is arithmetic)."""
    t = z >> s
    t &= (1 << (64 - s)) - 1
    return z.bitwise_xor_(t)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser of int64 ``z`` (a new tensor; multiplies wrap as uint64 would)."""
    z = z.clone()
    _shr_xor_(z, 30).mul_(_M1)
    _shr_xor_(z, 27).mul_(_M2)
    return _shr_xor_(z, 31)


def stream_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One well-mixed int64 key per (seed, step), ``[N]``: the seed goes through a full
    splitmix64 round, then the step is added and mixed again, so no two (seed, step) pairs
    are a shifted copy of each other. (The old ``seed*MIX + step*GOLDEN + token*GOLDEN``
    depended on ``step + token`` only: the next step's noise was this step's moved by one
    token.)"""
    key = _mix64(seeds.long() * _SEED_MIX + _GOLDEN)
    return _mix64(key + steps.long() * _GOLDEN)


def hash_uniform_at(seeds: torch.Tensor, steps: torch.Tensor, tokens: torch.Tensor
                    ) -> torch.Tensor:
    """Float32 uniforms in (0, 1) from a hash of (seed, step, token): seeds and steps
    ``[N]``, tokens int64 broadcastable to ``[N, C]`` (e.g. ``[1, C]`` or ``[N, C]``).
    Token ``t`` of a row takes output ``t`` of the splitmix64 stream that starts at the row's
    mixed (seed, step) key. In-place steps: two ``[N, C]`` int64 tensors live at a time."""
    base = stream_keys(seeds, steps)  # [N]
    z = tokens * _GOLDEN + base.unsqueeze(1)  # int64 multiply and add wrap, as in splitmix64
    _shr_xor_(z, 30).mul_(_M1)
    _shr_xor_(z, 27).mul_(_M2)
    _shr_xor_(z, 31)
    z >>= 40  # top 24 bits, non-negative after the mask
    z &= (1 << 24) - 1
    return (z.float() + 0.5) * (1.0 / (1 << 24))


_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed`` (``n > 1``): sample 0
    keeps the user's seed; the others take a splitmix64 of (seed, index), the same on every
    Python and every machine (Python's ``hash`` of a tuple is not a promise across versions).
    62 bits, non-negative."""
    if index == 0:
        return seed
    z = (seed * 0x2545F4914F6CDD1D + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 62) - 1)


def _race(scaled: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return scaled - torch.log(-torch.log(u))


def _chunks(rows: int, vocab: int) -> list[tuple[int, int]]:
    width = max(1024, _CHUNK_ELEMS // max(rows, 1))
    return [(c, min(c + width, vocab)) for c in range(0, vocab, width)]


def _scaled_sumexp(logits: torch.Tensor, temperature: torch.Tensor, top: torch.Tensor
                   ) -> torch.Tensor:
    """``sum_v exp(logits[:, v] / T - top)`` over the whole vocabulary, chunk by chunk."""
    total = torch.zeros_like(top)
    for lo, hi in _chunks(*logits.shape):
        total += torch.exp(logits[:, lo:hi] / temperature - top).sum(-1, keepdim=True)
    return total


def full_race(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
              temperature: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Token ids ``[N]`` drawn from the whole vocabulary of ``logits [N, V]`` at
    ``temperature [N, 1]``, tokens below ``min_p [N, 1]`` times the top probability dropped."""
    n, vocab = logits.shape
    best = torch.full((n,), float("-inf"), device=logits.device)
    best_id = torch.zeros(n, dtype=torch.long, device=logits.device)
    if min_p is not None:
        top = logits.amax(-1, keepdim=True) / temperature  # [N, 1]: the max of the scaled row
        total = _scaled_sumexp(logits, temperature, top)
        floor = min_p / total  # the top probability, exp(0) / total, times min_p
    for lo, hi in _chunks(n, vocab):
        scaled = logits[:, lo:hi] / temperature  # [N, C]
        if min_p is not None:
            scaled = scaled.masked_fill(torch.exp(scaled - top) / total < floor, float("-inf"))
        cols = torch.arange(lo, hi, device=logits.device).unsqueeze(0)
        race = _race(scaled, hash_uniform_at(seeds, steps, cols))
        idx = race.argmax(-1, keepdim=True)
        val = race.gather(1, idx).squeeze(1)
        better = val > best  # strict: a tie keeps the earlier column, as one argmax would
        best = torch.where(better, val, best)
        best_id = torch.where(better, idx.squeeze(1) + lo, best_id)
    return best_id


def truncated_race(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                   temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None,
                   min_p: torch.Tensor | None, num_candidates: int,
                   nucleus_without_k: bool) -> torch.Tensor:
    """Token ids ``[N]`` drawn after top-k (``top_k [N, 1]``, ``>= V`` when off), top-p
    (``top_p [N, 1]``, None when no row uses it) and min-p, from the ``num_candidates`` best
    tokens of each row, or more where a top-p row without top_k needs them
    (``nucleus_without_k``: some row has top_p < 1 and no top_k)."""
    vocab = logits.shape[1]
    k = min(num_candidates, vocab)
    while True:
        vals, ids = logits.topk(k, -1)  # [N, K] best first
        scaled = vals / temperature
        drop = torch.arange(k, device=logits.device).unsqueeze(0) >= top_k  # [N, K]
        if top_p is None:
            break
        masked = scaled.masked_fill(drop, float("-inf"))
        # rows whose top_k lies inside the candidates have all their mass there; the others
        # (top_k off) normalise over the whole vocabulary
        inside = top_k <= k  # [N, 1]
        top = scaled[:, :1]
        total = torch.exp(masked - top).sum(-1, keepdim=True)
        if nucleus_without_k and k < vocab:
            total = torch.where(inside, total, _scaled_sumexp(logits, temperature, top))
        probs = torch.exp(masked - top) / total
        cum = probs.cumsum(-1)
        # a top-p row without top_k is settled when its candidates hold top_p of the mass:
        # every token past them then has at least that much better mass before it
        settled = inside | (cum[:, -1:] >= top_p) | (top_p >= 1)
        if k == vocab or not nucleus_without_k or bool(settled.all()):
            drop |= (cum - probs) >= top_p  # mass of strictly better tokens
            drop[:, 0] = False
            break
        k = min(vocab, 4 * k)
    scaled = scaled.masked_fill(drop, float("-inf"))
    if min_p is not None:
        probs = torch.softmax(scaled, -1)
        scaled = scaled.masked_fill(probs < probs.max(-1, keepdim=True).values * min_p,
                                    float("-inf"))
    race = _race(scaled, hash_uniform_at(seeds, steps, ids))
    return ids.gather(1, race.argmax(-1, keepdim=True)).squeeze(1)
