"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`), paid for only by requests that ask.

Entry i of a request's `prompt_logprobs` is the log-probability of prompt token i under the
logits at position i-1 (plus the top-k there); entry 0 is None, since nothing predicts it. A
prompt may be computed over several steps (chunked prefill), so each step the runner notes, for
every collecting sequence, the prompt positions it computes (`PromptRows.add`), takes logits at
just those rows, and `compute` turns them into entries that the engine appends in order.

Two things could leave a hole: prefix-cache hits (cached tokens are never computed, so they have
no logits) and recompute after preemption (positions computed twice). `cacheable_tokens` lets
the scheduler take from the cache only positions already recorded, and `add` skips positions
that are. Logprobs are of the raw model distribution (vLLM's default), before any sampling edit.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from batchgen_data.core.sequence import Sequence
from batchgen_data.logprobs import RawLogprobs

Entries = list[RawLogprobs]  # the prompt token first, then the top-k (batchgen_data/logprobs.py)

# rows turned into logits at a time: bounds the [rows, vocab] float32 buffers of a long chunk
_ROWS_PER_SLICE = 512


@dataclass
class PromptRows:
    """The rows of one step's flattened batch whose logits give prompt logprobs."""

    rows: list[int] = field(default_factory=list)
    spans: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (seq, position, count)

    def add(self, seq: Sequence, first_row: int, start: int, end: int) -> None:
        """`seq` computes positions [start, end) this step, at rows first_row, first_row + 1..."""
        lo = max(start, len(seq.prompt_logprobs) - 1)
        hi = min(end, seq.num_prompt_tokens - 1)  # position P-1 predicts the first output token
        if lo < hi:
            self.rows.extend(range(first_row + lo - start, first_row + hi - start))
            self.spans.append((seq, lo, hi - lo))


def compute(hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
            rows: PromptRows) -> list[tuple[Sequence, Entries]]:
    """Prompt-logprob entries for each span of `rows`, from this step's hidden states [T, H]."""
    targets = [seq.token_ids[p + 1] for seq, lo, n in rows.spans for p in range(lo, lo + n)]
    ks = [k for seq, lo, n in rows.spans for k in [seq.params.prompt_logprobs] * n]
    index = torch.tensor(rows.rows, dtype=torch.long, device=hidden.device)
    target = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    entries: Entries = []
    for a in range(0, len(targets), _ROWS_PER_SLICE):
        b = a + _ROWS_PER_SLICE
        logprobs = torch.log_softmax(compute_logits(hidden[index[a:b]]).float(), -1)  # [r, V]
        picked = logprobs.gather(1, target[a:b, None])  # [r, 1]
        ranks = (logprobs >= picked).sum(1).tolist()  # vLLM's rank: 1 + how many are likelier
        vocab = logprobs.shape[1]
        wants = [vocab if k == -1 else k for k in ks[a:b]]  # -1: the whole vocabulary
        k = max(wants)
        top_v, top_i = logprobs.topk(k, -1) if k else (logprobs[:, :0], logprobs[:, :0])
        for tok, lp, rank, vs, ids, want in zip(targets[a:b], picked[:, 0].tolist(), ranks,
                                                top_v.tolist(), top_i.long().tolist(), wants):
            entries.append(([tok, *ids[:want]], [lp, *vs[:want]], rank))
    out, i = [], 0
    for seq, _, n in rows.spans:
        out.append((seq, entries[i:i + n]))
        i += n
    return out
