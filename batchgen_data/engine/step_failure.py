"""A step that raised: the requests it failed for, found by running parts of it again.

A step changes no sequence before it has all its tokens (`Stepper._finish` resumes the
coroutines), so a step that raised while it was prepared, run or sampled left every sequence
as the scheduler handed it over: the KV it wrote lies past each sequence's computed tokens and
is written again when the sequence next runs, and the blocks it was given stay its own. Nothing
needs undoing, and the step's requests can be run again in parts — *probes*: prepare, run,
sample, keep nothing — to find those it fails for:

* bisection over the step's requests (a request's samples stay together): a part that runs
  clears its requests, a part that fails is split again, down to single requests;
* a request is blamed only against a control: some probe of the search ran, so the device and
  the model work and the failure follows the request. When no probe ran (a step of one request,
  or a device that is gone) the control is the first failing request run with neutral sampling
  values (greedy, no logprobs): if that runs, the request's own values are at fault;
* no control, a failure that no part reproduces (each runs on its own), or more probes than
  the budget: the failure is the engine's. `StepError` says so, naming as `suspects` the
  requests that may have caused it (none for a failure no part reproduces), for the
  connectors' poison-row record (docs/row-errors.md).

A blamed request finishes with vLLM's `finish_reason="error"` and the reason as its
`stop_reason` (`request_error` reads it back); the other requests run on as if the step had
not happened, so their tokens are those of a run without the blamed ones. Nothing here runs
until a step raises; then about 2 log2(R) probes per blamed request of a step of R requests.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from batchgen_data.core.scheduler import SchedulerOutput
from batchgen_data.core.errors import EngineDeadError, StepError
from batchgen_data.core.sequence import Sequence
from batchgen_data.outputs import RequestOutput
from batchgen_data.sample.sampler import Sampler
from batchgen_data.sampling_params import SamplingParams
from batchgen_data.worker.runner import Runner

log = logging.getLogger(__name__)
Part = list[tuple[Sequence, int]]  # (sequence, tokens the step computes for it)
REASON_CHARS = 500  # a reason names the error; a traceback would not fit a row's column


def reason(exc: BaseException) -> str:
    """A blamed request's `stop_reason`: what it failed with."""
    text = f"{type(exc).__name__}: {exc}"
    if len(text) > REASON_CHARS:
        text = text[:REASON_CHARS - 3] + "..."
    return f"the engine step failed for this request alone ({text})"


def request_error(out: RequestOutput | Any) -> str | None:
    """Why the engine failed `out`'s request (a sample with finish_reason "error"), or None;
    None for a pooling output too (one result, no samples: it has no such failure)."""
    samples = out.outputs
    if not isinstance(samples, list):
        return None
    for c in samples:
        if c.finish_reason == "error":
            return str(c.stop_reason)
    return None


class Prober:
    """Runs a part of a step and keeps nothing: the exception it raised, or None."""

    def __init__(self, runner: Runner, sampler: Sampler, budget: int) -> None:
        self.runner, self.sampler, self.budget = runner, sampler, budget
        self.used = 0

    def __call__(self, part: Part) -> Exception | None:
        self.used += 1
        runner = self.runner
        try:
            inp = runner.prepare(SchedulerOutput([s for s, _ in part], [n for _, n in part]))
            logits = runner.run(inp)
            seqs = inp.sample_seqs
            pending = self.sampler.launch(
                logits, self.sampler.batch(seqs, logits.shape[1], logits.device), seqs) \
                if seqs else None
            runner.mark().wait()
            if pending is not None:
                self.sampler.finish(pending)
        except EngineDeadError:  # the engine says it is gone (a rank): nothing to search
            raise
        except Exception as e:  # noqa: BLE001 - what the probe is for
            return e
        finally:
            runner.take_expert_tokens()  # a probe's routing is no step's
        return None


def blame(runner: Runner, sampler: Sampler, part: Part, error: Exception
          ) -> dict[str, Exception]:
    """The requests of a failed step (`part`, which raised `error`) that fail on their own,
    each with the exception it raised alone; raises `StepError` when none can be blamed."""
    if isinstance(error, EngineDeadError):
        raise error
    groups: dict[str, Part] = {}
    for seq, n in part:
        groups.setdefault(seq.request_id, []).append((seq, n))
    rids = list(groups)
    probe = Prober(runner, sampler, budget=8 * (len(rids).bit_length() + 1))

    def run(ids: list[str]) -> Exception | None:
        return probe([x for rid in ids for x in groups[rid]])

    failing: dict[str, Exception] = {}
    ran = False
    todo: list[tuple[list[str], Exception | None]] = [(rids, None)]
    while todo:
        ids, err = todo.pop()
        if len(ids) == 1 and err is not None:
            failing[ids[0]] = err
            continue
        if probe.used + 2 > probe.budget:
            raise _engine_failure(error, "more parts failed than one search tries", rids)
        halves = [ids] if len(ids) == 1 else [ids[:len(ids) // 2], ids[len(ids) // 2:]]
        errs = [run(h) for h in halves]
        ran = ran or any(e is None for e in errs)
        if all(e is None for e in errs):  # every part runs on its own: no request's fault
            raise _engine_failure(error, "its parts run on their own", ())
        todo.extend((h, e) for h, e in zip(halves, errs) if e is not None)
    if not ran:
        first = next(iter(failing))
        ran = probe(_neutral(groups[first])) is None
    if not ran:
        raise _engine_failure(error, "nothing runs, not even with neutral sampling values",
                              rids)
    log.warning("batchgen: a step failed (%s: %s); its request(s) %s fail alone, the other %d "
                "go on", type(error).__name__, error, sorted(failing), len(rids) - len(failing))
    return failing


def _neutral(part: Part) -> Part:
    """The same sequences, greedy and reporting nothing: what every request can run with."""
    params = SamplingParams(temperature=0.0, max_tokens=None)
    return [(dataclasses.replace(s, params=params, logprobs=None, prompt_logprobs=None), n)
            for s, n in part]


def _engine_failure(error: Exception, why: str, suspects: Any) -> StepError:
    err = StepError(f"a step failed and no single request is at fault ({why}): "
                    f"{type(error).__name__}: {error}", tuple(suspects))
    err.__cause__ = error
    return err
