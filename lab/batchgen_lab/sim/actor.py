"""One simulated engine: the real Scheduler, BlockPool and host tier, with a cost-model clock.

Every step starts with the real `Scheduler.schedule()` (admission, chunked prefill, preemption
under memory pressure, swap to the host tier); the model runner is replaced by the cost model and
sampling by "append a token; stop when the row's hidden output length is reached".

Running the scheduler once per decode step is too slow for 128 engines x 200k rows, so each
*span* is one real step followed by a planned run of pure decode steps during which the
scheduler would decide the same thing at every step (`decode_run.next_is_pure_decode`): all
running sequences decode one token, none can be preempted (enough free blocks for the whole run,
checked exactly), nobody can be admitted (queue empty, every seat taken, or the queue head does
not fit), and the run
stops at the step where the `cut`-th sequence finishes (`EngineShape.finishes_per_run`). The run's
time is summed exactly as the batch shrinks and the KV grows (`decode_run.py`). A span is cut
short at the next step boundary when work arrives or must leave (`interrupt`). The one
approximation: a seat freed by a finish inside a run is refilled when the run ends, at most
`finishes_per_run - 1` finishes later, instead of at the next step (`finishes_per_run` is
max_num_seqs // 16, at most `MAX_FINISHES_CAP`). A finish the cluster must act on at once (one
that completes a static input batch) always ends the span, also when it comes in the real step.

Token ids are never read (prefix caching is off), so sequences hold zero-filled `bytearray`s:
the real `Sequence` class, one byte per token instead of a list of ints.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from batchgen_data.config import SchedulerConfig
from batchgen_data.core import queue_report
from batchgen_data.core.kv.held_kv import decide_held_kv
from batchgen_data.core.scheduler import Scheduler, SchedulerOutput
from batchgen_data.core.sequence import Sequence, SequenceStatus
from batchgen_data.engine.stats import DecodeSpeed
from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.core.kv.held_kv import HeldKVStore
from batchgen_data.placement import EngineLoad, RequestSummary
from batchgen_data.sampling_params import SamplingParams
from batchgen_lab.sim.costmodel import CostModel
from batchgen_lab.sim.decode_run import ZEROS, DecodeRun, next_is_pure_decode


# default finishes_per_run at most this: at 1024 seats, max_num_seqs // 16 = 64 put (c) 1.2%
# above exact admission on 16 actors x 20k rows; 8 keeps it under 1% (see BENCHMARKS.md)
MAX_FINISHES_CAP = 8


class SimHostTier(HeldKVStore):
    """The real host tier's accounting; a sequence's "KV" is just its size in bytes."""

    def put(self, seq: Sequence, kv: int) -> None:  # type: ignore[override]
        assert seq.seq_id not in self._owners
        self._owners[seq.seq_id] = kv
        self.used_bytes += kv
        seq.held_kv = kv


@dataclass(frozen=True, slots=True)
class EngineShape:
    """Engine settings shared by every simulated actor.

    The class defaults (256 seats, 16384 batched tokens) are the simulator's generic shape; runs
    on a preset use `EngineShape.for_cost(cost)`, which takes the shape vLLM picks by default on
    the preset's device (`CostModel.max_num_seqs` / `max_num_batched_tokens`, see costmodel.py:
    1024 / 16384 on an H200, 256 / 8192 on an A100). The static mode does not depend on it: it
    keeps ray.data.llm's 32 x 8 = 256 rows in flight per actor whatever `max_num_seqs` is.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    block_size: int = 64  # coarser than vLLM's 16: 4x fewer pool operations, same decisions
    host_kv_bytes: int = 4 << 30
    # finishes one extrapolated decode run may span; None: max_num_seqs // 16, at most
    # MAX_FINISHES_CAP (see `finishes_per_run`)
    max_finishes: int | None = None

    def __post_init__(self) -> None:
        if self.max_finishes is not None and self.max_finishes < 1:
            raise ValueError(f"max_finishes={self.max_finishes!r}: must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs!r}: must be >= 1")

    @classmethod
    def for_cost(cls, cost: CostModel, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, **kwargs: Any) -> "EngineShape":
        """The preset's vLLM-default shape; arguments that are not None override it."""
        return cls(max_num_seqs if max_num_seqs is not None else cost.max_num_seqs,
                   max_num_batched_tokens if max_num_batched_tokens is not None
                   else cost.max_num_batched_tokens, **kwargs)

    @property
    def finishes_per_run(self) -> int:
        """Finishes one decode run may span: a freed seat waits at most this many minus one
        finishes for its refill. The default grows with the seats (max_num_seqs // 16) but is
        capped at MAX_FINISHES_CAP; see BENCHMARKS.md for the bias this cap keeps small."""
        return self.max_finishes or max(1, min(self.max_num_seqs // 16, MAX_FINISHES_CAP))


@dataclass(slots=True)
class Span:
    """One real step (ending at `t1`) and the decode run planned after it (ending at `end`)."""

    start: float
    t1: float
    end: float
    finished: list[tuple[int, float]]  # rows whose last token came in the real step
    run: DecodeRun | None
    steps: int  # decode-run steps to apply (lowered when the span is interrupted)
    version: int = 0


@dataclass
class SimActor:
    actor_id: int
    cost: CostModel
    shape: EngineShape
    busy_s: float = 0.0
    steps: int = 0
    spans: int = 0
    trace: list[tuple[float, int]] = field(default_factory=list)  # (time, running) on change
    # the fastest pure decode step with at most half the seats busy: `EngineLoad.decode_step_s`,
    # as `Engine.load` reports it
    min_decode_step_s: float = 0.0
    # the speed fitted from decode steps of any load, as `EngineStats.decode_step_s` reports
    # it: what the load report carries once it can fit (the floor before)
    speed: DecodeSpeed = field(default_factory=DecodeSpeed)

    def __post_init__(self) -> None:
        bs = self.shape.block_size
        self.pool = BlockPool(self.cost.kv_capacity_tokens // bs, bs, enable_prefix_caching=False)
        self.held_kv = SimHostTier(self.shape.host_kv_bytes, self.cost.bytes_per_token)
        cfg = SchedulerConfig(self.shape.max_num_seqs, self.shape.max_num_batched_tokens)
        self.sched = Scheduler(cfg, self.pool, self.held_kv)
        self.live: dict[int, Sequence] = {}  # seq_id (= row id) -> sequence on this actor
        self.target: dict[int, int] = {}  # seq_id -> output length at which the row stops

    # ---- rows in and out ----------------------------------------------------------------
    def add_row(self, row: int, input_len: int, output_len: int, params: SamplingParams) -> None:
        seq = Sequence(row, str(row), 0, ZEROS[:input_len], params, 0, params.max_tokens or 1,
                       token_ids=bytearray(input_len))
        self.receive(seq, output_len, kv_bytes=None, front=False)

    def receive(self, seq: Sequence, output_len: int, kv_bytes: int | None,
                front: bool = True) -> None:
        """Take a new or imported sequence; with `kv_bytes` its KV arrives through the host tier."""
        seq.status = SequenceStatus.WAITING
        if decide_held_kv(seq, self.held_kv, keep=kv_bytes is not None):
            assert kv_bytes is not None
            self.held_kv.put(seq, kv_bytes)
        self.live[seq.seq_id] = seq
        self.target[seq.seq_id] = output_len
        self.sched.add(seq, front=front)

    def export(self, row: int, ship_kv: bool) -> tuple[Sequence, int, int | None] | None:
        """Remove a live sequence: (sequence, output length, KV bytes if shipped), or None."""
        seq = self.live.pop(row, None)
        if seq is None:
            return None
        self.sched.remove(seq)
        self.held_kv.drop(seq)
        kv = seq.num_computed_tokens * self.cost.bytes_per_token if ship_kv else None
        if not kv:
            kv = None
            seq.num_computed_tokens = 0
        return seq, self.target.pop(row), kv

    def retire(self, seq: Sequence) -> None:
        """A sequence produced its last token: it leaves the actor."""
        self.sched.remove(seq)
        self.held_kv.drop(seq)
        seq.status = SequenceStatus.FINISHED_LENGTH
        del self.live[seq.seq_id]
        del self.target[seq.seq_id]

    # ---- reports for the placement policy -----------------------------------------------
    def has_work(self) -> bool:
        return self.sched.has_work()

    def running_seqs(self) -> list[Sequence]:
        """The sequences running now, in the scheduler's order (what a decode run steps)."""
        return list(self.sched.running)

    def grow_kv(self, seq: Sequence) -> None:
        """Give `seq` blocks for the tokens it has computed (the scheduler's growth rule)."""
        self.sched.grow(seq, 0)

    @property
    def num_preemptions(self) -> int:
        return self.sched.num_preemptions

    def load(self, now: float, span: Span | None) -> EngineLoad:
        """The report `Engine.load()` would give at `now`, in the middle of `span` if busy,
        with the fastest decode step so far. remaining_tokens_est and the prefill rate stay 0:
        the policy does not read them (the cluster prices KV moves with its cost model) and
        summing the estimate costs O(sequences)."""
        running = span.run.running_at(now) if span and span.run else None
        return replace(queue_report.load(self.sched, self.actor_id, running),
                       decode_step_s=self.speed.step_s() or self.min_decode_step_s)

    def summaries(self, max_running: int) -> list[RequestSummary]:
        """What `Engine.movable(max_running)` gives: waiting (queue order), held, and the
        `max_running` oldest running sequences."""
        return queue_report.movable(self.sched, max_running)

    # ---- time ---------------------------------------------------------------------------
    def step(self, now: float) -> tuple[float, list[int]] | None:
        """One real engine step starting at `now`: its end time and the rows that finished in
        it (retired already); None when there is no work."""
        sched = self.sched
        out = sched.schedule()
        if not out.seqs:
            if sched.has_work():
                raise RuntimeError(f"actor {self.actor_id}: work queued but nothing schedulable")
            self.trace.append((now, 0))
            return None
        kv = 0
        done: list[Sequence] = []
        target = self.target
        for q, n in zip(out.seqs, out.num_new_tokens):
            kv += q.num_computed_tokens + n  # context this step attends over
            q.num_computed_tokens += n
            if q.num_computed_tokens == len(q.token_ids):  # a token is sampled
                q.token_ids.append(0)
                if len(q.token_ids) - len(q.prompt_token_ids) >= target[q.seq_id]:
                    done.append(q)
        dt = self.cost.step_time(out.total_tokens, kv, len(out.seqs))
        if out.total_tokens == len(out.seqs):  # one token per sequence: a pure decode step
            self._note_decode_step(len(out.seqs), dt, kv)
        t = now + dt
        t += self._move_kv(out) / self.cost.pcie_bytes_per_s
        self.trace.append((now, len(out.seqs)))
        for q in done:
            self.retire(q)
        return t, [q.seq_id for q in done]

    def start_span(self, now: float, cut: Callable[[list[int]], int]) -> Span | None:
        """Run one real step and plan the decode run after it; None when there is no work.

        `cut(rows)` gets the next rows to finish, in finish order, and returns how many of them
        the run may include: the cluster ends runs where a finish must be acted on. Rows that
        finish in the real step are put in front of the list, so a finish there that must be
        acted on (it completes a static input batch) ends the span right after the real step.
        """
        stepped = self.step(now)
        if stepped is None:
            return None
        t, done = stepped
        finished = [(row, t) for row in done]
        if done:
            outer = cut

            def cut(rows: list[int]) -> int:
                return outer(done + rows) - len(done)
        run = DecodeRun(self, t, cut) if next_is_pure_decode(self.sched) else None
        if run is not None and run.k == 0:
            run = None
        end = t + run.duration if run is not None else t
        return Span(now, t, end, finished, run, run.k if run is not None else 0)

    def interrupt(self, span: Span, now: float) -> bool:
        """End the span at the first step boundary at or after `now`; True if it moved."""
        if span.run is None or now >= span.end:
            return False
        m = 0 if now <= span.t1 else span.run.steps_by(now)
        if m >= span.steps:
            return False
        span.steps = m
        span.end = span.t1 + span.run.time_at(m)
        span.version += 1
        return True

    def end_span(self, span: Span) -> list[tuple[int, float]]:
        """Apply the span's decode run up to its (possibly interrupted) end; rows finished."""
        finished = span.finished
        if span.run is not None and span.steps > 0:
            n = len(span.run.seqs)  # the run's first step decodes them all
            self._note_decode_step(n, self.cost.step_time(n, span.run.total, n), span.run.total)
            span.run.commit(span.steps, finished)
        self.busy_s += span.end - span.start
        self.steps += 1 + span.steps
        self.spans += 1
        return finished

    def _note_decode_step(self, num_seqs: int, dt: float, kv_tokens: int) -> None:
        self.speed.record(num_seqs, kv_tokens, dt)
        if num_seqs > max(1, self.shape.max_num_seqs // 2):
            return  # a full engine's step time says more about its load than its device
        if not self.min_decode_step_s or dt < self.min_decode_step_s:
            self.min_decode_step_s = dt

    def _move_kv(self, out: SchedulerOutput) -> int:
        """What `Engine._move_kv` does, with byte counts for KV: returns bytes over PCIe."""
        moved = 0
        for seq, _blocks in out.swap_out:
            if decide_held_kv(seq, self.held_kv, keep=True):
                nbytes = seq.num_computed_tokens * self.cost.bytes_per_token
                self.held_kv.put(seq, nbytes)
                moved += nbytes
        for seq in out.swap_in:
            moved += self.held_kv.take(seq)
        return moved
