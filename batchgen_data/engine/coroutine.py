"""The sequence coroutine: each request is driven by a coroutine that suspends on the model.

At every suspension point the coroutine has one need — "compute my pending tokens and, when
they are all computed, give me the next token". While it is suspended the runtime is free to
combine it with other coroutines into one batch, hold it (free its KV), resume it, export it as
plain data to another engine, or abort it. All of that is possible because a suspended coroutine
keeps no state outside its `Sequence`: the sequence *is* the suspended coroutine, and resuming
it is one transition, `advance`, from the step's result.

Two drivers run that transition. `run_sequence` is the coroutine written out as a generator, one
sequence at a time (`start` / `send`). The engine resumes every coroutine of a step at once with
`resume_step`: the same transition applied sequence by sequence in one loop, without a generator
frame, a result tuple and a dictionary lookup per sequence (at 256 sequences a step that is a
third of the host's work after the model: benchmarks/host_overhead.py).
"""
from __future__ import annotations

from collections.abc import Generator, Sequence as Seq
from itertools import repeat

from batchgen_data.engine.sequence import Sequence, SequenceStatus
from batchgen_data.engine.stop import StopChecker


# What the runtime sends back into a suspended coroutine after a model step: (how many pending
# tokens the step computed for this sequence, the sampled next token or None after a partial
# prefill chunk, that token's logprobs or None).
StepResult = tuple[int, int | None, dict[int, float] | None]

SequenceCoroutine = Generator[Sequence, StepResult, None]


def advance(seq: Sequence, num_computed: int, token: int | None,
            logprobs: dict[int, float] | None, stopper: StopChecker) -> bool:
    """Resume `seq` at its suspension point with a step's result; True when it has finished
    (its status then says why)."""
    seq.num_computed_tokens += num_computed
    if token is None:
        return False
    seq.token_ids.append(token)
    if seq.logprobs is not None and logprobs is not None:
        seq.logprobs.append(logprobs)
    reason = stopper.check(seq)
    if reason is None:
        return False
    seq.status = reason
    return True


def run_sequence(seq: Sequence, stopper: StopChecker) -> SequenceCoroutine:
    while True:
        # suspension point: the runtime decides what happens next
        num_computed, token, logprobs = yield seq
        if advance(seq, num_computed, token, logprobs, stopper):
            return


def start(seq: Sequence, stopper: StopChecker) -> SequenceCoroutine:
    """Create the generator for `seq` and run it to its first suspension point."""
    assert not seq.status.finished
    coro = run_sequence(seq, stopper)
    next(coro)
    return coro


def send(coro: SequenceCoroutine, result: StepResult) -> bool:
    """Resume `coro` with a step result; True when the sequence has finished."""
    try:
        coro.send(result)
    except StopIteration:
        return True
    return False


def resume_step(seqs: Seq[Sequence], counts: Seq[int], sampled: Seq[Sequence],
                token_ids: Seq[int], logprobs: Seq[dict[int, float] | None],
                stopper: StopChecker) -> list[Sequence]:
    """`advance` every coroutine of a step: `seqs` computed `counts` tokens each, and the
    `sampled` ones (a subset of `seqs`, each once) drew `token_ids` with `logprobs`. Returns
    the sequences that finished, in the order of `sampled` (`sampled is seqs`: all of them, one
    pass). The same transitions as `advance` sequence by sequence: no sequence's result depends
    on another's."""
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
    return done


__all__ = ["StepResult", "SequenceCoroutine", "advance", "run_sequence", "start", "send",
           "resume_step", "SequenceStatus"]
