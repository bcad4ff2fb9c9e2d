"""The CPU's block-by-block candidate scan (sample/draw/candidate_scan.py) against plain torch: the
listing itself, and the tokens drawn through it against the full-vocabulary race computed
directly here (no code of the sampler's draw reused)."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.sample.draw import candidate_scan, draw_hash
from batchgen_data.sample.sampler import Sampler
from batchgen_data.core.sequence import Sequence
from batchgen_data.sampling_params import SamplingParams


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows peaked (std 5), flat (std 0.3) and tied (small integers: runs of equal logits,
    on the floor too), with some masked tokens."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen)
    x[0::3] *= 5.0
    x[1::3] *= 0.3
    x[2::3] = (x[2::3] * 3).round()
    x[:, 5::11] = float("-inf")
    return x


@pytest.mark.parametrize("block_rows", [1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float64: the torch path
def test_the_scan_lists_what_a_torch_compare_lists(block_rows: int, dtype: torch.dtype,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    rows, vocab = 10, 997
    monkeypatch.setattr(candidate_scan, "SCAN_ELEMS", block_rows * vocab)
    x = _logits(rows, vocab, 1).to(dtype)
    lowest = x.amax(-1, keepdim=True) - torch.linspace(0.5, 8.0, rows).unsqueeze(1)
    lowest[2] = x[2].sort(descending=True).values[100]  # a tied row cut at a repeated value
    assert int((x[2] == lowest[2]).sum()) > 1 and int((x[2] >= lowest[2]).sum()) < 200
    lowest[4] = float("inf")  # a row that lists nothing
    temp = torch.linspace(0.3, 1.7, rows).unsqueeze(1)
    top = x.amax(-1, keepdim=True) / temp
    cap = 200.0
    got = candidate_scan.scan(x, lowest, cap, temp, top)

    mask = x >= lowest
    over = (mask.sum(-1) > cap) & torch.isfinite(lowest.squeeze(1))
    assert bool(over.any()) and not bool(over.all())
    mask[over] = False
    flat = mask.view(-1).nonzero().squeeze(1)
    assert torch.equal(got.over, over)
    assert torch.equal(got.flat, flat)
    assert torch.equal(got.vals, x.view(-1)[flat])
    assert torch.equal(got.counts, mask.sum(-1))
    rows_of, cols = got.rows_cols(vocab)
    assert torch.equal(rows_of * vocab + cols, flat)
    want = torch.exp(x / temp - top).sum(-1, keepdim=True)
    listed = torch.isfinite(lowest)
    torch.testing.assert_close(got.total[listed], want[listed], rtol=1e-5, atol=0)


def _full_race(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """The rule of sample/draw/token_draw.py over the whole vocabulary, written out: scale, sort
    (ties by id), top-k, top-p on the softmax, min-p, then argmax of scaled + Gumbel noise
    from the (seed, output index, token) hash (the first index on a tie)."""
    out = []
    vocab = logits.shape[1]
    for row, seq in zip(logits, seqs):
        p = seq.params
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        s = row / p.temperature
        order = torch.sort(s, descending=True, stable=True).indices
        kept = torch.zeros(vocab, dtype=torch.bool)
        k = p.top_k if 0 < p.top_k < vocab else vocab
        ranked = s[order[:k]]
        prob = torch.softmax(ranked, 0)
        before = prob.cumsum(0) - prob
        keep = before < p.top_p if p.top_p < 1 else torch.ones(k, dtype=torch.bool)
        keep[0] = True
        kept[order[:k][keep]] = True
        if p.min_p > 0:
            kept &= ~(torch.exp(s - s.max()) < p.min_p)
        key = draw_hash.stream_keys(torch.tensor([seq.seed]),
                                     torch.tensor([seq.num_output_tokens]))
        u = draw_hash.keyed_uniform(key.unsqueeze(1), torch.arange(vocab).unsqueeze(0))[0]
        race = (s - torch.log(-torch.log(u))).masked_fill(~kept, float("-inf"))
        out.append(int(race.argmax()))
    return out


_PARAMS = [SamplingParams(temperature=0.3), SamplingParams(temperature=0.8),
           SamplingParams(temperature=1.5), SamplingParams(temperature=0.8, top_p=0.95),
           SamplingParams(temperature=1.2, top_p=0.5), SamplingParams(temperature=0),
           SamplingParams(temperature=0.7, min_p=0.05),
           SamplingParams(temperature=0.9, top_p=0.8, min_p=0.02)]  # no top-k: it skips the scan


@pytest.mark.parametrize("vocab", [1000, 6007])
@pytest.mark.parametrize("with_top_p", [True, False])
def test_tokens_through_the_scan_are_the_full_vocabulary_race(
        vocab: int, with_top_p: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # blocks of two rows (and a last one of one): the scan, the flat race of the rows without
    # top-p and the band of the rows with it, rows of every temperature, flat, peaked, tied
    monkeypatch.setattr(candidate_scan, "SCAN_ELEMS", 2 * vocab)
    params = [p for p in _PARAMS if with_top_p or p.top_p == 1]
    for step in range(8):
        seqs = [Sequence(i, f"r{i}", 0, [1, 2, 3], p, seed=77 + 13 * i, max_tokens=50)
                for i, p in enumerate(params)]
        for s in seqs:
            s.token_ids.extend([4] * step)  # output index = step
        logits = _logits(len(seqs), vocab, 100 * step + vocab)
        logits = logits[torch.arange(len(seqs)).roll(step)].contiguous()  # rows change kind
        assert Sampler(set())(logits, seqs).token_ids == _full_race(logits, seqs), step
