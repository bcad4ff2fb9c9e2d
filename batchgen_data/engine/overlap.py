"""Overlapped steps (`async_scheduling`): the device does not wait for the host between steps.

The model run and the sampling of step n go to a worker thread (on a GPU it launches them and
returns; on the CPU it computes). Meanwhile the engine thread schedules and prepares step n+1
as if step n had already given each of its sequences what it computes (`_look_ahead`) and
queues it behind step n on the worker. The worker launches a step without waiting for the
device, so step n+1 is on the device's queue before step n ends, its tokens from step n written
into its inputs on the device; meanwhile the engine thread waits for step n's tokens to reach
the host and resumes step n's coroutines, so their stop checks and the finished requests
overlap step n+1 too. docs/step.md says why every sequence still gets exactly the synchronous
engine's tokens, and when a step is not overlapped. Only a runner that says it `can_overlap`
(worker/runner.py) runs this way.
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

from batchgen_data.core.scheduler import SchedulerOutput
from batchgen_data.core.sequence import Sequence
from batchgen_data.engine.live import LiveWork
from batchgen_data.engine.stats import StepShape
from batchgen_data.engine.stepper import Step, Stepper
from batchgen_data.logprobs import RawLogprobs
from batchgen_data.outputs import RequestOutput
from batchgen_data.sample.sampler import PendingSample, Sampler, SamplerOutput
from batchgen_data.worker.device_mark import DeviceMark
from batchgen_data.worker.runner import Runner

if TYPE_CHECKING:
    from batchgen_data.sampling_params import SamplingParams

# the token id a sequence holds, during a look-ahead, for the token step n is still sampling
PLACEHOLDER = -1
SWITCH_INTERVAL_S = 1e-4  # sys.setswitchinterval while steps overlap (see OverlappedStepper)
_PARAMS = attrgetter("params")


@dataclass
class _Queued(Step):
    """A step handed to the device thread, and once started, its worker's future."""

    future: "Future[tuple[PendingSample | None, DeviceMark, float]] | None" = None
    # look-ahead steps: (rows of `inp.input_ids`, indices into the previous step's sampled
    # tokens) that `_fill_tokens` writes; built while the previous step runs
    fill: tuple[torch.Tensor, torch.Tensor] | None = None
    # the step it was queued behind on the device thread, until its tokens are filled in
    after: "_Queued | None" = None
    started: threading.Event = field(default_factory=threading.Event)  # by the device thread


def _reads_own_tokens(p: SamplingParams) -> bool:
    """Whether a sequence's sampling reads the tokens of its own previous steps (penalties,
    bad_words, a grammar) or its step writes prompt logprobs the next one reads."""
    return (p.repetition_penalty != 1 or bool(p.frequency_penalty) or bool(p.presence_penalty)
            or bool(p.bad_words) or p.structured_outputs is not None
            or p.prompt_logprobs is not None)


