"""Port of vLLM's tests/detokenizer/test_stop_token_ids.py: with `stop_token_ids` and
`include_stop_str_in_output=False` the stop token's text is left out of the output (it stays in
the token ids); with True it is kept; a stop id before `min_tokens` is ordinary text.

Upstream drives its detokenizer with a dummy that decodes id i to chr(i); here the same dummy
tokenizer drives `StopChecker` (this engine stops where vLLM's engine core does, then builds
the text once), so nothing after the stopping token is ever generated. The streaming-delta
cases have no counterpart (outputs come once, finished). The fast-tokenizer cases run through
the whole engine in test_vllm_sampling_params_e2e.py (test_stop_token_ids).
"""
from __future__ import annotations

from typing import Any

from batchgen_data import SamplingParams
from batchgen_data.core.sequence import Sequence, SequenceStatus
from batchgen_data.core.stop import StopChecker

EOS = 3  # decodes to "<eos>" when special tokens are shown


class ChrTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(("" if skip_special_tokens else "<eos>") if i == EOS else chr(i)
                       for i in ids)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def generate(tokens: list[int], **kw: Any) -> tuple[Sequence, str]:
    """Feed `tokens` as if sampled until the checker stops the sequence; its text."""
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 100), **kw)
    seq = Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=ids("p"), params=params,
                   seed=0, max_tokens=params.max_tokens or 100)
    checker = StopChecker(ChrTokenizer(), {EOS})
    for t in tokens:
        seq.token_ids.append(t)
        status = checker.check(seq)
        if status is not None:
            seq.status = status
            break
    return seq, checker.final_text(seq)


# upstream: test_stop_token_id_excluded_from_output
def test_stop_token_id_excluded_from_output() -> None:
    seq, text = generate(ids("hello!"), stop_token_ids=[ord("!")])
    assert text == "hello" and seq.output_token_ids == ids("hello!")
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason == ord("!")


# upstream: test_stop_token_id_included_in_output
def test_stop_token_id_included_in_output() -> None:
    seq, text = generate(ids("hello!"), stop_token_ids=[ord("!")],
                         include_stop_str_in_output=True)
    assert text == "hello!" and seq.output_token_ids == ids("hello!")


# upstream: test_stop_token_id_in_same_step_as_prior_tokens and
# test_include_stop_token_drops_suffix_in_same_step: nothing after the stop id is generated
def test_nothing_after_the_stop_token() -> None:
    for include, want in ((False, "hello"), (True, "hello!")):
        seq, text = generate(ids("hello!more"), stop_token_ids=[ord("!")],
                             include_stop_str_in_output=include)
        assert text == want and seq.output_token_ids == ids("hello!")


# upstream: test_stop_token_id_before_min_tokens_is_ordinary_output
def test_stop_token_id_before_min_tokens_is_ordinary_output() -> None:
    seq, text = generate(ids("hi!xy!z"), stop_token_ids=[ord("!")], min_tokens=5)
    assert text == "hi!xy" and seq.output_token_ids == ids("hi!xy!")


# upstream: test_stop_strings_still_truncate_when_stop_token_ids_set
def test_stop_strings_still_truncate_when_stop_token_ids_set() -> None:
    seq, text = generate(ids("abcdeZ"), stop=["cd"], stop_token_ids=[ord("Z")])
    assert seq.stop_reason == "cd" and text == "ab" and seq.output_token_ids == ids("abcd")


# vLLM's detokenizer skips the token that stopped the request (EOS too) unless
# include_stop_str_in_output: with special tokens shown, EOS text follows the same rule
def test_eos_text_follows_the_same_rule() -> None:
    for include, want in ((False, "hello"), (True, "hello<eos>")):
        seq, text = generate(ids("hello") + [EOS, *ids("x")], skip_special_tokens=False,
                             include_stop_str_in_output=include)
        assert text == want and seq.stop_reason is None and seq.output_token_ids[-1] == EOS
    # a length stop ends on an ordinary token: all of it is text
    seq, text = generate(ids("hello!"), stop_token_ids=[ord("?")], max_tokens=6)
    assert seq.status == SequenceStatus.FINISHED_LENGTH and text == "hello!"
