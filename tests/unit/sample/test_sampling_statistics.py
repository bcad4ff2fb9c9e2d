"""Statistical tests of the sampler's randomness, against the distribution itself (no earlier
implementation as the oracle).

Each sequence is followed along its steps, the way the engine draws its tokens: a fixed
distribution at every step, the sampled token appended, the next step drawn. So the noise of
step ``s + 1`` must be independent of the noise of step ``s`` — the old hash
(``seed*MIX + step*GOLDEN + token*GOLDEN``) made it the same noise moved by one token, and a
sequence walked down the vocabulary one id per step: both tests below fail on it
(``test_the_tests_fail_on_a_shifted_hash`` keeps that true).

Thresholds: a p-value floor of 1e-6 per test; the draws are deterministic (seeded), so a test
that passes passes every time, and the floor only says how unlikely a correct sampler would be
to fail it by chance on some other seed.
"""
from __future__ import annotations

import math

import pytest
import torch

from batchgen_data.sample.draw import draw_hash, token_draw
from batchgen_data.sample.sampler import Sampler
from batchgen_data.core.sequence import Sequence
from batchgen_data.sample.draw.draw_hash import sample_seed
from batchgen_data.sampling_params import SamplingParams

P_FLOOR = 1e-6


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularised upper incomplete gamma function."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_goodness(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` against ``probs`` (cells with expected count < 5 pooled
    into one)."""
    n = float(counts.sum())
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


def run_steps(params: SamplingParams, logits: torch.Tensor, seeds: list[int], steps: int
              ) -> torch.Tensor:
    """Tokens ``[rows, steps]``: each row a sequence sampled from the same ``logits [V]`` at
    every step, its sampled token appended before the next draw (as the engine does)."""
    seqs = [Sequence(i, f"r{i}", 0, [1, 2, 3], params, seed=s, max_tokens=steps + 1)
            for i, s in enumerate(seeds)]
    sampler = Sampler(set())
    batch = logits.unsqueeze(0).expand(len(seqs), -1).contiguous()
    out = torch.empty(len(seqs), steps, dtype=torch.long)
    for step in range(steps):
        assert all(s.num_output_tokens == step for s in seqs)
        toks = sampler(batch.clone(), seqs).token_ids
        out[:, step] = torch.tensor(toks)
        for s, t in zip(seqs, toks):
            s.token_ids.append(t)
    return out


def fixed_logits(vocab: int, seed: int = 0, spread: float = 1.0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * spread


PATHS = {
    # the full-vocabulary race (no truncation), and the truncated race over top-k candidates
    "full": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(temperature=0.8, top_k=24),
    # top-p over flat logits: the whole vocabulary is in the band, so the dense race
    # (dense_draw.dense_top_p_race) draws these
    "top_p": SamplingParams(temperature=0.8, top_p=0.7),
}


def kept_probs(params: SamplingParams, logits: torch.Tensor) -> torch.Tensor:
    """The distribution a sampler must draw from, ``[V]`` float64: softmax(logits / T) after
    top-k, then top-p (a token kept while the mass ranked before it is below top_p), written
    from the definition (a full sort in float64)."""
    scaled = logits.double() / params.temperature
    vocab = scaled.numel()
    if 0 < params.top_k < vocab:
        cut = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < cut, float("-inf"))
    probs = torch.softmax(scaled, -1)
    if params.top_p < 1:
        order = probs.argsort(descending=True, stable=True)
        before = probs[order].cumsum(0) - probs[order]
        drop = torch.zeros(vocab, dtype=torch.bool)
        drop[order] = before >= params.top_p
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return probs


def _frequencies_p(params: SamplingParams) -> tuple[float, float]:
    """p-values of two chi-square tests on sequences drawn from one fixed distribution: the
    tokens' frequencies against softmax(logits / T) (after top-k), and the frequencies of
    consecutive pairs (token at step s, token at step s + 1) against the product of the
    softmax with itself — what independent draws give."""
    vocab = 8
    logits = fixed_logits(vocab, spread=0.7)
    toks = run_steps(params, logits, seeds=[11, 12, 13, 14], steps=1500)
    probs = kept_probs(params, logits)
    counts = torch.bincount(toks.flatten(), minlength=vocab)
    pairs = torch.bincount((toks[:, :-1] * vocab + toks[:, 1:]).flatten(),
                           minlength=vocab * vocab)
    return (chi2_goodness(counts, probs),
            chi2_goodness(pairs, torch.outer(probs, probs).flatten()))


def _neighbour_share(params: SamplingParams, vocab: int = 64) -> tuple[float, float, int]:
    """(share of steps whose token is the previous one +-1, its expectation (about 2/V),
    number of step pairs) under near-uniform logits."""
    logits = fixed_logits(vocab, seed=1, spread=0.01)
    toks = run_steps(params, logits, seeds=[5, 6], steps=1000)
    d = (toks[:, 1:] - toks[:, :-1]).abs()
    pairs = d.numel()
    p = kept_probs(params, logits)
    expect = float(2 * (p[1:] * p[:-1]).sum())  # P(|a - b| == 1) for independent a, b ~ p
    return float((d == 1).float().mean()), expect, pairs


@pytest.mark.parametrize("path", sorted(PATHS))
def test_sampled_frequencies_follow_the_softmax(path: str) -> None:
    single, pairs = _frequencies_p(PATHS[path])
    assert single > P_FLOOR, f"chi-square p = {single:.3g}: tokens do not follow the softmax"
    assert pairs > P_FLOOR, f"chi-square p = {pairs:.3g}: consecutive tokens are not independent"


@pytest.mark.parametrize("path", sorted(PATHS))
def test_consecutive_draws_are_independent(path: str) -> None:
    share, expect, pairs = _neighbour_share(PATHS[path])
    # binomial(pairs, expect): mean +- 6 standard deviations
    sd = math.sqrt(expect * (1 - expect) / pairs)
    assert abs(share - expect) < 6 * sd, (share, expect)


def test_samples_of_one_request_are_independent() -> None:
    # n > 1: sample i draws with sample_seed(seed, i); two samples of one request at the same
    # step agree about as often as two independent uniform draws (1/V), not always
    vocab = 64
    logits = fixed_logits(vocab, seed=2, spread=0.01)
    seeds = [sample_seed(7, i) for i in range(4)]
    assert len(set(seeds)) == 4 and seeds[0] == 7
    toks = run_steps(SamplingParams(temperature=1.0), logits, seeds=seeds, steps=400)
    pairs = agree = 0
    for i in range(4):
        for j in range(i + 1, 4):
            agree += int((toks[i] == toks[j]).sum())
            pairs += toks.shape[1]
    expect = 1 / vocab
    sd = math.sqrt(expect * (1 - expect) / pairs)
    assert abs(agree / pairs - expect) < 6 * sd, (agree / pairs, expect)


def test_sample_seed_is_stable_and_spread() -> None:
    # a fixed function of (seed, index), the same on every interpreter: values pinned from
    # the splitmix64 definition (not from Python's hash, which changed between versions)
    assert sample_seed(123, 0) == 123
    assert [sample_seed(0, i) for i in (1, 2)] == [2459150361376443823, 3348600503766967796]
    vals = {sample_seed(s, i) for s in range(50) for i in range(1, 5)}
    assert len(vals) == 200 and all(0 <= v < (1 << 62) for v in vals)


def test_rows_with_consecutive_seeds_draw_independently() -> None:
    # connectors derive seeds from row ids; users often number their seeds 0, 1, 2, ...: the
    # tokens of seed s and seed s + 1 at one step are independent (chi-square on the joint
    # table of a 4-token distribution)
    vocab = 4
    logits = torch.tensor([0.0, 0.3, -0.2, 0.1])
    n = 3000
    seqs = [Sequence(i, f"r{i}", 0, [1], SamplingParams(temperature=1.0), seed=i, max_tokens=4)
            for i in range(n + 1)]
    toks = torch.tensor(Sampler(set())(logits.expand(n + 1, -1).contiguous(), seqs).token_ids)
    joint = torch.zeros(vocab, vocab)
    for a, b in zip(toks[:-1].tolist(), toks[1:].tolist()):
        joint[a, b] += 1
    rows, cols = joint.sum(1, keepdim=True), joint.sum(0, keepdim=True)
    expected = rows * cols / joint.sum()
    stat = float(((joint - expected) ** 2 / expected).sum())
    assert chi2_sf(stat, (vocab - 1) ** 2) > P_FLOOR


def _old_hash(seeds: torch.Tensor, steps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The hash this project shipped before (seed, step and token entering one sum)."""
    base = seeds.long() * draw_hash._SEED_MIX + steps.long() * draw_hash._GOLDEN
    z = tokens * draw_hash._GOLDEN + base.unsqueeze(1)
    draw_hash._shr_xor_(z, 30).mul_(draw_hash._M1)
    draw_hash._shr_xor_(z, 27).mul_(draw_hash._M2)
    draw_hash._shr_xor_(z, 31)
    z >>= 40
    z &= (1 << 24) - 1
    return (z.float() + 0.5) * (1.0 / (1 << 24))


def _old_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The old hash's stream keys: with them, ``keyed_uniform`` is `_old_hash`."""
    return seeds.long() * draw_hash._SEED_MIX + steps.long() * draw_hash._GOLDEN


def test_the_tests_fail_on_a_shifted_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    # the oracle can fail: with the old hash patched in, both statistics reject it
    seeds, steps = torch.tensor([3, 4]), torch.tensor([7, 8])
    tokens = torch.arange(50).unsqueeze(0)
    want = _old_hash(seeds, steps, tokens)
    monkeypatch.setattr(draw_hash, "stream_keys", _old_keys)
    # (equal but where float32 rounded the top uniform to 1.0, now clamped below 1)
    assert torch.equal(token_draw.hash_uniform_at(seeds, steps, tokens),
                       want.clamp(max=draw_hash._U_MAX))
    share, expect, _ = _neighbour_share(PATHS["full"])
    assert share > 0.5 > 10 * expect
    assert _frequencies_p(PATHS["full"])[1] < P_FLOOR
