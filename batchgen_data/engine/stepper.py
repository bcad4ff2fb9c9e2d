"""One engine step — schedule, prepare, run, sample, resume the coroutines — and, with
`async_scheduling`, the same steps overlapped so that the device does not wait for the host.

Synchronous (the default): each `step()` does those five things in that order.

Overlapped: the model run and the sampling of step n go to a worker thread (on a GPU it
launches them and returns; on the CPU it computes). Meanwhile the engine thread schedules and
prepares step n+1 as if step n had already given each of its sequences what it computes
(`_look_ahead`) and queues it behind step n on the worker. The worker launches a step without
waiting for the device, so step n+1 is on the device's queue before step n ends, its tokens
from step n written into its inputs on the device; meanwhile the engine thread waits for step
n's tokens to reach the host and resumes step n's coroutines, so their stop checks and the
finished requests overlap step n+1 too. docs/step.md says why every sequence still gets exactly the
synchronous engine's tokens, and when a step is not overlapped.
"""
from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import torch

from batchgen_data.core import coroutine
from batchgen_data.worker.device_mark import DONE, DeviceMark
from batchgen_data.worker.model_input import ModelInput
from batchgen_data.worker.model_runner import ModelRunner
from batchgen_data.sample.sampler import PendingSample, SamplerOutput
from batchgen_data.sample.sampling_batch import SamplingBatch
from batchgen_data.core.scheduler import SchedulerOutput
from batchgen_data.engine.stats import StepShape
from batchgen_data.engine.step_failure import blame

if TYPE_CHECKING:
    from batchgen_data.engine.engine import Engine
    from batchgen_data.outputs import RequestOutput
    from batchgen_data.sampling_params import SamplingParams

# the token id a sequence holds, during a look-ahead, for the token step n is still sampling
PLACEHOLDER = -1
SWITCH_INTERVAL_S = 1e-4  # sys.setswitchinterval while steps overlap (see Stepper)
_PARAMS = attrgetter("params")
_SEQ_ID = attrgetter("seq_id")


@dataclass
class _Step:
    """A scheduled and prepared step, and once started, its worker's future."""

    out: SchedulerOutput
    inp: ModelInput
    batch: SamplingBatch | None  # the sampler's host half, built on the engine thread
    shape: StepShape
    t0: float  # when its preparation began
    future: "Future[tuple[PendingSample | None, DeviceMark, float]] | None" = None
    # look-ahead steps: (rows of `inp.input_ids`, indices into the previous step's sampled
    # tokens) that `_fill_tokens` writes; built while the previous step runs
    fill: tuple[torch.Tensor, torch.Tensor] | None = None
    # the step it was queued behind on the device thread, until its tokens are filled in
    after: "_Step | None" = None
    started: threading.Event = field(default_factory=threading.Event)  # by the device thread
    expert_tokens: torch.Tensor | None = None  # MoE: the step's counts (overlapped steps)


def _reads_own_tokens(p: SamplingParams) -> bool:
    """Whether a sequence's sampling reads the tokens of its own previous steps (penalties,
    bad_words, a grammar) or its step writes prompt logprobs the next one reads."""
    return (p.repetition_penalty != 1 or bool(p.frequency_penalty) or bool(p.presence_penalty)
            or bool(p.bad_words) or p.structured_outputs is not None
            or p.prompt_logprobs is not None)


