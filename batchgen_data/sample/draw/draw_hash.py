"""The noise of the sampler's draw (the rule: `sample/draw/token_draw.py`): a counter-based hash of
(sequence seed, output index, token id) to a float32 uniform, splitmix64 in int64 arithmetic
that wraps as uint64 would, so every device computes the same bits; the bounds of the Gumbel
noise made from it; and the seeds of a request's samples when ``n > 1``.
"""
from __future__ import annotations

import torch

_M1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9 as signed int64
_M2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB
_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15
_SEED_MIX = 0x2545F4914F6CDD1D
_U_MAX = 1.0 - 2.0 ** -24  # the largest float32 below 1


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
    are a shifted copy of each other. (A key such as ``seed*MIX + step*GOLDEN +
    token*GOLDEN`` would depend on ``step + token`` only: the next step's noise would be this
    step's moved by one token.)"""
    key = _mix64(seeds.long() * _SEED_MIX + _GOLDEN)
    return _mix64(key + steps.long() * _GOLDEN)


def keyed_uniform(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Float32 uniforms in (0, 1): output ``tokens`` of the splitmix64 streams that start at
    ``keys`` (int64, broadcastable with tokens). In-place steps: two int64 tensors of the
    output's size live at a time."""
    z = tokens * _GOLDEN + keys  # int64 multiply and add wrap, as in splitmix64
    _shr_xor_(z, 30).mul_(_M1)
    _shr_xor_(z, 27).mul_(_M2)
    _shr_xor_(z, 31)
    z >>= 40  # top 24 bits, non-negative after the mask
    z &= (1 << 24) - 1
    return ((z.float() + 0.5) * (1.0 / (1 << 24))).clamp_(max=_U_MAX)


def hash_uniform_at(seeds: torch.Tensor, steps: torch.Tensor, tokens: torch.Tensor
                    ) -> torch.Tensor:
    """Float32 uniforms in (0, 1) from a hash of (seed, step, token): seeds and steps
    ``[N]``, tokens int64 broadcastable to ``[N, C]`` (e.g. ``[1, C]`` or ``[N, C]``).
    Token ``t`` of a row takes output ``t`` of the splitmix64 stream that starts at the row's
    mixed (seed, step) key."""
    return keyed_uniform(stream_keys(seeds, steps).unsqueeze(1), tokens)


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u))


# the bounds of the noise, from the same float operations as the race
G_MAX = float(_gumbel(torch.tensor(_U_MAX)))
G_MIN = float(_gumbel(torch.tensor(0.5 / (1 << 24))))

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
