"""StopChecker with a fake tokenizer: EOS, stop token ids, stop strings (exact truncation point,
include_stop_str_in_output, skip_special_tokens), min_tokens and max_tokens.

The fake tokenizer maps each token id to a fixed string, so every expected text is written out
by hand rather than computed by the code under test.
"""
from __future__ import annotations

from typing import Any

from batchgen_data import SamplingParams
from batchgen_data.core.sequence import Sequence, SequenceStatus
from batchgen_data.core.stop import StopChecker

EOS = 2
SPECIAL = {1: "<s>", 2: "</s>"}
PIECES = {10: "Hel", 11: "lo", 12: " wor", 13: "ld", 14: "!", 15: " END", 16: "."}


class FakeTokenizer:
    """decode() joins fixed per-token strings; special ids are dropped when asked to."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if i in SPECIAL:
                if not skip_special_tokens:
                    out.append(SPECIAL[i])
            else:
                out.append(PIECES[i])
        return "".join(out)


def run(tokens: list[int], **kw: Any) -> tuple[Sequence, SequenceStatus | None, int]:
    """Feed `tokens` one at a time as if sampled; return the sequence, its final status and the
    number of tokens it took to stop (the rest are never appended)."""
    params = SamplingParams(**kw)
    seq = Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=[10, 11], params=params,
                   seed=0, max_tokens=params.max_tokens or 100)
    checker = StopChecker(FakeTokenizer(), {EOS})
    status = None
    for n, t in enumerate(tokens, 1):
        seq.token_ids.append(t)
        status = checker.check(seq)
        if status is not None:
            return seq, status, n
    return seq, status, len(tokens)


def test_eos_stops_inclusive_unless_ignored_or_before_min_tokens() -> None:
    seq, st, n = run([12, 13, EOS, 14, 14], max_tokens=10)
    assert st == SequenceStatus.FINISHED_STOPPED and n == 3 and seq.stop_reason is None
    assert seq.output_token_ids == [12, 13, EOS]
    _, st, n = run([12, 13, EOS, 14, 14], max_tokens=5, ignore_eos=True)
    assert st == SequenceStatus.FINISHED_LENGTH and n == 5
    # min_tokens=4: the EOS at position 3 does not count, the next one (position 5) does
    _, st, n = run([12, 13, EOS, 14, EOS, 14], max_tokens=10, min_tokens=4)
    assert st == SequenceStatus.FINISHED_STOPPED and n == 5


def test_stop_token_id_is_the_stop_reason() -> None:
    seq, st, n = run([12, 13, 14, 16], max_tokens=10, stop_token_ids=[14])
    assert st == SequenceStatus.FINISHED_STOPPED and n == 3 and seq.stop_reason == 14


def test_stop_string_spanning_tokens_truncates_exactly() -> None:
    checker = StopChecker(FakeTokenizer(), {EOS})
    # " world!" spans tokens 12 13 14; "or" is inside token 12 and must cut mid-token
    seq, st, n = run([12, 13, 14, 15, 16], max_tokens=10, stop=["ld!"])
    assert st == SequenceStatus.FINISHED_STOPPED and n == 3 and seq.stop_reason == "ld!"
    assert checker.final_text(seq) == " wor"
    seq, _, n = run([12, 13, 14, 15], max_tokens=10, stop=["or"])
    assert n == 1 and checker.final_text(seq) == " w"
    seq, _, _ = run([12, 13, 14, 15], max_tokens=10, stop=["or"], include_stop_str_in_output=True)
    assert checker.final_text(seq) == " wor"
    # the earliest of several stop strings wins once it is complete
    seq, _, n = run([12, 13, 14, 15, 16], max_tokens=10, stop=[" END", "!"])
    assert n == 3 and seq.stop_reason == "!" and checker.final_text(seq) == " world"


def test_stop_strings_see_special_tokens_only_when_not_skipped() -> None:
    checker = StopChecker(FakeTokenizer(), {EOS})
    seq, st, n = run([12, 1, 13, 14], max_tokens=10, stop=["<s>"], skip_special_tokens=False)
    assert st == SequenceStatus.FINISHED_STOPPED and n == 2 and checker.final_text(seq) == " wor"
    seq, st, n = run([12, 1, 13, 14], max_tokens=4, stop=["<s>"])
    assert st == SequenceStatus.FINISHED_LENGTH and n == 4
    assert checker.final_text(seq) == " world!"
    seq, _, _ = run([12, 1, 13, 14], max_tokens=4, skip_special_tokens=False)
    assert checker.final_text(seq) == " wor<s>ld!"


def test_no_stop_before_min_tokens_and_length_at_max_tokens() -> None:
    checker = StopChecker(FakeTokenizer(), {EOS})
    # the "!" at position 2 comes before min_tokens: it neither stops the sequence when
    # min_tokens is reached (position 3) nor is it the truncation point (vLLM semantics)
    seq, st, n = run([12, 14, 13, 14], max_tokens=10, stop=["!"], min_tokens=3)
    assert st == SequenceStatus.FINISHED_STOPPED and n == 4 and seq.stop_reason == "!"
    assert checker.final_text(seq) == " wor!ld"
    _, st, n = run([12, 13, 16, 16, 16], max_tokens=3)
    assert st == SequenceStatus.FINISHED_LENGTH and n == 3