class OverlappedStepper(Stepper):
    def __init__(self, live: LiveWork, runner: Runner, sampler: Sampler, vocab_size: int,
                 device: torch.device) -> None:
        super().__init__(live, runner, sampler, vocab_size, device)
        # The device thread needs the GIL the moment its step ends (and, on a GPU, for every
        # launch) while the engine thread runs Python host work; at CPython's default 5 ms
        # switch interval it waits for the engine thread's whole look-ahead. 0.1 ms hands the
        # GIL over promptly (benchmarks/host_overhead.py, docs/step.md). Process-wide, and
        # only ever lowered.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._worker: ThreadPoolExecutor | None = None  # the device thread, on first use
        self._inflight: _Queued | None = None  # the step the worker runs
        self._last_done = 0.0  # when the device was last seen done with a step

    def step(self) -> list[RequestOutput]:
        finished = self.live.take_outputs()
        cur = self._inflight
        if cur is None:  # nothing in flight: schedule from the engine's state as it is
            out, shape = self._schedule()
            self.live.move_kv(out)
            if not out.seqs:
                return finished
            try:
                cur = self._start(self._prepared(out, shape))
            except Exception as exc:  # noqa: BLE001 - as in `Stepper.step`
                return finished + self._failed(out, exc)
        return finished + self._overlap(cur)

    def drain(self) -> None:
        cur, self._inflight = self._inflight, None
        if cur is not None:
            try:
                sampled, device_s = self._complete(cur)
            except Exception as exc:  # noqa: BLE001 - as in `Stepper.step`
                self.live.outputs.extend(self._failed(cur.out, exc))
                return
            self.live.outputs.extend(self._finish(cur, sampled, device_s))

    def close(self) -> None:
        self.drain()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None

    def _overlap(self, cur: _Queued) -> list[RequestOutput]:
        """Step n (`cur`, started) to its end while step n+1 is prepared and queued."""
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
                self.live.stats.overlapped_steps += 1
            if nxt is not None and not queued:
                # held KV comes back into its blocks only after step n's KV writes (a row of
                # step n may belong to a sequence that stopped and gave those blocks up):
                # queued on the device after them
                self._fill_tokens(nxt, cur, pending)
                self.live.move_kv(nxt.out)
                self._start(nxt)
            sampled, device_s = self._read(pending, mark, t_run)
        except Exception as exc:  # noqa: BLE001 - step n failed: drain, then isolate
            self._abandon(nxt)
            return self._failed(cur.out, exc)
        return self._finish(cur, sampled, device_s)

    def _kept(self, out: SchedulerOutput, sample_seqs: list[Sequence], token_ids: list[int],
              logprobs: list[RawLogprobs | None]
              ) -> tuple[SchedulerOutput, list[Sequence], list[int], list[RawLogprobs | None],
                         bool]:
        """Sequences that stopped at the step before were scheduled into this one before that
        was known: their rows here are dropped, tokens and all."""
        runs = self.live.runs
        if all(map(runs, out.seqs)):
            return out, sample_seqs, token_ids, logprobs, True
        rows = [(s, n) for s, n in zip(out.seqs, out.num_new_tokens) if runs(s)]
        out = SchedulerOutput([s for s, _ in rows], [n for _, n in rows])
        kept = [r for r in zip(sample_seqs, token_ids, logprobs) if runs(r[0])]
        return (out, [r[0] for r in kept], [r[1] for r in kept], [r[2] for r in kept], False)

    def _abandon(self, step: _Queued | None) -> None:
        """Let a step built on a failed one end on the device thread, and keep nothing of it:
        it was scheduled as if the failed step had given its tokens, which it never did."""
        self._inflight = None
        if step is not None and step.future is not None:
            wait([step.future])

    def _complete(self, step: _Queued) -> tuple[SamplerOutput | None, float]:
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
        return (self.sampler.finish(pending) if pending is not None else None), device_s

    def _prepared(self, out: SchedulerOutput, shape: StepShape) -> _Queued:
        t0 = time.perf_counter()
        inp = self.runner.prepare(out)
        return _Queued(out, inp, self.sampler.batch(inp.sample_seqs, self.vocab_size,
                                                    self.device), shape, t0)

    def _start(self, step: _Queued) -> _Queued:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="batchgen-device")
        step.future = self._worker.submit(self._device, step)
        self._inflight = step
        return step

    def _device(self, step: _Queued) -> tuple[PendingSample | None, DeviceMark, float]:
        """The worker's part: the model run and the sampling queued on the device, which read
        no sequence state but the parameters (the sampler's host half was built before), and
        the copy of the tokens to the host started. It returns without waiting for the
        device, so a step queued behind this one is launched while this one runs; the engine
        thread waits for the mark (`_read`)."""
        t0 = time.perf_counter()
        runner, inp = self.runner, step.inp
        try:
            if step.after is not None:  # queued behind the step before: its tokens are known
                assert step.after.future is not None and step.after.future.done()
                self._fill_tokens(step, step.after, step.after.future.result()[0])
                step.after = None
        finally:
            step.started.set()
        logits = runner.run(inp)
        pending = self.sampler.launch(logits, step.batch, inp.sample_seqs) \
            if inp.sample_seqs else None
        if pending is not None:
            pending.to_host()
        step.expert_tokens = runner.take_expert_tokens(on_device=True)
        return pending, runner.mark(), t0

    def _look_ahead(self, cur: _Queued) -> _Queued | None:
        """Step n+1 scheduled and prepared while step n (`cur`) runs, with each sequence of
        step n advanced by what step n computes and a `PLACEHOLDER` for the token it samples;
        None when step n+1 must wait for step n's tokens (docs/step.md)."""
        if any(map(_reads_own_tokens, {id(p): p for p in map(_PARAMS, cur.out.seqs)}.values())):
            return None
        sampling = {s.seq_id for s in cur.inp.sample_seqs}
        ahead = list(zip(cur.out.seqs, cur.out.num_new_tokens))
        for seq, n in ahead:
            seq.num_computed_tokens += n
            if seq.seq_id in sampling:
                seq.token_ids.append(PLACEHOLDER)
        try:
            if not self.scheduler.running_fits():  # it would preempt a sequence of step n
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

    def _fill_tokens(self, nxt: _Queued, cur: _Queued, pending: PendingSample | None) -> None:
        """Write the tokens step n sampled into step n+1's inputs, at the rows `_fill_plan`
        chose while step n ran: one gather and one scatter on the device, queued after step
        n's sampling, which no host read has to wait for."""
        if pending is None or nxt.fill is None:
            return
        rows, src = nxt.fill
        ids: Any = nxt.inp.input_ids  # type: ignore[attr-defined]  (a `can_overlap` runner's)
        ids[rows] = pending.chosen[src].to(ids.dtype)


def _fill_plan(nxt: _Queued, cur: _Queued) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where step n+1 (`nxt`) takes step n's (`cur`) sampled tokens: a sequence that samples at
    step n computes exactly that token at step n+1 (one token, the placeholder's row)."""
    src_of = {s.seq_id: j for j, s in enumerate(cur.inp.sample_seqs)}
    rows, src, row = [], [], 0
    seqs, counts = nxt.out.seqs, nxt.out.num_new_tokens
    order = nxt.inp.order
    assert order is not None, "a runner that can overlap lays its rows out in `order`"
    for i in order:
        j = src_of.get(seqs[i].seq_id)
        if j is not None:
            rows.append(row)
            src.append(j)
        row += counts[i]
    if not rows:
        return None
    dev = nxt.inp.input_ids.device  # type: ignore[attr-defined]
    return torch.tensor(rows, device=dev), torch.tensor(src, device=dev)
