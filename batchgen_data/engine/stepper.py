"""One engine step: schedule, prepare, run, sample, resume the coroutines.

`Stepper.step()` does those five things in that order; with `async_scheduling` the engine uses
`OverlappedStepper` (engine/overlap.py), which overlaps them across steps. The stepper reaches
the model through the runner Protocol (worker/runner.py) and the engine's requests through
`LiveWork` (engine/live.py): it owns no engine state of its own. A step that raises is handed
to engine/step_failure.py, which finds the requests it failed for.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from batchgen_data.core import coroutine
from batchgen_data.core.scheduler import SchedulerOutput
from batchgen_data.core.sequence import Sequence
from batchgen_data.engine.live import LiveWork
from batchgen_data.engine.stats import StepShape
from batchgen_data.engine.step_failure import blame
from batchgen_data.logprobs import RawLogprobs
from batchgen_data.outputs import RequestOutput
from batchgen_data.sample.sampler import Sampler, SamplerOutput
from batchgen_data.sample.sampling_batch import SamplingBatch
from batchgen_data.worker.runner import Runner, StepInput


@dataclass
class Step:
    """A scheduled and prepared step."""

    out: SchedulerOutput
    inp: StepInput
    batch: SamplingBatch | None  # the sampler's host half, when built before the run
    shape: StepShape
    t0: float  # when its preparation began
    # MoE: the step's tokens per expert, when taken before `finish` (an overlapped step's)
    expert_tokens: torch.Tensor | None = None


class Stepper:
    def __init__(self, live: LiveWork, runner: Runner, sampler: Sampler, vocab_size: int,
                 device: torch.device) -> None:
        self.live, self.runner, self.sampler = live, runner, sampler
        self.vocab_size, self.device = vocab_size, device
        self.scheduler = live.scheduler

    def step(self) -> list[RequestOutput]:
        live, runner, sampler = self.live, self.runner, self.sampler
        finished = live.take_outputs()
        out, shape = self._schedule()
        live.move_kv(out)
        if not out.seqs:
            return finished
        t0 = time.perf_counter()
        try:  # free until it raises (zero-cost try): then `_failed` finds whose step it was
            inp = runner.prepare(out)
            logits = runner.run(inp)
            seqs = inp.sample_seqs
            pending = sampler.launch(logits, sampler.batch(seqs, logits.shape[1], logits.device),
                                     seqs) if seqs else None
            runner.mark().wait()  # a step that samples nothing is timed to its end too
            sampled = sampler.finish(pending) if pending is not None else None
        except Exception as exc:  # noqa: BLE001 - sorted out by engine/step_failure.py
            return finished + self._failed(out, exc)
        return finished + self._finish(Step(out, inp, None, shape, t0), sampled, None)

    def drain(self) -> None:
        """Finish the step in flight, its outputs left for the next `step()`: what every
        primitive that touches sequences does first. A synchronous step is never in flight."""

    def close(self) -> None:
        """Stop what the stepper started (the overlapped one's device thread)."""

    def _failed(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """A step raised while it was prepared, run or sampled (nothing of it was kept): the
        requests it fails for finish with the reason, the others run on; `StepError` when none
        is to blame (engine/step_failure.py)."""
        live = [(s, n) for s, n in zip(out.seqs, out.num_new_tokens) if self.live.runs(s)]
        if not live:  # its sequences stopped at the step before (overlapped): nothing was lost
            return []
        return self.live.fail(blame(self.runner, self.sampler, live, exc))

    def _schedule(self) -> tuple[SchedulerOutput, StepShape]:
        scheduler, pins = self.scheduler, self.live.pins
        out = scheduler.schedule()
        if len(pins) and not out.seqs and scheduler.has_work():
            # nothing could run even after the scheduler reclaimed pins behind the queue's
            # head (those left belong to programs between steps): never stall on a pin
            pins.release_all()
            out = scheduler.schedule()
        return out, StepShape.of(out)  # its context, for the speed fit of the stats

    def _kept(self, out: SchedulerOutput, sample_seqs: list[Sequence], token_ids: list[int],
              logprobs: list[RawLogprobs | None]
              ) -> tuple[SchedulerOutput, list[Sequence], list[int], list[RawLogprobs | None],
                         bool]:
        """The step's rows whose sequences still run, and whether all of them do. Every one
        of a synchronous step does: nothing changes the sequences between its schedule and
        its end."""
        return out, sample_seqs, token_ids, logprobs, True

    def _finish(self, step: Step, sampled: SamplerOutput | None, device_s: float | None
                ) -> list[RequestOutput]:
        """Resume the step's coroutines with their results, publish its full blocks, retire
        the sequences that finished; the requests they complete, and the step's stats."""
        live, runner, scheduler, inp = self.live, self.runner, self.scheduler, step.inp
        # the rows the model ran, dropped ones too; an overlapped step's counts were taken on
        # the device thread right after its launch, before the next step's layers add to them
        counts = step.expert_tokens if step.expert_tokens is not None \
            else runner.take_expert_tokens()
        live.stats.tokens_per_expert.record(counts.cpu())
        for seq, entries in inp.prompt_logprobs or ():
            seq.prompt_logprobs.extend(entries)
        token_ids, logprobs = (sampled.token_ids, sampled.logprobs) if sampled is not None \
            else ([], [])
        out, sample_seqs, token_ids, logprobs, whole = self._kept(
            step.out, inp.sample_seqs, token_ids, logprobs)
        if not out.seqs:
            return []
        flat = inp.flat if whole else None  # the runner's arrays hold the dropped rows too
        done = coroutine.resume_step(out.seqs, out.num_new_tokens, sample_seqs, token_ids,
                                     logprobs, live.stopper)
        order = inp.order
        if len(done) > 1 and order is not None and order != sorted(order):  # scheduled order
            index = {s.seq_id: i for i, s in enumerate(out.seqs)}
            done.sort(key=lambda s: index[s.seq_id])
        scheduler.after_step(out, flat)
        live.retire(*done)
        finished = live.finished(done)
        own = runner.device_step_s()
        if own is not None:
            device_s = own
        elif device_s is None:  # synchronous: the step's wall time
            device_s = time.perf_counter() - step.t0
        stats = live.stats
        stats.record(len(out.seqs), out.total_tokens, len(sample_seqs), device_s,
                     light_seqs=max(1, scheduler.config.max_num_seqs // 2),
                     kv_tokens=step.shape.kv_tokens)
        stats.num_preemptions = scheduler.num_preemptions
        stats.offload_bytes_moved, stats.offload_peak_resident_bytes = runner.offload_counters()
        stats.kv_host_bytes_moved, stats.kv_host_seqs_peak = runner.kv_tier_counters()
        return finished
