"""What one engine's queues look like to a placement policy (`batchgen_data.placement`): its
load report and the sequences another engine could take over, read off the scheduler's queues
and block pool. `Engine.load` / `Engine.movable` add what only the engine knows; the lab's
simulator asks the same of its own scheduler."""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Container

from batchgen_data.core.scheduler import Scheduler
from batchgen_data.core.sequence import Sequence
from batchgen_data.placement import EngineId, EngineLoad, RequestSummary
from batchgen_data.placement.prefix import prefix_keys


def load(sched: Scheduler, engine_id: EngineId, running: int | None = None) -> EngineLoad:
    """Queues and blocks as a load report; `running` overrides the count (the simulator's
    mid-run value)."""
    pool = sched.pool
    return EngineLoad(engine_id, len(sched.waiting),
                      len(sched.running) if running is None else running, len(sched.held), 0,
                      pool.num_free, pool.num_blocks, sched.config.max_num_seqs,
                      pool.block_size, free_host_blocks=pool.num_free_host,
                      host_blocks=pool.num_host_blocks)


def movable(sched: Scheduler, max_running: int | None = None,
            exclude: Container[str] = ()) -> list[RequestSummary]:
    """Sequences another engine could take over: waiting ones in queue order, the held ones,
    then the `max_running` (None: all) running ones that have generated most, oldest first.
    Sequences of requests in `exclude` are left out."""
    # prefix keys only where a prefix cache could serve them (placement by prefix)
    bs = sched.pool.block_size if sched.pool.enable_prefix_caching else 0

    def summ(seqs: list[Sequence], kind: str) -> list[RequestSummary]:
        return [RequestSummary(s.request_id, kind, s.num_tokens, s.num_output_tokens,
                               s.num_computed_tokens,
                               _prefix_of(s, bs) if kind == "waiting" and bs else ())
                for s in seqs]

    def keep(seqs: deque[Sequence] | list[Sequence]) -> list[Sequence]:
        return [s for s in seqs if s.request_id not in exclude] if exclude else list(seqs)

    running = keep(sched.running)
    # nlargest is stable: among equal ages the order of `running` is kept
    oldest = heapq.nlargest(len(running) if max_running is None else max_running, running,
                            key=lambda s: s.num_output_tokens)
    return (summ(keep(sched.waiting), "waiting") + summ(keep(sched.held), "held")
            + summ(oldest, "running"))


def _prefix_of(seq: Sequence, block_size: int) -> tuple[int, ...]:
    """A waiting sequence's prompt prefix keys, kept on it after the first ask; () under an
    adapter, whose KV no other request's prefix matches."""
    if seq.lora is not None:
        return ()
    if seq.prefix_keys is None:
        seq.prefix_keys = prefix_keys(seq.prompt_token_ids, block_size)
    return seq.prefix_keys
