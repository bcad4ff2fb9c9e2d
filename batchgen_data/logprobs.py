"""vLLM's logprob results: per position, a dict token id -> `Logprob(logprob, rank, decoded_token)`.

The engine keeps each position's logprobs as plain data (`RawLogprobs`, which travels with an
exported request): the ids with the sampled (or prompt) token first and then the top-k in rank
order, their log-probabilities, and the first token's rank in the whole vocabulary (1 + how many
tokens have a logprob at least as high, as vLLM counts it). `position_logprobs` turns one into
vLLM's dict when the output is built: the first token with its own rank, the top-k with ranks
1..k (a token in both keeps its top-k rank and its first place, as in vLLM), each with its text
unless the request asked for no text (`detokenize=False`: `decoded_token` is None).

A `Logprob` is also the float of its log-probability, so code that reads a logprob as a plain
float (`lp[t] - lp[u]`, `float(lp[t])`, an Arrow float column) works too.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# (token ids, their logprobs, the first id's rank in the vocabulary)
RawLogprobs = tuple[list[int], list[float], int]

_BAD = "\ufffd"  # what a token that ends inside a UTF-8 character decodes to
_CONTEXT = 4  # preceding tokens that can complete one: a UTF-8 character has at most 4 bytes


class Logprob(float):
    """One candidate's logprob, its rank in the vocabulary (>= 1) and its text (vLLM's
    `Logprob`); equal to its `logprob` as a float."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None,
                decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Logprob):
            return (float(self) == float(other) and self.rank == other.rank
                    and self.decoded_token == other.decoded_token)
        return float.__eq__(self, other)  # type: ignore[operator]

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = float.__hash__

    def __repr__(self) -> str:
        return (f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
                f"decoded_token={self.decoded_token!r})")

    def __reduce__(self) -> tuple[Any, tuple[float, int | None, str | None]]:
        return Logprob, (float(self), self.rank, self.decoded_token)


def position_logprobs(raw: RawLogprobs, texts: Sequence[str | None]) -> dict[int, Logprob]:
    """One position's dict from its plain data and each id's text (`texts[i]` for `raw[0][i]`)."""
    ids, values, rank = raw
    out: dict[int, Logprob] = {}
    for i, (tok, value, text) in enumerate(zip(ids, values, texts)):
        out[tok] = Logprob(value, rank if i == 0 else i, text)
    return out


def build(raws: Sequence[RawLogprobs | None] | None, tokenizer: Any, detokenize: bool
          ) -> tuple[list[dict[int, Logprob] | None] | None, float | None]:
    """A sequence's (or a prompt's) positions as vLLM's dicts, and the sum of the first tokens'
    logprobs (`cumulative_logprob`); (None, None) when none were asked for. A None position
    (the prompt's first token: nothing predicts it) stays None."""
    if raws is None:
        return None, None
    texts = _TokenText(tokenizer, raws) if detokenize and tokenizer is not None else None
    out: list[dict[int, Logprob] | None] = []
    total = 0.0
    context: list[int] = []  # the tokens so far: they complete a token cut inside a character
    for raw in raws:
        if raw is None:
            out.append(None)
            continue
        out.append(position_logprobs(raw, texts(raw[0], context) if texts is not None
                                     else [None] * len(raw[0])))
        total += raw[1][0]
        context.append(raw[0][0])
    return out, total


class _TokenText:
    """Each candidate's text, decoded on its own as vLLM does (every distinct id of the
    sequence once, in one call); one that ends inside a UTF-8 character (byte-level tokens) is
    completed from the tokens before it, or is ''."""

    def __init__(self, tokenizer: Any, raws: Sequence[RawLogprobs | None]) -> None:
        self.tokenizer = tokenizer
        ids = sorted({t for raw in raws if raw is not None for t in raw[0]})
        texts = tokenizer.batch_decode([[t] for t in ids])
        pieces = tokenizer.convert_ids_to_tokens(ids)
        self.text: dict[int, str] = {}
        for tok, text, piece in zip(ids, texts, pieces):
            # a SentencePiece word start ("\u2581word") decodes without its space on its own
            if isinstance(piece, str) and piece.startswith("\u2581") and not text.startswith(" "):
                text = " " + text
            self.text[tok] = text

    def __call__(self, ids: list[int], context: list[int]) -> list[str | None]:
        return [self._complete(t, context) if self.text[t].endswith(_BAD) else self.text[t]
                for t in ids]

    def _complete(self, tok: int, context: list[int]) -> str:
        """The text `tok` adds after the shortest tail of `context` with which it ends on a
        whole character; the tail's own tokens that were cut short gave '' and so give their
        bytes to this one."""
        decode = self.tokenizer.decode
        for n in range(1, min(_CONTEXT, len(context)) + 1):
            tail = context[-n:]
            whole = decode(tail + [tok])
            if whole.endswith(_BAD):
                continue
            keep = len(tail)
            while keep and decode([tail[keep - 1]]).endswith(_BAD):
                keep -= 1
            prefix = decode(tail[:keep]) if keep else ""
            if whole.startswith(prefix):
                return whole[len(prefix):]
            common = 0
            for a, b in zip(prefix, whole):
                if a != b:
                    break
                common += 1
            return whole[common:]
        return ""
