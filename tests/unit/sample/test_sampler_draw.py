"""The sampler's draw (sample/draw/token_draw.py) against the full-vocabulary path it replaced, and
its memory on a 128k vocabulary."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from batchgen_data.sample.draw import dense_draw, draw_hash, token_draw
from batchgen_data.sample.draw import rows as draw_rows
from batchgen_data.sample.sampler import Sampler, hash_uniform
from batchgen_data.core.sequence import Sequence
from batchgen_data.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[3]


def _old_draw(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """The previous sampler's draw, kept here as the oracle: full sort, [N, V] hash."""
    vocab = logits.shape[1]
    ps = [s.params for s in seqs]
    temp = torch.tensor([[max(p.temperature, 1e-5)] for p in ps])
    top_k = torch.tensor([[p.top_k if p.top_k > 0 else vocab] for p in ps])
    top_p = torch.tensor([[p.top_p] for p in ps])
    min_p = torch.tensor([[p.min_p] for p in ps])
    scaled = logits / temp
    srt, idx = scaled.sort(-1, descending=True)
    drop = torch.arange(vocab).unsqueeze(0) >= top_k
    probs = torch.softmax(srt.masked_fill(drop, float("-inf")), -1)
    drop |= probs.cumsum(-1) - probs >= top_p
    drop[:, 0] = False
    scaled = scaled.scatter(1, idx, srt.masked_fill(drop, float("-inf")))
    if any(p.min_p > 0 for p in ps):
        probs = torch.softmax(scaled, -1)
        scaled = scaled.masked_fill(probs < probs.max(-1, keepdim=True).values * min_p,
                                    float("-inf"))
    seeds = torch.tensor([s.seed for s in seqs])
    steps = torch.tensor([s.num_output_tokens for s in seqs])
    u = hash_uniform(seeds, steps, vocab)
    return (scaled - torch.log(-torch.log(u))).argmax(-1).tolist()


def _seqs(params: list[SamplingParams]) -> list[Sequence]:
    return [Sequence(i, f"r{i}", 0, [1, 2, 3], p, seed=1000 + i, max_tokens=50)
            for i, p in enumerate(params)]


