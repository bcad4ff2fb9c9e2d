"""`ProgramRunner`: many rows' programs over one `Engine`, in the caller's thread.

Every program's pending step is in the engine at once, so the steps of all programs share each
batch; when a step finishes its program resumes at once and its next step joins the queue, so a
program that loops longer never holds up the others. Each program pins its KV prefix under its
own key between steps (`Engine.submit(pin=)`) and releases it when it ends. `LLM.run` is this
runner driven to the end; tests and the benchmark also use `export`/`import_` to move a program
to another engine mid-flight.
"""
from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterable
from typing import Any

from batchgen_data.engine.engine import Engine
from batchgen_data.programs.api import GenerateResult, Program
from batchgen_data.programs.run import ProgramError, ProgramRun
from batchgen_data.programs.steps import StepRequest, render, result_of
from batchgen_data.sampling_params import SamplingParams


class ProgramRunner:
    def __init__(self, engine: Engine, program: Program,
                 defaults: SamplingParams | None = None, on_error: str = "row") -> None:
        if on_error not in ("row", "raise"):
            raise ValueError(f"on_error={on_error!r}: use 'row' or 'raise'")
        self.engine = engine
        self.program = program
        self.defaults = defaults or SamplingParams()
        self.on_error = on_error
        self.runs: dict[str, ProgramRun] = {}  # live programs by id
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        self._owner: dict[str, tuple[str, int]] = {}  # request id -> (program id, slot)
        self._got: dict[str, list[tuple[StepRequest, GenerateResult | None]]] = {}
        self._finished: list[tuple[str, dict[str, Any]]] = []

    def add(self, row: dict[str, Any]) -> str:
        """Start the program on `row`; returns its id (finished ones come out of `step`)."""
        run = ProgramRun(self.program, row)
        run.start()
        return self._launch(run)

    def import_(self, state: dict[str, Any]) -> str:
        """Continue an exported program here: replayed to its pending step, which runs again."""
        return self._launch(ProgramRun.replay(self.program, state))

    def export(self, pid: str) -> dict[str, Any]:
        """Take a live program out of this runner as plain data (its in-flight step aborted)."""
        run = self.runs.pop(pid)
        for rid in [r for r, (p, _) in self._owner.items() if p == pid]:
            del self._owner[rid]
            self.engine.abort(rid)
        self._got.pop(pid, None)
        self.engine.unpin(pid)
        return run.export()

    def has_unfinished(self) -> bool:
        return bool(self.runs) or bool(self._finished)

    def step(self) -> list[tuple[str, dict[str, Any]]]:
        """One engine step; the programs that ended in it as (id, output dict)."""
        # also when no program is live: aborted steps of exported ones leave outputs to drain
        if self.runs or self.engine.has_unfinished():
            for out in self.engine.step():
                owner = self._owner.pop(out.request_id, None)
                if owner is None:
                    continue  # an aborted step of an exported program
                pid, slot = owner
                got = self._got[pid]
                got[slot] = (got[slot][0], result_of(got[slot][0], out))
                if all(r is not None for _, r in got):
                    del self._got[pid]
                    run = self.runs[pid]
                    run.feed([r for _, r in got])  # type: ignore[misc]
                    self._resubmit(pid, run)
        finished, self._finished = self._finished, []
        return finished

    def run_all(self, rows: Iterable[dict[str, Any]], on_done: Any = None) -> list[dict[str, Any]]:
        """Every row's output dict in input order (`on_done()` after each program ends)."""
        try:
            order = {self.add(dict(row)): i for i, row in enumerate(rows)}
            outputs: list[dict[str, Any] | None] = [None] * len(order)
            while True:
                for pid, out in self.step():
                    outputs[order[pid]] = out
                    if on_done is not None:
                        on_done()
                if not self.has_unfinished():
                    return outputs  # type: ignore[return-value]
        except BaseException:
            self.abort_all()  # on_error="raise" or an interrupt: leave the engine clean
            raise

    def abort_all(self) -> None:
        """Drop every live program: its in-flight steps aborted, its pins released."""
        for pid in list(self.runs):
            self.export(pid)
        self._finished.clear()

    # ---- internals ------------------------------------------------------------------------
    def _launch(self, run: ProgramRun) -> str:
        pid = f"program-{self._prefix}-{next(self._ids)}"
        self.runs[pid] = run
        self._resubmit(pid, run)
        return pid

    def _resubmit(self, pid: str, run: ProgramRun) -> None:
        """Submit the run's pending step, or retire the run when it has ended."""
        if run.pending is not None:
            try:
                reqs = [render(g, self.engine.tokenizer, self.defaults, self.engine.check_request)
                        for g in run.pending]
            except (ValueError, TypeError) as e:
                run.fail(f"program {run.program.name!r} step {run.num_steps}: {e}")
            else:
                self._got[pid] = [(req, None) for req in reqs]
                for slot, req in enumerate(reqs):
                    rid = self.engine.submit(req.prompt_token_ids, req.params, prompt=req.prompt,
                                             pin=pid)
                    self._owner[rid] = (pid, slot)
                return
        del self.runs[pid]
        self.engine.unpin(pid)
        if run.error is not None and self.on_error == "raise":
            raise ProgramError(run.error)
        self._finished.append((pid, run.output if run.error is None else {"error": run.error}))
