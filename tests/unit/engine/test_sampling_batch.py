"""Per-row sampling parameters: packed into one buffer and unpacked intact; flags and min_tokens
bans computed on the host."""
from __future__ import annotations

import torch

from batchgen_data.engine.sampler import Sampler
from batchgen_data.engine.sampling_batch import SamplingBatch, pack, unpack
from batchgen_data.engine.sequence import Sequence
from batchgen_data.sampling_params import SamplingParams


def _seq(i: int, params: SamplingParams, prompt: list[int], out: list[int]) -> Sequence:
    return Sequence(i, f"r{i}", 0, prompt, params, seed=1000 + i, max_tokens=50,
                    token_ids=prompt + out)


def test_pack_unpack_round_trip_mixed_dtypes() -> None:
    ts = [torch.tensor([[1 << 60, -3]]), torch.zeros(2, 0, dtype=torch.long),
          torch.tensor([1.5, -2.25], dtype=torch.float32), torch.tensor([True, False, True])]
    buf = pack(ts)
    assert buf.dtype == torch.uint8 and buf.numel() == 16 + 8 + 3
    for got, want in zip(unpack(buf, ts), ts):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_build_flags_rows_and_bans() -> None:
    vocab = 50
    seqs = [
        _seq(0, SamplingParams(temperature=0), [1, 2], [3]),
        _seq(1, SamplingParams(temperature=0.7, top_k=5, min_tokens=4, stop_token_ids=[9, 77]),
             [4], [5, 6]),
        _seq(2, SamplingParams(temperature=1.0, min_tokens=1, ignore_eos=True,
                               stop_token_ids=[8], frequency_penalty=0.5), [7], [8]),
    ]
    b = SamplingBatch.build(seqs, vocab, eos_ids=[2, 3], device=torch.device("cpu"))
    assert not b.all_greedy and b.truncate_top and not b.use_min_p
    assert b.use_freq_presence and not b.use_repetition and b.prompt_ids is None
    assert b.greedy.tolist() == [True, False, False]
    assert b.top_k.view(-1).tolist() == [vocab, 5, vocab]
    assert b.step.tolist() == [1, 2, 1] and b.seed.tolist() == [1000, 1001, 1002]
    assert torch.equal(b.temperature.view(-1), torch.tensor([1e-5, 0.7, 1.0]))
    # row 1 is below min_tokens: its stop ids (77 is outside the vocab) and EOS are banned;
    # row 2 already has its one token
    assert b.ban.tolist() == [[1, 1, 1], [2, 3, 9]]
    assert b.output_ids.tolist() == [[3, vocab], [5, 6], [8, vocab]]


def test_sampler_applies_bans_and_greedy_without_device_flags() -> None:
    vocab = 10
    logits = torch.zeros(2, vocab)
    logits[:, 2] = 5.0  # EOS is the favourite
    seqs = [_seq(0, SamplingParams(temperature=0, min_tokens=2), [1], []),
            _seq(1, SamplingParams(temperature=0), [1], [])]
    logits[0, 6] = 1.0
    out = Sampler({2})(logits, seqs)
    assert out.token_ids == [6, 2]
