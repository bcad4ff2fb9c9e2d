"""The sampler's structured-output step: each constrained sequence's token bitmask, applied to
its logits row on the device before anything is drawn.

A matcher's state is derived data: it is the grammar after the sequence's output tokens. So a
matcher is kept per live `Sequence` object (weakly: it goes when the sequence does) and, before
every mask, catches up with the tokens the sequence has that it has not accepted yet. That one
rule covers every way a sequence moves: a step that sampled a token, preemption and recompute
(the output tokens stay), hold/resume, and export/import (a new `Sequence` on another engine
replays its output tokens into a fresh matcher). The prefix cache is untouched: it holds prompt
KV, and the grammar constrains the output only.

The mask is xgrammar's: a token is allowed when the grammar can continue with its bytes, and the
stop tokens (the engine's EOS ids) are allowed only where the grammar is complete. Rows without
a constraint are left untouched; a step with none pays one C-level scan.
"""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch

from batchgen_data.sampling_params import SamplingParams
from batchgen_data.sample.structured.grammars import GrammarCache

log = logging.getLogger(__name__)
_CONSTRAINED = attrgetter("structured_outputs")


@dataclass
class _MatcherState:
    key: tuple[str, str, bool]
    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0  # output tokens fed to the matcher
    broken: bool = False  # a token the grammar rejects: only EOS is allowed from then on


class StructuredLogits:
    """Per engine: the compiled grammars and the live sequences' matchers."""

    def __init__(self, tokenizer: Any, eos_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids)
        self._grammars: GrammarCache | None = None
        self._lock = threading.Lock()
        self._states: weakref.WeakKeyDictionary[Any, _MatcherState] = weakref.WeakKeyDictionary()

    def grammars(self, vocab_size: int) -> GrammarCache:
        with self._lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("SamplingParams.structured_outputs needs a tokenizer; this "
                                     "engine has none")
                self._grammars = GrammarCache(self.tokenizer, vocab_size, self.eos_ids)
            return self._grammars

    def check(self, params: SamplingParams, vocab_size: int) -> None:
        """Compile the request's constraint now (cached): ValueError naming the field if bad."""
        if params.structured_outputs is not None:
            self.grammars(vocab_size).compiled(params.structured_outputs)

    def apply(self, logits: torch.Tensor, seqs: list[Any]) -> None:
        """Mask the constrained rows of `logits` ([N, V], row i = seqs[i]) in place."""
        params = [s.params for s in seqs]
        if not any(map(_CONSTRAINED, params)):
            return
        rows = [i for i, p in enumerate(params) if p.structured_outputs is not None]
        vocab = logits.shape[1]
        grammars = self.grammars(vocab)
        # one row per logits row (xgrammar indexes both by `indices`); unconstrained rows stay
        # all-ones and are skipped anyway
        bitmask = torch.full((len(seqs), (vocab + 31) // 32), -1, dtype=torch.int32)
        matchers, at = [], []
        for i in rows:
            state = self._caught_up(seqs[i], grammars)
            if state.broken:
                _only(bitmask[i], self.eos_ids, vocab)
            else:
                matchers.append(state.matcher)
                at.append(i)
        grammars.fill(matchers, bitmask, at)
        # xgrammar's kernel: C++ on the CPU, Triton on CUDA; the mask is copied to the device
        # once per step
        grammars.apply(logits, bitmask.to(logits.device, non_blocking=True), rows)

    def _caught_up(self, seq: Any, grammars: GrammarCache) -> _MatcherState:
        spec = seq.params.structured_outputs
        key = spec.key()
        state = self._states.get(seq)
        if state is None or state.key != key:
            state = self._states[seq] = _MatcherState(key, grammars.matcher(spec))
        start = seq.num_prompt_tokens + state.num_accepted
        for tok in seq.token_ids[start:]:
            if not state.broken and not state.matcher.accept_token(tok):
                # only a token the mask did not produce (an import from an engine with another
                # tokenizer, say) gets here; end the row rather than the engine
                log.warning("structured output: the grammar rejects token %d of request %s; "
                            "ending it", tok, seq.request_id)
                state.broken = True
            state.num_accepted += 1
        return state


def _only(row: torch.Tensor, token_ids: list[int], vocab: int) -> None:
    """Set a bitmask row to allow just `token_ids`."""
    row.zero_()
    for t in token_ids:
        if t < vocab:
            bit = 1 << (t % 32)
            row[t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 holds bit 31 < 0
