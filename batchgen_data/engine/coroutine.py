"""The sequence coroutine: each request is driven by a generator that suspends on the model.

At every `yield` the coroutine is suspended with one need — "compute my pending tokens and, when
they are all computed, give me the next token". While it is suspended the runtime is free to
combine it with other coroutines into one batch, hold it (free its KV), resume it, export it as
plain data to another engine, or abort it. All of that is possible because a suspended coroutine
keeps no state outside its `Sequence`: rebuilding the generator from the sequence (see `start`)
resumes it exactly where it was.
"""
from __future__ import annotations

from collections.abc import Generator

from batchgen_data.engine.sequence import Sequence, SequenceStatus
from batchgen_data.engine.stop import StopChecker


# What the runtime sends back into a suspended coroutine after a model step: (how many pending
# tokens the step computed for this sequence, the sampled next token or None after a partial
# prefill chunk, that token's logprobs or None). A plain tuple: the engine builds one per
# sequence per step, and a tuple costs a tenth of a dataclass instance.
StepResult = tuple[int, int | None, dict[int, float] | None]

SequenceCoroutine = Generator[Sequence, StepResult, None]


def run_sequence(seq: Sequence, stopper: StopChecker) -> SequenceCoroutine:
    while True:
        # suspension point: the runtime decides what happens next
        num_computed, token, logprobs = yield seq
        seq.num_computed_tokens += num_computed
        if token is None:
            continue
        seq.token_ids.append(token)
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        reason = stopper.check(seq)
        if reason is not None:
            seq.status = reason
            return


def start(seq: Sequence, stopper: StopChecker) -> SequenceCoroutine:
    """Create the coroutine for `seq` and run it to its first suspension point."""
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


__all__ = ["StepResult", "SequenceCoroutine", "run_sequence", "start", "send", "SequenceStatus"]
