"""The sampler's structured step on its own: the mask reaches exactly the constrained rows, a
matcher catches up with tokens it has not seen, and compile errors are ValueErrors."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen_data import SamplingParams
from batchgen_data.sample.structured.grammars import choice_grammar

xgr = pytest.importorskip("xgrammar")
from batchgen_data.sample.structured.logits import StructuredLogits, _only  # noqa: E402


@dataclass(eq=False)
class FakeSeq:
    """The fields of engine.Sequence that the structured step reads."""

    params: SamplingParams
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    request_id: str = "r"

    def __post_init__(self) -> None:
        self.token_ids = self.token_ids or list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.conftest import build_tokenizer

    return build_tokenizer(Path(tmp_path_factory.mktemp("tok")))


def allowed_tokens(tokenizer: Any, text: str, vocab: int) -> set[int]:
    """Ids whose decoded text keeps `text` a prefix of one of the choices 'yes'/'no'."""
    return {t for t in range(vocab) if any(c.startswith(text + tokenizer.decode([t]))
                                           for c in ("yes", "no"))
            and tokenizer.decode([t]) != ""}


def test_mask_hits_only_constrained_rows_and_follows_the_output(tokenizer: Any) -> None:
    vocab = len(tokenizer) + 5  # a padded embedding: ids past the tokenizer never allowed
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    step = StructuredLogits(tokenizer, [eos])
    sp = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    plain = FakeSeq(SamplingParams(), [5, 6])
    seq = FakeSeq(sp, [5, 6])
    logits = torch.randn(2, vocab)
    before = logits.clone()
    step.apply(logits, [plain, seq])
    assert torch.equal(logits[0], before[0])
    kept = set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
    assert kept and kept == allowed_tokens(tokenizer, "", vocab)
    assert torch.equal(logits[1][list(kept)], before[1][list(kept)])
    # the sequence takes "y" then "e": the matcher catches up with both before the next mask
    seq.token_ids += tokenizer.encode("y") + tokenizer.encode("e")
    logits = torch.randn(1, vocab)
    step.apply(logits, [seq])
    kept = set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
    assert kept == allowed_tokens(tokenizer, "ye", vocab)
    seq.token_ids += tokenizer.encode("s")
    logits = torch.randn(1, vocab)
    step.apply(logits, [seq])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [eos]  # complete: EOS only


def test_a_token_the_grammar_rejects_ends_the_row(tokenizer: Any) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    step = StructuredLogits(tokenizer, [eos])
    seq = FakeSeq(SamplingParams(structured_outputs={"regex": "[0-9]+"}), [5],
                  [5, *tokenizer.encode("x")])
    logits = torch.randn(1, len(tokenizer))
    step.apply(logits, [seq])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [eos]


def test_compile_errors_and_missing_tokenizer() -> None:
    with pytest.raises(ValueError, match="needs a tokenizer"):
        StructuredLogits(None, [0]).check(SamplingParams(structured_outputs={"regex": "a"}), 10)
    StructuredLogits(None, [0]).check(SamplingParams(), 10)  # unconstrained: nothing to do


def test_only_sets_every_bit_position() -> None:
    row = torch.zeros(2, dtype=torch.int32)
    _only(row, [0, 31, 63, 70], vocab=64)  # 70 is outside the vocabulary: ignored
    bits = [(int(row[t // 32]) >> (t % 32)) & 1 for t in range(64)]
    assert [t for t, b in enumerate(bits) if b] == [0, 31, 63]


def test_choice_grammar_quotes_literals() -> None:
    assert choice_grammar(['say "hi"', "a\\b"]) == 'root ::= "say \\"hi\\"" | "a\\\\b"'


def test_parallel_fill_of_a_big_step_equals_row_by_row(tokenizer: Any) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    specs = [{"regex": "[a-c]+"}, {"choice": ["yes", "no"]}, {"json_object": True}]
    seqs = [FakeSeq(SamplingParams(structured_outputs=specs[i % 3]), [5]) for i in range(20)]
    for s in seqs[::3]:
        s.token_ids += tokenizer.encode("ab")
    seqs.insert(4, FakeSeq(SamplingParams(), [5]))  # unconstrained, in the middle
    batched = torch.zeros(len(seqs), len(tokenizer))
    StructuredLogits(tokenizer, [eos]).apply(batched, seqs)  # 20 rows: xgrammar's threads
    single = StructuredLogits(tokenizer, [eos])
    for i, s in enumerate(seqs):
        row = torch.zeros(1, len(tokenizer))
        single.apply(row, [s])
        assert torch.equal(torch.isinf(row[0]), torch.isinf(batched[i])), i
    assert not torch.isinf(batched[4]).any()
