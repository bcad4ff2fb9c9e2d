"""The sequence coroutine: each request is driven by a coroutine that suspends on the model.

At every suspension point the coroutine has one need — "compute my pending tokens and, when
they are all computed, give me the next token". While it is suspended the runtime is free to
combine it with other coroutines into one batch, hold it (free its KV), resume it, export it as
plain data to another engine, or abort it. All of that is possible because a suspended coroutine
keeps no state outside its `Sequence`: the sequence *is* the suspended coroutine, and resuming
it is one transition from the step's result — count the computed tokens; if the step sampled,
append the token (and its logprobs), check the stop conditions, and finish or suspend again.
A sequence under a thinking budget may also be handed tokens it did not sample (the end of its
thinking, core/thinking.py): it suspends with them pending, and its next step computes them.

The engine resumes every coroutine of a step at once with `resume_step`: that transition
applied sequence by sequence in one loop, without a generator frame, a result tuple and a
dictionary lookup per sequence (at 256 sequences those were a third of the host's work after
the model: benchmarks/host_overhead.py).
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from itertools import repeat

from batchgen_data.core.sequence import Sequence
from batchgen_data.core.stop import StopChecker
from batchgen_data.logprobs import RawLogprobs


def resume_step(seqs: Seq[Sequence], counts: Seq[int], sampled: Seq[Sequence],
                token_ids: Seq[int], logprobs: Seq[RawLogprobs | None],
                stopper: StopChecker) -> list[Sequence]:
    """Resume every coroutine of a step: `seqs` computed `counts` tokens each, and the
    `sampled` ones (a subset of `seqs`, each once) drew `token_ids` with `logprobs`. Returns
    the sequences that finished (their status says why), in the order of `sampled`
    (`sampled is seqs`: all of them, one pass). No sequence's result depends on another's."""
    check = stopper.check
    done = []
    if sampled is seqs:  # every sequence sampled (a decode step): one pass
        rows = zip(seqs, counts, token_ids, logprobs)
    else:
        for seq, n in zip(seqs, counts):
            seq.num_computed_tokens += n
        rows = zip(sampled, repeat(0), token_ids, logprobs)
    for seq, n, token, lp in rows:
        seq.num_computed_tokens += n
        seq.token_ids.append(token)
        if lp is not None and seq.logprobs is not None:
            seq.logprobs.append(lp)
        reason = check(seq)
        if reason is not None:
            seq.status = reason
            done.append(seq)
        elif seq.thinking is not None:  # under a thinking budget (core/thinking.py)
            seq.thinking.saw(seq, token)
    return done


__all__ = ["resume_step"]
