"""Bad words (vLLM's `SamplingParams.bad_words`): words a sequence must never complete.

A word is tokenised as written (leading spaces stripped) and again after one space, because
byte-level BPE spells a word differently at the start of a text and in the middle of one. For
each spelling, the sampler bans its last token whenever the sequence's output so far ends with
the spelling's other tokens; a one-token spelling is therefore banned at every step. As in vLLM,
only generated tokens are matched: a word that would start inside the prompt is not blocked.

vLLM keeps the spaced spelling only when it has as many tokens as the plain one; here every
distinct spelling is kept, so a word that is one token after a space (" York") but two at the
start ("Y", "ork") is banned in both places.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any


class BadWords:
    """Tokenises each distinct `bad_words` list once per engine (rows of a job usually share it)."""

    def __init__(self, tokenizer: Any, max_cached: int = 1024) -> None:
        self.tokenizer = tokenizer
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple[str, ...], list[list[int]]] = OrderedDict()

    def spellings(self, words: list[str]) -> list[list[int]]:
        """Token-id spellings of `words`; ValueError naming `bad_words` when one has none."""
        key = tuple(words)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._tokenise(words)
            self._cache[key] = hit
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return hit

    def _tokenise(self, words: list[str]) -> list[list[int]]:
        if self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer; this engine has none")
        out: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError(f"SamplingParams.bad_words: {word!r} tokenises to no tokens")
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            for ids in (plain, spaced):
                if ids and ids not in out:
                    out.append(list(ids))
        return out

    def check(self, words: list[str], vocab_size: int) -> None:
        outside = sorted({t for ids in self.spellings(words) for t in ids if t >= vocab_size})
        if outside:
            raise ValueError(f"SamplingParams.bad_words: token id(s) {outside[:5]} are outside "
                             f"the model's vocabulary [0, {vocab_size})")


def banned_tokens(spellings: list[list[int]], token_ids: list[int], num_prompt: int) -> list[int]:
    """Tokens that would complete a spelling right after `token_ids` (prompt + output)."""
    out = []
    n = len(token_ids)
    for ids in spellings:
        head = len(ids) - 1
        if head == 0 or (n - head >= num_prompt and token_ids[n - head:] == ids[:-1]):
            out.append(ids[-1])
    return out
