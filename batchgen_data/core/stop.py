"""Stop conditions: EOS, stop token ids, stop strings, max_tokens.

Stop strings are matched on a decoded window at the tail of the output, so the per-token cost
does not grow with the output length.
"""
from __future__ import annotations

from typing import Any

from batchgen_data.core.sequence import Sequence, SequenceStatus


class StopChecker:
    def __init__(self, tokenizer: Any, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def check(self, seq: Sequence) -> SequenceStatus | None:
        p = seq.params
        n_out = len(seq.token_ids) - len(seq.prompt_token_ids)  # num_output_tokens, inlined
        last = seq.token_ids[-1]
        if n_out >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                seq.stop_reason = None
                return SequenceStatus.FINISHED_STOPPED
            if last in p.stop_token_ids:
                seq.stop_reason = last
                return SequenceStatus.FINISHED_STOPPED
            if p.stop and self.tokenizer is not None and self._match_stop_string(seq):
                return SequenceStatus.FINISHED_STOPPED
        if n_out >= seq.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _match_stop_string(self, seq: Sequence) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        # a token decodes to at least one character in practice; keep a margin for merges
        window = seq.output_token_ids[-(longest + 8):]
        skip = seq.params.skip_special_tokens
        tail = self.tokenizer.decode(window, skip_special_tokens=skip)
        before = len(self.tokenizer.decode(window[:-1], skip_special_tokens=skip))
        for s in seq.params.stop:
            # only a match the newest token completes counts (vLLM): an occurrence from before
            # min_tokens allowed stopping must not end the sequence later
            if s in tail[max(0, before - len(s) + 1):]:
                seq.stop_reason = s
                return True
        return False

    def final_text(self, seq: Sequence) -> str:
        """Detokenise the output once, trimming at the stop string (vLLM semantics); '' when the
        request asked for no text (`detokenize=False`, which also rules out stop strings).

        A token that stopped the sequence (EOS, or one of `stop_token_ids`) is left out of the
        text unless `include_stop_str_in_output`, as vLLM's detokenizer does; it stays in
        `token_ids`. A stop id before `min_tokens` did not stop anything: it is plain text."""
        if self.tokenizer is None or not seq.params.detokenize:
            return ""
        skip = seq.params.skip_special_tokens
        out = seq.output_token_ids
        if self._stopped_by_token(seq):
            out = out[:-1]
        text = self.tokenizer.decode(out, skip_special_tokens=skip)
        if isinstance(seq.stop_reason, str) and seq.stop_reason in seq.params.stop:
            # cut at the occurrence the last token completed, not at an earlier one
            before = len(self.tokenizer.decode(out[:-1], skip_special_tokens=skip))
            cut = text.find(seq.stop_reason, max(0, before - len(seq.stop_reason) + 1))
            if cut < 0:
                cut = text.find(seq.stop_reason)
            if cut >= 0:
                keep = len(seq.stop_reason) if seq.params.include_stop_str_in_output else 0
                text = text[: cut + keep]
        return text

    def _stopped_by_token(self, seq: Sequence) -> bool:
        """Whether the last output token is the EOS or stop id that finished `seq`: the
        conditions `check` stopped on, read back from the sequence."""
        p = seq.params
        n_out = seq.num_output_tokens
        if p.include_stop_str_in_output or n_out == 0 or isinstance(seq.stop_reason, str):
            return False
        if seq.stop_reason is not None:
            return seq.stop_reason == seq.token_ids[-1]
        return (not p.ignore_eos and n_out >= p.min_tokens
                and seq.token_ids[-1] in self.eos_token_ids)
