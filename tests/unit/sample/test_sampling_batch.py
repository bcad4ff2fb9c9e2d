"""Per-row sampling parameters: packed into one buffer and unpacked intact; flags and min_tokens
bans computed on the host."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.sample.bad_words import BadWords, banned_tokens
from batchgen_data.sample.sampler import Sampler
from batchgen_data.sample.sampling_batch import SamplingBatch, pack, unpack
from batchgen_data.core.sequence import Sequence
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


class _Tok:
    """Whitespace-aware toy tokenizer: ' w' is one token, 'w' at the start is one per letter."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if text.startswith(" "):
            return [100 + len(text)]
        return [ord(c) - ord("a") for c in text]


def test_no_edit_tensors_when_no_row_edits_logits() -> None:
    seqs = [_seq(0, SamplingParams(temperature=0), [1], [2]),
            _seq(1, SamplingParams(top_p=0.5), [3], [])]
    b = SamplingBatch.build(seqs, 50, eos_ids=[2], device=torch.device("cpu"))
    assert b.allowed is None and b.allowed_rows is None and b.bias is None and b.bias_at is None


def test_build_logit_edits_and_bad_word_bans() -> None:
    bad = BadWords(_Tok())
    seqs = [
        _seq(0, SamplingParams(logit_bias={4: 1.5, 7: -2.0}), [1], []),
        _seq(1, SamplingParams(temperature=0), [1], []),
        _seq(2, SamplingParams(allowed_token_ids=[3, 8], logit_bias={3: 0.25}), [1], []),
        # "ab" is [0, 1] at the start and [103] after a space; the output ends with 0
        _seq(3, SamplingParams(bad_words=["ab"]), [0], [5, 0]),
    ]
    b = SamplingBatch.build(seqs, 200, eos_ids=[], device=torch.device("cpu"), bad_words=bad)
    assert b.bias_at.tolist() == [[0, 0, 2], [4, 7, 3]] and b.bias.tolist() == [1.5, -2.0, 0.25]
    assert b.allowed.tolist() == [[2, 2], [3, 8]] and b.allowed_rows.tolist() == [2]
    assert b.ban.tolist() == [[3, 3], [1, 103]]


def test_bad_words_spellings_and_matching() -> None:
    bad = BadWords(_Tok())
    assert bad.spellings([" ab", "c"]) == [[0, 1], [103], [2], [102]]
    assert bad.spellings([" ab", "c"]) is bad.spellings([" ab", "c"])  # tokenised once
    spell = [[0, 1], [9]]
    assert banned_tokens(spell, [4, 0], num_prompt=1) == [1, 9]
    assert banned_tokens(spell, [4, 3], num_prompt=1) == [9]
    # the word's first token is the prompt's last: not banned (vLLM matches the output only)
    assert banned_tokens(spell, [4, 0], num_prompt=2) == [9]
    with pytest.raises(ValueError, match="bad_words"):
        BadWords(_Tok()).check(["z"], vocab_size=20)  # 'z' is id 25
    with pytest.raises(ValueError, match="bad_words"):
        BadWords(None).spellings(["a"])


def test_sampler_masks_biases_and_keeps_raw_logprobs() -> None:
    vocab = 10
    logits = torch.zeros(3, vocab)
    logits[:, 2] = 5.0
    seqs = [_seq(0, SamplingParams(temperature=0, allowed_token_ids=[4, 6], logprobs=0), [1], []),
            _seq(1, SamplingParams(temperature=0, logit_bias={7: 6.0}), [1], []),
            _seq(2, SamplingParams(temperature=0, logit_bias={2: -100}), [1], [])]
    logits[0, 6] = 1.0
    out = Sampler(set())(logits, seqs)
    assert out.token_ids == [6, 7, 0]
    raw = torch.log_softmax(logits[0], -1)[6].item()  # logprobs ignore the mask (raw mode)
    ids, values, rank = out.logprobs[0]  # plain data: the drawn id, no top-k (logprobs=0)
    assert ids == [6] and values == [pytest.approx(raw)]
    assert rank == 2  # in the raw vocabulary: only token 2 (logit 5) is likelier


def test_edits_survive_the_packed_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    # the path a GPU takes: one buffer, unpacked into views (alignment asserted by `unpack`)
    from batchgen_data.sample import sampling_batch

    monkeypatch.setattr(sampling_batch, "to_device", lambda ts, device: unpack(pack(ts), ts))
    seqs = [_seq(0, SamplingParams(logit_bias={4: 1.5}, repetition_penalty=1.2), [1, 2], [3]),
            _seq(1, SamplingParams(allowed_token_ids=[3, 8], min_tokens=2), [1], [])]
    b = SamplingBatch.build(seqs, 20, eos_ids=[2], device=torch.device("cpu"))
    assert b.bias_at.tolist() == [[0], [4]] and b.bias.tolist() == [1.5]
    assert b.allowed.tolist() == [[1, 1], [3, 8]] and b.allowed_rows.tolist() == [1]
    assert b.ban.tolist() == [[1], [2]] and b.prompt_ids.tolist() == [[1, 2], [1, 20]]
    assert b.greedy.tolist() == [False, False]
    assert b.repetition.view(-1).tolist() == pytest.approx([1.2, 1.0])


def test_rows_sharing_params_objects_get_their_own_values() -> None:
    # distinct objects are read once each; every row still gets its object's values, in order
    hot, cold = SamplingParams(temperature=0.9, top_k=7), SamplingParams(temperature=0.3)
    seqs = [_seq(0, hot, [1], [4]), _seq(1, cold, [1], []), _seq(2, hot, [1], [4, 5]),
            _seq(3, SamplingParams(temperature=0), [1], [6])]
    b = SamplingBatch.build(seqs, 40, eos_ids=[2], device=torch.device("cpu"))
    assert b.temperature.view(-1).tolist() == pytest.approx([0.9, 0.3, 0.9, 1e-5])
    assert b.top_k.view(-1).tolist() == [7, 40, 7, 40]
    assert b.greedy.tolist() == [False, False, False, True]
    assert b.step.tolist() == [1, 0, 2, 1] and b.seed.tolist() == [1000, 1001, 1002, 1003]
    assert b.any_greedy and not b.all_greedy and b.truncate_top


def test_plain_greedy_rows_build_nothing() -> None:
    # greedy with nothing that edits or reports the logits: the argmax alone decides
    plain = SamplingParams(temperature=0)
    seqs = [_seq(i, plain, [1], [3] * i) for i in range(3)]
    assert SamplingBatch.build(seqs, 10, eos_ids=[2], device=torch.device("cpu")) is None
    logits = torch.randn(3, 10)
    out = Sampler({2})(logits, seqs)
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs == [None] * 3
    # one row asking for logprobs (or min_tokens, penalties...) needs the batch again
    seqs.append(_seq(3, SamplingParams(temperature=0, logprobs=1), [1], []))
    assert SamplingBatch.build(seqs, 10, eos_ids=[2], device=torch.device("cpu")) is not None
