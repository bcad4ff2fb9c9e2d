"""The encoder as a step of the coroutines: a prompt with images suspends until they are
encoded, and the scheduler gathers the images of many prompts into each step's encoder batch.

When the scheduler comes to admit a prompt with images, `to_encode` lists those its prefill
still has to read (not covered by a prefix-cache hit) that the engine's encoder cache neither
holds nor expects from this step's batch. They join the step's batch (`SchedulerOutput.encode`)
while its encoder budget (`max_num_encoder_input_tokens`, in image embedding rows) lasts; when
it does not, the prompt stays queued, suspended for its encoding, and so does everything behind
it (first come, first served, as for KV blocks). A batch never starves: the first prompt of a
step is admitted whatever its images cost. The runner encodes the batch in one tower call
before the step's forward, so the prompt's first chunk already reads the embeddings.

An admitted prompt holds its images in the cache (`hold`) until its prefill has passed them
(`prefilled`, after each step) or it leaves the running set (`let_go`: finished, aborted,
preempted; a preempted one encodes again on resume only if its images were dropped meanwhile).
"""
from __future__ import annotations

from typing import Any

from batchgen_data.core.scheduler_output import SchedulerOutput
from batchgen_data.core.sequence import Sequence

# `scheduler` below is a core.scheduler.Scheduler (not imported: it imports this module)


def to_encode(scheduler: Any, seq: Sequence, out: SchedulerOutput
              ) -> list[Any] | None:
    """The images of `seq` the step's encoder batch must add before its prefill (maybe
    none), or None when they do not fit what the batch has left."""
    cache, mm = scheduler.encoder_cache, seq.mm
    assert cache is not None and mm is not None
    batch = {it.hash for it in out.encode}
    new: list[Any] = []
    for i in mm.overlapping(seq.num_computed_tokens, mm.num_prompt_tokens):
        item = mm.items[i]
        if not cache.has(item.hash) and item.hash not in batch:
            new.append(item)
            batch.add(item.hash)
    cost = sum(it.num_tokens for it in new)
    if cost > scheduler.encoder_left and out.encode:
        return None
    return new


def hold(scheduler: Any, seq: Sequence, new: list[Any], out: SchedulerOutput) -> None:
    """`seq` was admitted: its new images join the step's batch and it holds all of its
    images in the cache until its prefill has read them."""
    cache, mm = scheduler.encoder_cache, seq.mm
    assert cache is not None and mm is not None
    fresh = {it.hash for it in new}
    for item in new:
        cache.reserve(item.hash)
        out.encode.append(item)
    scheduler.encoder_left -= sum(it.num_tokens for it in new)
    needed = mm.overlapping(seq.num_computed_tokens, mm.num_prompt_tokens)
    cache.hits += sum(1 for i in needed if mm.items[i].hash not in fresh)
    for item in mm.items:
        cache.acquire(item.hash)
    seq.mm_held = True
    scheduler.prefilling.append(seq)


def let_go(scheduler: Any, seq: Sequence) -> None:
    cache, mm = scheduler.encoder_cache, seq.mm
    assert cache is not None and mm is not None
    seq.mm_held = False
    for item in mm.items:
        cache.release(item.hash)
    if seq in scheduler.prefilling:
        scheduler.prefilling.remove(seq)


def prefilled(scheduler: Any) -> None:
    """Let go of the images of the prompts now computed past their last image."""
    for seq in list(scheduler.prefilling):
        mm = seq.mm
        assert mm is not None
        last = mm.offsets[-1] + mm.items[-1].num_tokens if mm.items else 0
        if seq.num_computed_tokens >= last:
            let_go(scheduler, seq)
