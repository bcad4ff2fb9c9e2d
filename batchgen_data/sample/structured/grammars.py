"""Compiling constraints into token-level grammars with xgrammar, once per distinct spec.

One `GrammarCache` per engine: it holds xgrammar's view of the tokenizer (which bytes each of
the model's token ids spells; ids past the tokenizer's vocabulary, as in a padded embedding,
are never allowed) and the compiled grammars, keyed by `StructuredOutputsParams.key()`, so the
rows of a job that share a schema compile it once. Compiling happens when the engine accepts a
request (`check`), so a bad regex or schema is that request's ValueError, not a failed step.
xgrammar is imported here only, on first use: engines that never see a constraint never load it.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from batchgen_data.structured import StructuredOutputsParams


def choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of these strings" (JSON string literals are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCache:
    """Compiled grammars for one tokenizer and vocabulary size; thread-safe (rows are checked
    on connector threads while the engine thread builds matchers)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 max_cached: int = 256) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        # xgrammar's own cache keys on the grammar text; ours also skips building that text
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher, made on the first big step

    def compiled(self, spec: StructuredOutputsParams) -> Any:
        """The xgrammar CompiledGrammar for `spec`; ValueError naming the field if it does not
        compile."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            try:
                hit = self._compile(spec)
            except (RuntimeError, ValueError) as e:  # xgrammar: RuntimeError for parse errors
                raise ValueError(f"structured_outputs.{spec.kind} does not compile: "
                                 f"{_first_line(e)}") from None
            self._cache[key] = hit
            if len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
            return hit

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        c = self._compiler
        any_ws = not spec.disable_any_whitespace
        if spec.json is not None:
            return c.compile_json_schema(json.dumps(spec.json), any_whitespace=any_ws)
        if spec.json_object:
            # strict mode would forbid every property an empty schema does not declare
            return c.compile_json_schema('{"type": "object"}', any_whitespace=any_ws,
                                         strict_mode=False)
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_grammar(choice_grammar(spec.choice))
        assert spec.grammar is not None
        return c.compile_grammar(spec.grammar)

    def fill(self, matchers: list[Any], bitmask: Any, rows: list[int]) -> None:
        """Bitmask row rows[i] := the tokens matchers[i] allows next (rows in parallel on
        xgrammar's threads once there are enough of them to pay for it)."""
        if len(matchers) < 8:
            for m, i in zip(matchers, rows):
                m.fill_next_token_bitmask(bitmask, i)
            return
        if self._batch is None:
            self._batch = self._xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def apply(self, logits: Any, bitmask: Any, rows: list[int]) -> None:
        """Set logits[i, t] = -inf for each i in `rows` whose bitmask row disallows token t."""
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                              indices=rows)

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh xgrammar GrammarMatcher at the start of the constrained output."""
        return self._xgr.GrammarMatcher(self.compiled(spec))


def _first_line(e: BaseException) -> str:
    # xgrammar prefixes a timestamp and a C++ source location: keep the message
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[-1] if text.startswith("[") else text