class Stepper:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.overlap = engine.config.async_scheduling
        if self.overlap:
            runner = engine.runner
            if type(runner) is not ModelRunner or runner.lora is not None \
                    or runner.kv_tier is not None:
                raise ValueError("async_scheduling=True runs with the model's own runner only: "
                                 "not with enable_lora, a KV host tier, tensor parallelism or "
                                 "an injected runner yet (docs/step.md)")
            # The device thread needs the GIL the moment its step ends (and, on a GPU, for every
            # launch) while the engine thread runs Python host work; at CPython's default 5 ms
            # switch interval it waits for the engine thread's whole look-ahead. 0.1 ms hands the
            # GIL over promptly (benchmarks/host_overhead.py, docs/step.md). Process-wide, and
            # only ever lowered.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._worker: ThreadPoolExecutor | None = None  # the device thread, on first use
        self._inflight: _Step | None = None  # overlapped: the step the worker runs
        self._last_done = 0.0  # when the device was last seen done with a step

    def step(self) -> list[RequestOutput]:
        e = self.engine
        finished, e._pending_out = e._pending_out, []
        if self.overlap:
            return finished + self._step_overlapped()
        out, shape = self._schedule()
        e._move_kv(out)
        if not out.seqs:
            return finished
        t0 = time.perf_counter()
        try:  # free until it raises (zero-cost try): then `_failed` finds whose step it was
            inp = e.runner.prepare(out)
            logits = e.runner.run(inp)
            seqs = inp.sample_seqs
            pending = e.sampler.launch(
                logits, e.sampler.batch(seqs, logits.shape[1], logits.device), seqs) \
                if seqs else None
            _mark(e.runner).wait()  # a step that samples nothing is timed to its end too
            sampled = e.sampler.finish(pending) if pending is not None else None
        except Exception as exc:  # noqa: BLE001 - sorted out by engine/step_failure.py
            return finished + self._failed(out, exc)
        return finished + self._finish(_Step(out, inp, None, shape, t0), sampled, None)

    def drain(self) -> None:
        """Finish the step in flight, if any (its outputs wait in the engine for `step()`):
        what every primitive that touches sequences does first."""
        cur, self._inflight = self._inflight, None
        if cur is not None:
            try:
                sampled, device_s = self._complete(cur)
            except Exception as exc:  # noqa: BLE001 - as in `step`
                self.engine._pending_out.extend(self._failed(cur.out, exc))
                return
            self.engine._pending_out.extend(self._finish(cur, sampled, device_s))

    def _failed(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """A step raised while it was prepared, run or sampled (nothing of it was kept): the
        requests it fails for finish with the reason, the others run on; `StepError` when none
        is to blame (engine/step_failure.py)."""
        e = self.engine
        live = [(s, n) for s, n in zip(out.seqs, out.num_new_tokens) if s.seq_id in e._coros]
        if not live:  # its sequences stopped at the step before (overlapped): nothing was lost
            return []
        return e._fail(blame(e.runner, e.sampler, live, exc))

    # ---- the parts of a step ---------------------------------------------------------------
    def _schedule(self) -> tuple[SchedulerOutput, StepShape]:
        e = self.engine
        out = e.scheduler.schedule()
        if len(e.pins) and not out.seqs and e.scheduler.has_work():
            # nothing could run even after the scheduler reclaimed pins behind the queue's
            # head (those left belong to programs between steps): never stall on a pin
            e.pins.release_all()
            out = e.scheduler.schedule()
        # what the step asks of the model: for `on_step`, and its context for the speed fit
        shape = StepShape.of(out)
        if e.on_step is not None:
            e.on_step(shape)
        return out, shape

    def _finish(self, step: _Step, sampled: SamplerOutput | None, device_s: float | None
                ) -> list[RequestOutput]:
        """Resume the step's coroutines with their results, publish its full blocks, retire
        the sequences that finished; the requests they complete, and the step's stats."""
        e, out, inp = self.engine, step.out, step.inp
        # the rows the model ran, dropped ones too; an overlapped step's counts were taken on
        # the device thread right after its launch, before the next step's layers add to them
        counts = step.expert_tokens if step.expert_tokens is not None \
            else e.runner.take_expert_tokens()
        e.stats.tokens_per_expert.record(counts.cpu())
        for seq, entries in inp.prompt_logprobs or ():
            seq.prompt_logprobs.extend(entries)
        sample_seqs = inp.sample_seqs
        token_ids, logprobs = (sampled.token_ids, sampled.logprobs) if sampled is not None \
            else ((), ())
        coros = e._coros
        flat = getattr(inp, "flat", None)  # an injected runner's input may not have these
        order = getattr(inp, "order", None)
        if self.overlap and not all(s.seq_id in coros for s in out.seqs):
            # sequences that stopped at the step before were scheduled into this one before
            # that was known: their rows here are dropped, tokens and all
            live = [(s, n) for s, n in zip(out.seqs, out.num_new_tokens) if s.seq_id in coros]
            out = SchedulerOutput([s for s, _ in live], [n for _, n in live])
            kept = [r for r in zip(sample_seqs, token_ids, logprobs) if r[0].seq_id in coros]
            sample_seqs = [r[0] for r in kept]
            token_ids, logprobs = [r[1] for r in kept], [r[2] for r in kept]
            flat = None
            if not out.seqs:
                return []
        done = coroutine.resume_step(out.seqs, out.num_new_tokens, sample_seqs, token_ids,
                                     logprobs, e.stopper)
        if len(done) > 1 and order is not None and order != sorted(order):  # scheduled order
            index = {s.seq_id: i for i, s in enumerate(out.seqs)}
            done.sort(key=lambda s: index[s.seq_id])
        e.scheduler.after_step(out, flat)
        e._retire(*done)
        finished = e._collect_finished(done)
        own = e.runner.device_step_s()
        if own is not None:
            device_s = own
        elif device_s is None:  # synchronous: the step's wall time
            device_s = time.perf_counter() - step.t0
        stats = e.stats
        stats.record(len(out.seqs), out.total_tokens, len(sample_seqs), device_s,
                     light_seqs=max(1, e.scheduler.config.max_num_seqs // 2),
                     kv_tokens=step.shape.kv_tokens)
        stats.num_preemptions = e.scheduler.num_preemptions
        stats.offload_bytes_moved, stats.offload_peak_resident_bytes = e.runner.offload_counters()
        stats.kv_host_bytes_moved, stats.kv_host_seqs_peak = e.runner.kv_tier_counters()
        return finished

    # ---- overlapped ------------------------------------------------------------------------
    def _step_overlapped(self) -> list[RequestOutput]:
        e = self.engine
        cur = self._inflight
        if cur is None:  # nothing in flight: schedule from the engine's state as it is
            out, shape = self._schedule()
            e._move_kv(out)
            if not out.seqs:
                return []
            try:
                cur = self._start(self._prepared(out, shape))
            except Exception as exc:  # noqa: BLE001 - as in `step`
                return self._failed(out, exc)
        nxt = self._look_ahead(cur)  # step n+1, while step n runs
        queued = nxt is not None and not nxt.out.swap_in
        if queued:
            # queued behind step n on the device thread, which writes step n's tokens into it
            # and starts it the moment step n ends: the device never waits for this thread
            nxt.after = cur
            self._start(nxt)
        assert cur.future is not None
        self._inflight = nxt if queued else None
        try:
            pending, mark, t_run = cur.future.result()  # step n queued on the device
            if queued:
                # the device thread needs the GIL between the two steps (the fill, the
                # launch); resuming step n's coroutines now would make it wait for this thread
                # at every switch interval, so this thread waits those microseconds instead
                nxt.started.wait()
            if nxt is not None:
                e.stats.overlapped_steps += 1
            if nxt is not None and not queued:
                # held KV comes back into its blocks only after step n's KV writes (a row of
                # step n may belong to a sequence that stopped and gave those blocks up):
                # queued on the device after them
                self._fill_tokens(nxt, cur, pending)
                e._move_kv(nxt.out)
                self._start(nxt)
            sampled, device_s = self._read(pending, mark, t_run)
        except Exception as exc:  # noqa: BLE001 - step n failed: drain, then isolate
            self._abandon(nxt)
            return self._failed(cur.out, exc)
        return self._finish(cur, sampled, device_s)

    def _abandon(self, step: _Step | None) -> None:
        """Let a step built on a failed one end on the device thread, and keep nothing of it:
        it was scheduled as if the failed step had given its tokens, which it never did."""
        self._inflight = None
        if step is not None and step.future is not None:
            wait([step.future])

    def _complete(self, step: _Step) -> tuple[SamplerOutput | None, float]:
        """Wait for a started step's results on the host (`drain`)."""
        assert step.future is not None
        return self._read(*step.future.result())

    def _read(self, pending: PendingSample | None, mark: DeviceMark, t_run: float
              ) -> tuple[SamplerOutput | None, float]:
        """A step's tokens on the host once the device has done it, and its device time: from
        its start, or the end of the step before when the device was still busy with that."""
        mark.wait()
        done = time.perf_counter()
        device_s = done - max(t_run, self._last_done)
        self._last_done = done
        return (self.engine.sampler.finish(pending) if pending is not None else None), device_s

    def _prepared(self, out: SchedulerOutput, shape: StepShape) -> _Step:
        e = self.engine
        t0 = time.perf_counter()
        inp = e.runner.prepare(out)
        return _Step(out, inp, e.sampler.batch(inp.sample_seqs, e.vocab_size, e.device),
                     shape, t0)

    def _start(self, step: _Step) -> _Step:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="batchgen-device")
        step.future = self._worker.submit(self._device, step)
        self._inflight = step
        return step

    def _device(self, step: _Step) -> tuple[PendingSample | None, DeviceMark, float]:
        """The worker's part: the model run and the sampling queued on the device, which read
        no sequence state but the parameters (the sampler's host half was built before), and
        the copy of the tokens to the host started. It returns without waiting for the
        device, so a step queued behind this one is launched while this one runs; the engine
        thread waits for the mark (`_read`)."""
        t0 = time.perf_counter()
        e, inp = self.engine, step.inp
        try:
            if step.after is not None:  # queued behind the step before: its tokens are known
                assert step.after.future is not None and step.after.future.done()
                self._fill_tokens(step, step.after, step.after.future.result()[0])
                step.after = None
        finally:
            step.started.set()
        logits = e.runner.run(inp)
        pending = e.sampler.launch(logits, step.batch, inp.sample_seqs) \
            if inp.sample_seqs else None
        if pending is not None:
            pending.to_host()
        step.expert_tokens = e.runner.take_expert_tokens(on_device=True)
        return pending, _mark(e.runner), t0

    def _look_ahead(self, cur: _Step) -> _Step | None:
        """Step n+1 scheduled and prepared while step n (`cur`) runs, with each sequence of
        step n advanced by what step n computes and a `PLACEHOLDER` for the token it samples;
        None when step n+1 must wait for step n's tokens (docs/step.md)."""
        e = self.engine
        if any(map(_reads_own_tokens, {id(p): p for p in map(_PARAMS, cur.out.seqs)}.values())):
            return None
        sampling = {s.seq_id for s in cur.inp.sample_seqs}
        ahead = list(zip(cur.out.seqs, cur.out.num_new_tokens))
        for seq, n in ahead:
            seq.num_computed_tokens += n
            if seq.seq_id in sampling:
                seq.token_ids.append(PLACEHOLDER)
        try:
            if not e.scheduler.running_fits():  # it would preempt a sequence of step n
                return None
            out, shape = self._schedule()
            if not out.seqs:
                return None
            assert not out.swap_out and not out.held, "a look-ahead preempted"
            try:
                nxt = self._prepared(out, shape)
            except Exception:  # noqa: BLE001 - prepared again, and sorted out, when it runs
                return None
            nxt.fill = _fill_plan(nxt, cur)
            return nxt
        finally:
            for seq, n in ahead:
                seq.num_computed_tokens -= n
                if seq.seq_id in sampling:
                    assert seq.token_ids[-1] == PLACEHOLDER
                    seq.token_ids.pop()

    def _fill_tokens(self, nxt: _Step, cur: _Step, pending: PendingSample | None) -> None:
        """Write the tokens step n sampled into step n+1's inputs, at the rows `_fill_plan`
        chose while step n ran: one gather and one scatter on the device, queued after step
        n's sampling, which no host read has to wait for."""
        if pending is None or nxt.fill is None:
            return
        rows, src = nxt.fill
        ids = nxt.inp.input_ids
        ids[rows] = pending.chosen[src].to(ids.dtype)


def _mark(runner: Any) -> DeviceMark:
    """The runner's device mark; an injected runner without one computes in `run`."""
    mark = getattr(runner, "mark", None)
    return DONE if mark is None else mark()


def _fill_plan(nxt: _Step, cur: _Step) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where step n+1 (`nxt`) takes step n's (`cur`) sampled tokens: a sequence that samples at
    step n computes exactly that token at step n+1 (one token, the placeholder's row)."""
    src_of = {s.seq_id: j for j, s in enumerate(cur.inp.sample_seqs)}
    rows, src, row = [], [], 0
    seqs, counts = nxt.out.seqs, nxt.out.num_new_tokens
    for i in nxt.inp.order:
        j = src_of.get(seqs[i].seq_id)
        if j is not None:
            rows.append(row)
            src.append(j)
        row += counts[i]
    if not rows:
        return None
    dev = nxt.inp.input_ids.device
    return torch.tensor(rows, device=dev), torch.tensor(src, device=dev)