MIXES = {
    "top_k": [SamplingParams(top_k=k, temperature=t) for k, t in ((1, 1.0), (5, 0.7), (40, 1.3))],
    "top_p": [SamplingParams(top_p=p, temperature=t) for p, t in ((0.5, 1.0), (0.9, 0.8))],
    "top_k_and_p": [SamplingParams(top_k=50, top_p=0.8), SamplingParams(top_k=3, top_p=0.95)],
    "plain": [SamplingParams(temperature=0.9), SamplingParams(temperature=1.5)],
    "min_p": [SamplingParams(min_p=0.05), SamplingParams(min_p=0.2, top_k=30)],
    "mixed": [SamplingParams(temperature=0), SamplingParams(top_k=7), SamplingParams(top_p=0.6),
              SamplingParams(), SamplingParams(top_k=20, top_p=0.7, min_p=0.1)],
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("vocab", [97, 5000])
def test_same_tokens_as_the_full_vocabulary_draw(mix: str, vocab: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # small chunks and narrow bands: the chunked sum and the second (floor) pass both run
    monkeypatch.setattr(draw_rows, "CHUNK_ELEMS", 1024)
    monkeypatch.setattr(token_draw, "BAND_TOP_P", 0.5)
    gen = torch.Generator().manual_seed(vocab)
    for step in range(12):
        seqs = _seqs(MIXES[mix])
        for s in seqs:
            s.token_ids.extend([4] * step)  # output index = step: new hash stream each time
        # flat logits give wide nuclei (the guess must widen); steep ones narrow ones
        logits = torch.randn(len(seqs), vocab, generator=gen) * (0.3 if step % 2 else 3.0)
        want = _old_draw(logits, seqs)
        want = [int(logits[i].argmax()) if s.params.greedy else w
                for i, (s, w) in enumerate(zip(seqs, want))]
        assert Sampler(set())(logits, seqs).token_ids == want


_WITH_TOP_P = [SamplingParams(top_p=0.5), SamplingParams(top_p=0.9, temperature=0.7),
               SamplingParams(top_p=0.95, min_p=0.02), SamplingParams(temperature=1.2),
               SamplingParams(top_k=5, top_p=0.8), SamplingParams(temperature=0)]
_WITHOUT_TOP_P = [SamplingParams(temperature=1.2), SamplingParams(temperature=0.7, min_p=0.05),
                  SamplingParams(), SamplingParams(top_k=5), SamplingParams(temperature=0),
                  SamplingParams(temperature=0.3)]


@pytest.mark.parametrize("buckets", ["fine", "coarse", "few"])
@pytest.mark.parametrize("vocab", [97, 5000])
@pytest.mark.parametrize("params", [_WITH_TOP_P, _WITHOUT_TOP_P], ids=["top_p", "no_top_p"])
def test_the_dense_race_of_flat_rows_draws_the_full_vocabulary_tokens(
        vocab: int, buckets: str, params: list[SamplingParams],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # every sampled row without top_k through dense_top_p_race (FLAT_SHARE below 0): the
    # histogram cut, the ranked cut bucket (coarse buckets: many tokens in it) and the last,
    # clamped bucket (few buckets) against the old full-sort draw; a batch without top-p
    # takes the one-pass race (no histogram)
    monkeypatch.setattr(token_draw, "FLAT_SHARE", -1.0)
    monkeypatch.setattr(draw_rows, "CHUNK_ELEMS", 1024)
    monkeypatch.setattr(dense_draw, "BUCKETS_PER_UNIT",
                        {"fine": 256.0, "coarse": 2.0, "few": 8.0}[buckets])
    monkeypatch.setattr(dense_draw, "BUCKETS", {"fine": 4096, "coarse": 64, "few": 6}[buckets])
    calls = []
    dense = dense_draw.dense_top_p_race
    monkeypatch.setattr(dense_draw, "dense_top_p_race",
                        lambda *a: calls.append(a[0].shape[0]) or dense(*a))
    gen = torch.Generator().manual_seed(vocab + 1)
    for step in range(10):
        seqs = _seqs(params)
        for s in seqs:
            s.token_ids.extend([4] * step)
        logits = torch.randn(len(seqs), vocab, generator=gen) * (0.3, 1.0, 3.0)[step % 3]
        logits[1, :: 7] = float("-inf")  # masked tokens (bad words, allowed_token_ids)
        want = _old_draw(logits, seqs)
        for i, p in enumerate(params):
            if p.temperature == 0:
                want[i] = int(logits[i].argmax())
        assert Sampler(set())(logits, seqs).token_ids == want, step
    # the sampled rows without top_k
    assert calls and all(c == 4 for c in calls)


def test_a_flat_nucleus_takes_two_compares_and_no_sort_of_the_vocabulary(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # one token on top, 60k nearly flat ones more than BAND_TOP_P below it holding most of
    # the mass: the 0.9 nucleus lies far past the band; the floor pass takes it in one more
    # compare (no widening rounds, no topk)
    calls: list[str] = []
    band = token_draw.band_candidates

    def counting_band(*a: object, **kw: object) -> object:
        calls.append("band")
        return band(*a, **kw)

    real_topk = torch.Tensor.topk

    def no_topk(self: torch.Tensor, *a: object, **kw: object) -> object:
        assert self.shape[-1] < 60000, "topk over the vocabulary of a row without top_k"
        return real_topk(self, *a, **kw)

    monkeypatch.setattr(token_draw, "band_candidates", counting_band)
    monkeypatch.setattr(torch.Tensor, "topk", no_topk)
    seqs = _seqs([SamplingParams(top_p=0.9), SamplingParams(top_p=0.9, temperature=2.0)])
    logits = torch.rand(2, 60000, generator=torch.Generator().manual_seed(3)) * 0.01 - 10.5
    logits[:, 7] = 0.0
    assert Sampler(set())(logits, seqs).token_ids == _old_draw(logits, seqs)
    assert calls == ["band", "band"]


def test_a_uniform_of_one_no_longer_wins_whatever_its_logit() -> None:
    # float32 rounds the hash's top value (z = 2**24 - 1) to u = 1.0, g = +inf: that token
    # won every race it entered. Find a (seed, token) that hits it and give it no chance.
    vocab = 1 << 16
    cols = torch.arange(vocab).unsqueeze(0)
    for seed in range(2000):
        z = draw_hash.stream_keys(torch.tensor([seed]), torch.tensor([0]))
        z = cols * draw_hash._GOLDEN + z.unsqueeze(1)
        draw_hash._shr_xor_(z, 30).mul_(draw_hash._M1)
        draw_hash._shr_xor_(z, 27).mul_(draw_hash._M2)
        draw_hash._shr_xor_(z, 31)
        top = ((z >> 40) & ((1 << 24) - 1)) == (1 << 24) - 1
        if bool(top.any()):
            token = int(top.nonzero()[0, 1])
            break
    else:
        pytest.fail("no seed reached the top uniform")
    u = token_draw.hash_uniform_at(torch.tensor([seed]), torch.tensor([0]), cols)
    assert float(u.max()) < 1.0 and int(u.argmax()) == token
    logits = torch.zeros(1, vocab)
    logits[0, token] = -60.0  # probability ~e-60: never drawn by a correct sampler
    seqs = [Sequence(0, "r0", 0, [1], SamplingParams(temperature=1.0), seed=seed,
                     max_tokens=4)]
    assert Sampler(set())(logits, seqs).token_ids[0] != token
    logits[0, token] = float("-inf")  # masked (allowed_token_ids, a bad word): not NaN either
    seqs[0].params = SamplingParams(temperature=1.0, top_p=0.99)
    assert Sampler(set())(logits, seqs).token_ids[0] != token


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    from batchgen_data.sample.draw import rows as draw_rows
    from batchgen_data.sample.sampler import Sampler
    from batchgen_data.core.sequence import Sequence
    from batchgen_data.sampling_params import SamplingParams
    torch.set_num_threads(1)
    rows, vocab = int(sys.argv[1]), int(sys.argv[2])
    draw_rows.CHUNK_ELEMS = int(sys.argv[4])
    kinds = {"top_k": dict(top_k=50), "top_p": dict(top_p=0.9), "plain": dict(temperature=0.8),
             "top_k_p": dict(top_k=40, top_p=0.95, min_p=0.05)}
    params = SamplingParams(**kinds[sys.argv[3]])
    def run(v):
        seqs = [Sequence(i, f"r{i}", 0, [1, 2], params, seed=i, max_tokens=9)
                for i in range(rows)]
        return Sampler(set())(torch.randn(rows, v) * 5, seqs)
    run(1000)  # first-call set-up (thread pools, dispatch tables) at a small vocabulary
    logits = torch.randn(rows, vocab).mul_(5)  # no temporary to raise the high-water mark
    seqs = [Sequence(i, f"r{i}", 0, [1, 2], params, seed=i, max_tokens=9)
                for i in range(rows)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    Sampler(set())(logits, seqs)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) * 1024)  # ru_maxrss is in KiB on Linux
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss units differ off Linux")
@pytest.mark.parametrize("kind", ["top_k", "top_p", "plain", "top_k_p"])
def test_peak_memory_on_a_128k_vocabulary(kind: str) -> None:
    # 64 rows x 128k vocabulary: the logits are 33.5 MB, one [N, V] int64 temporary 67 MB, and
    # the old path held several at once plus a full sort. Here the process's high-water mark
    # may grow by less than half of one such temporary. Logits of std 5 are peaked like a
    # language model's: the 0.9 nucleus holds tens to hundreds of tokens, inside the first
    # 1024 candidates (a flat row widens the candidates, and the memory, to its nucleus).
    rows, vocab, chunk = 64, 131072, 1 << 18
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(rows), str(vocab), kind, str(chunk)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grew = int(proc.stdout.split()[-1])
    assert grew < rows * vocab * 8 // 2, f"peak grew by {grew / 2**20:.1f} MiB"


def _old_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The previous [N, V] penalty path, as the oracle."""
    out = logits.clone()
    vocab = logits.shape[1]
    for i, s in enumerate(seqs):
        p = s.params
        counts = torch.bincount(torch.tensor(s.output_token_ids, dtype=torch.long),
                                minlength=vocab)[:vocab].float()
        seen = counts > 0
        seen[torch.tensor(s.prompt_token_ids, dtype=torch.long)] = True
        row = out[i]
        if any(q.repetition_penalty != 1 for q in (x.params for x in seqs)):
            rep = p.repetition_penalty
            row.copy_(torch.where(seen, torch.where(row > 0, row / rep, row * rep), row))
        if any(q.frequency_penalty or q.presence_penalty for q in (x.params for x in seqs)):
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return out


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0, repetition_penalty=1.3), SamplingParams(temperature=0)],
    [SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.4),
     SamplingParams(temperature=0, presence_penalty=-0.5)],
    [SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=0.3),
     SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=1.0),
     SamplingParams(temperature=0)],
])
def test_penalties_touch_only_seen_tokens_as_before(params: list[SamplingParams]) -> None:
    vocab = 50
    seqs = _seqs(params)
    for i, s in enumerate(seqs):  # repeats, prompt/output overlap, and a row with no output
        s.token_ids.extend([[7, 7, 3, 9, 7, 1], [2, 40, 40], []][i % 3])
    logits = torch.randn(len(seqs), vocab) * 3
    seen_logits: list[torch.Tensor] = []
    real_argmax = torch.Tensor.argmax

    def spy(self: torch.Tensor, *a: object, **kw: object) -> torch.Tensor:
        seen_logits.append(self.clone())
        return real_argmax(self, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "argmax", spy)
        Sampler(set())(logits, seqs)
    assert torch.equal(seen_logits[0], _old_penalties(logits, seqs))


def test_logprobs_only_for_the_rows_that_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    shapes: list[tuple[int, ...]] = []
    real = torch.log_softmax

    def spy(x: torch.Tensor, *a: object, **kw: object) -> torch.Tensor:
        shapes.append(tuple(x.shape))
        return real(x, *a, **kw)

    monkeypatch.setattr(torch, "log_softmax", spy)
    seqs = _seqs([SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=2),
                  SamplingParams(top_k=5)])
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    out = Sampler(set())(logits, seqs)
    assert shapes == [(1, 40)]  # one row asked: one row's log-softmax
    assert out.logprobs[0] is None and out.logprobs[2] is None
    lp = real(logits[1], -1)
    top2 = lp.topk(2).indices.tolist()
    ids, values, rank = out.logprobs[1]  # plain data: the drawn id first, then the top 2
    tok = out.token_ids[1]
    assert ids == [tok, *top2] and values[0] == pytest.approx(float(lp[tok]))
    assert values[1:] == pytest.approx(lp.topk(2).values.tolist())
    assert rank == int((lp >= lp[tok]).sum())  # the vocabulary rank: 1 for the argmax
    assert Sampler(set())(logits, seqs[:1]).logprobs == [None] and shapes == [(1, 40)]


def _rule_draw(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """token_draw's rule written out over the whole vocabulary, ties ranked by token id (a
    stable sort of ids already in order): top-k, then top-p over the top-k set, then the race."""
    vocab = logits.shape[1]
    ps = [s.params for s in seqs]
    temp = torch.tensor([[p.temperature] for p in ps])
    top_k = torch.tensor([[p.top_k if p.top_k > 0 else vocab] for p in ps])
    top_p = torch.tensor([[p.top_p] for p in ps])
    scaled = logits / temp
    srt, idx = scaled.sort(dim=-1, descending=True, stable=True)
    drop = torch.arange(vocab).unsqueeze(0) >= top_k
    probs = torch.softmax(srt.masked_fill(drop, float("-inf")), -1)
    drop |= (probs.cumsum(-1) - probs >= top_p) & (top_p < 1)
    drop[:, 0] = False
    kept = torch.full_like(scaled, float("-inf")).scatter(1, idx, srt.masked_fill(drop, float("-inf")))
    u = hash_uniform(torch.tensor([s.seed for s in seqs]),
                     torch.tensor([s.num_output_tokens for s in seqs]), vocab)
    return (kept - torch.log(-torch.log(u))).argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [300, 5000])
def test_top_k_ties_at_the_cut_keep_the_lower_token_ids(vocab: int) -> None:
    """Integer logits tie by the dozen (as bf16 logits do): which of the tied tokens at the
    k-th place top-k keeps, and their order for top-p's mass, follow token ids, not topk's
    internal order."""
    gen = torch.Generator().manual_seed(vocab)
    params = [SamplingParams(top_k=20, top_p=0.9), SamplingParams(top_k=7),
              SamplingParams(top_k=3, temperature=0.5), SamplingParams(top_k=50, top_p=0.5)]
    for step in range(30):
        seqs = _seqs(params)
        for s in seqs:
            s.token_ids.extend([4] * step)
        logits = torch.randint(0, 6, (len(seqs), vocab), generator=gen).float()
        assert Sampler(set())(logits, seqs).token_ids == _rule_draw(logits, seqs), step
