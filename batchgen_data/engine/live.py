"""An engine's live requests and the bookkeeping both a step and the primitives do on them.

`LiveWork` owns the requests (waiting, running or held for memory), those held by the user,
the sequence coroutines the scheduler may run (a suspended coroutine is its `Sequence`,
resumed a step at a time by `core/coroutine.resume_step`), and the outputs that finished
outside a step (an abort, a drained step) for the next `step()` to return. The stepper
(engine/stepper.py) and the engine's primitives (engine/engine.py) change them only through
its methods, so each rule — a retired sequence leaves the scheduler and the held-KV store, a
finished request's KV is pinned when it asks, a held sequence's KV is kept or dropped by
`decide_held_kv` — lives once.
"""
from __future__ import annotations

from batchgen_data.core.kv.held_kv import HeldKVStore, decide_held_kv
from batchgen_data.core.pins import PrefixPins
from batchgen_data.core.request import Request
from batchgen_data.core.scheduler import Scheduler, SchedulerOutput
from batchgen_data.core.sequence import Sequence, SequenceStatus
from batchgen_data.core.stop import StopChecker
from batchgen_data.engine.stats import EngineStats
from batchgen_data.engine.step_failure import reason
from batchgen_data.outputs import RequestOutput
from batchgen_data.reasoning.reader import OutputReader
from batchgen_data.worker.runner import Runner


class LiveWork:
    def __init__(self, scheduler: Scheduler, held_kv: HeldKVStore, pins: PrefixPins,
                 runner: Runner, stopper: StopChecker, stats: EngineStats,
                 reader: OutputReader | None = None) -> None:
        self.scheduler, self.held_kv, self.pins = scheduler, held_kv, pins
        self.reader = reader  # the reasoning and tool calls of each output apart
        self.runner, self.stopper, self.stats = runner, stopper, stats
        self.requests: dict[str, Request] = {}  # live: waiting, running or held for memory
        self.held: dict[str, Request] = {}  # held by the user: not scheduled until resumed
        self.seqs: dict[int, Sequence] = {}  # the schedulable sequence coroutines by seq_id
        self.outputs: list[RequestOutput] = []  # finished outside a step: the next step's
        scheduler.reclaim = self.reclaim_pins

    # ---- entering and leaving ---------------------------------------------------------------
    def add(self, req: Request, front: bool = False) -> None:
        """`req` live here, its unfinished sequences queued (ahead of the others: `front`)."""
        self.requests[req.request_id] = req
        for seq in req.unfinished():
            self.seqs[seq.seq_id] = seq
            self.scheduler.add(seq, front=front)

    def runs(self, seq: Sequence) -> bool:
        """Whether `seq` is still one of the schedulable sequences (not finished, aborted,
        failed or held by the user since it was scheduled)."""
        return seq.seq_id in self.seqs

    def take_outputs(self) -> list[RequestOutput]:
        """The outputs finished outside a step, once."""
        outs, self.outputs = self.outputs, []
        return outs

    def retire(self, *seqs: Sequence) -> None:
        """These sequences leave: out of the scheduler (their blocks freed) and the store."""
        self.scheduler.remove(*seqs)
        for seq in seqs:
            self.held_kv.drop(seq)
            del self.seqs[seq.seq_id]

    def finished(self, done: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests that `done` (sequences that just stopped) complete, in
        the order of `done`; a request submitted with `pin` keeps its KV under that key."""
        outs = []
        for rid in dict.fromkeys(s.request_id for s in done):
            req = self.requests.get(rid)
            if req is not None and req.finished:
                del self.requests[rid]
                self.stats.num_finished += 1
                if req.pin is not None:
                    for seq in req.seqs:
                        self.pins.pin(req.pin, seq.token_ids, seq.cache_root)
                outs.append(req.output(self.stopper, self.reader))
        return outs

    def fail(self, errors: dict[str, Exception]) -> list[RequestOutput]:
        """Finish these requests with finish_reason "error" and why as their stop_reason (a
        step failed for each of them alone: engine/step_failure.py); their KV is freed."""
        outs = []
        for rid, exc in errors.items():
            req = self.requests.pop(rid)
            why = reason(exc)
            for seq in req.unfinished():
                self.retire(seq)
                seq.status = SequenceStatus.FINISHED_ERROR
                seq.stop_reason = why
            self.stats.num_failed += 1
            outs.append(req.output(self.stopper, self.reader))
        return outs

    def abort(self, request_id: str) -> bool:
        """End a live or held request; its output comes with the next step. False if it is
        not here."""
        req = self.requests.pop(request_id, None) or self.held.pop(request_id, None)
        if req is None:
            return False
        for seq in req.unfinished():
            if self.runs(seq):
                self.retire(seq)
            else:
                self.held_kv.drop(seq)
            seq.status = SequenceStatus.FINISHED_ABORTED
        self.outputs.append(req.output(self.stopper, self.reader))
        return True

    # ---- holding ------------------------------------------------------------------------
    def move_kv(self, out: SchedulerOutput) -> None:
        """Copy out the KV of the sequences the schedule just held, then back in that of those
        it resumes: in that order, since new owners of the held ones' blocks write them."""
        for seq, blocks in out.swap_out:
            if decide_held_kv(seq, self.held_kv, keep=True):
                self.held_kv.put(seq, self.runner.read_kv(blocks, seq.num_computed_tokens))
        for seq in out.swap_in:
            self.runner.write_kv(seq.block_ids, self.held_kv.take(seq))

    def hold(self, request_id: str, keep_kv: bool) -> None:
        """Suspend a live request until `resume`: its KV blocks freed, its KV kept in host
        memory if `keep_kv` and it fits (`decide_held_kv`), else recomputed on resume."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not running in this engine")
        for seq in req.unfinished():
            on_device = seq.held_kv is None and bool(seq.block_ids)
            if decide_held_kv(seq, self.held_kv, keep_kv) and on_device:
                self.held_kv.put(seq, self.runner.read_kv(seq.block_ids,
                                                          seq.num_computed_tokens))
            self.scheduler.remove(seq)
            self.seqs.pop(seq.seq_id, None)
            seq.status = SequenceStatus.HELD
        del self.requests[request_id]
        self.held[request_id] = req

    def resume(self, request_id: str, front: bool = True) -> None:
        req = self.held.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not held")
        self.add(req, front=front)

    # ---- pins -----------------------------------------------------------------------------
    def reclaim_pins(self, need: int, asking: Sequence | None) -> int:
        """The scheduler is `need` blocks short: drop pins, least valuable first. A pin is worth
        more the nearer its program's next step is to running, so the order is the queue read
        from its back (held for memory, then waiting, is the order steps resume in); for a
        running sequence (`asking` None) then also programs between steps and, last, running
        ones (their step holds its own blocks, so their pins free little). A waiting sequence
        (`asking`) may only take pins from the steps queued behind it."""
        if not len(self.pins):
            return 0
        queued = [s.request_id for s in (*self.scheduler.held, *self.scheduler.waiting)]
        if asking is not None:
            queued = queued[queued.index(asking.request_id) + 1:] if asking.request_id in \
                queued else []
        keys = [self.requests[rid].pin for rid in reversed(queued) if rid in self.requests]
        if asking is None:
            active = {r.pin for r in self.requests.values()}
            running = {self.requests[s.request_id].pin for s in self.scheduler.running}
            keys += [k for k in self.pins.keys() if k not in active]
            keys += [k for k in self.pins.keys() if k in running]
        return self.pins.reclaim(need, [k for k in dict.fromkeys(keys) if k is not None])
