"""`ProgramRunner`: many rows' programs over one `Engine`, in the caller's thread.

The steps of all programs in flight share each batch; when a step finishes its program resumes
at once and its next step joins the queue ahead of new programs' first steps (depth first), so
a started program finishes while its KV is still there and a program that loops longer never
holds up the others. How many programs are in flight is bounded by the KV pool
(`admission.ProgramAdmission`): the others wait in a backlog and start as programs end. Each
program pins its KV prefix under its own key between steps (`Engine.submit(pin=)`) and
releases it when it ends. `LLM.run` is this runner driven to the end; tests and the benchmark
also use `export`/`import_` to move a program to another engine mid-flight.
"""
from __future__ import annotations

import itertools
import uuid
from collections import deque
from collections.abc import Iterable
from typing import Any

from batchgen_data.engine.engine import Engine
from batchgen_data.lora_request import no_adapters
from batchgen_data.programs.admission import PoolState, ProgramAdmission
from batchgen_data.programs.api import GenerateResult, Program
from batchgen_data.programs.run import ProgramError, ProgramRun
from batchgen_data.programs.stats import ProgramStats
from batchgen_data.engine.step_failure import request_error
from batchgen_data.programs.steps import StepRequest, render, result_of
from batchgen_data.sampling_params import SamplingParams


class ProgramRunner:
    def __init__(self, engine: Engine, program: Program,
                 defaults: SamplingParams | None = None, on_error: str = "row",
                 admission: ProgramAdmission | None = None) -> None:
        """`admission`: the in-flight bound (default: sized from the engine's KV pool)."""
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
        self._steps: dict[str, list[str]] = {}  # program id -> request ids of its pending step
        self._got: dict[str, list[tuple[StepRequest, GenerateResult | None]]] = {}
        self._finished: list[tuple[str, dict[str, Any]]] = []
        self.admission = admission or ProgramAdmission.for_engine(engine)
        self.stats = ProgramStats()
        # programs not started yet: (id, row) or, for an imported one, (id, exported state)
        self._backlog: deque[tuple[str, dict[str, Any], bool]] = deque()
        # a row's LoRA adapter (its `lora` column or `model`): every step of its program runs
        # under it, here and wherever the program is imported (the row travels with it)
        self._names = engine.lora_names()

    def _lora_for(self, row: dict[str, Any]) -> Any:
        if self._names is None:
            no_adapters(row)
            return None
        lora = self._names.request(row)
        self.engine.check_lora(lora)
        return lora

    def add(self, row: dict[str, Any]) -> str:
        """Queue the program on `row`; it starts as soon as the KV pool has room for it.
        Returns its id (finished ones come out of `step`)."""
        return self._queue(row, imported=False)

    def import_(self, state: dict[str, Any]) -> str:
        """Continue an exported program here: replayed to its pending step, which runs again
        (before the programs that have not started yet)."""
        return self._queue(state, imported=True)

    def export(self, pid: str) -> dict[str, Any]:
        """Take a program out of this runner as plain data (its in-flight step aborted)."""
        for entry in self._backlog:
            if entry[0] == pid:
                self._backlog.remove(entry)
                _, data, imported = entry
                return data if imported else ProgramRun(self.program, data).export()
        run = self.runs.pop(pid)
        self.admission.end(pid, completed=False)
        for rid in self._steps.pop(pid, []):
            if self._owner.pop(rid, None) is not None:
                self.engine.abort(rid)
        self._got.pop(pid, None)
        self.engine.unpin(pid)
        return run.export()

    def has_unfinished(self) -> bool:
        return bool(self.runs) or bool(self._backlog) or bool(self._finished)

    def step(self) -> list[tuple[str, dict[str, Any]]]:
        """One engine step; the programs that ended in it as (id, output dict)."""
        # also when no program is live: aborted steps of exported ones leave outputs to drain
        if self.runs or self.engine.has_unfinished():
            for out in self.engine.step():
                owner = self._owner.pop(out.request_id, None)
                if owner is None:
                    continue  # an aborted step of an exported program
                pid, slot = owner
                error = request_error(out)
                if error is not None:  # the engine failed this step's request: the row fails
                    self._fail_step(pid, f"program {self.runs[pid].program.name!r} step "
                                         f"{self.runs[pid].num_steps}: {error}")
                    continue
                got = self._got[pid]
                result = result_of(got[slot][0], out)
                got[slot] = (got[slot][0], result)
                self.admission.step_done(len(result.token_ids))
                self.stats.record(self.runs[pid].num_steps, len(result.prompt_token_ids),
                                  result.num_cached_tokens)
                if all(r is not None for _, r in got):
                    del self._got[pid]
                    run = self.runs[pid]
                    run.feed([r for _, r in got])  # type: ignore[misc]
                    self._resubmit(pid, run)
        self._fill()
        finished, self._finished = self._finished, []
        return finished

    def _fail_step(self, pid: str, message: str) -> None:
        """End program `pid` as a row error: the rest of its pending step aborted."""
        for rid in self._steps.get(pid, []):
            if self._owner.pop(rid, None) is not None:
                self.engine.abort(rid)
        self._got.pop(pid, None)
        run = self.runs[pid]
        run.fail(message)
        self._resubmit(pid, run)

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
        self._backlog.clear()
        self._finished.clear()

    # ---- internals ------------------------------------------------------------------------
    def _queue(self, data: dict[str, Any], imported: bool) -> str:
        pid = f"program-{self._prefix}-{next(self._ids)}"
        entry = (pid, data, imported)
        # a moved program was in flight already: it goes before those not started
        self._backlog.appendleft(entry) if imported else self._backlog.append(entry)
        self._fill()
        return pid

    def _fill(self) -> None:
        """Start backlog programs while the KV pool has room for them (admission.py)."""
        if not self._backlog:
            return
        held = {pid: self.engine.kv_blocks_held(pid, self._steps.get(pid, ()))
                for pid in self.runs}
        state = PoolState.of(self.engine)  # submitting takes no blocks: one look will do
        while self._backlog and self.admission.may_start(state, held):
            pid, data, imported = self._backlog.popleft()
            if imported:
                run = ProgramRun.replay(self.program, data)
            else:
                run = ProgramRun(self.program, data)
                run.start()
            self.runs[pid] = run
            self.stats.programs_started += 1
            self._resubmit(pid, run)
            self.stats.max_in_flight = max(self.stats.max_in_flight, len(self.runs))

    def _resubmit(self, pid: str, run: ProgramRun) -> None:
        """Submit the run's pending step, or retire the run when it has ended."""
        if run.pending is not None:
            try:
                reqs = [render(g, self.engine.tokenizer, self.defaults, self.engine.check_request)
                        for g in run.pending]
                lora = self._lora_for(run.row)
            except (ValueError, TypeError) as e:
                run.fail(f"program {run.program.name!r} step {run.num_steps}: {e}")
            else:
                self._got[pid] = [(req, None) for req in reqs]
                limits = [self._limit(r) for r in reqs]
                self.admission.reserve(pid, self.admission.step_blocks(
                    [len(r.prompt_token_ids) for r in reqs], limits),
                    self.admission.turn_blocks(limits))
                self._steps[pid] = []
                for slot, req in enumerate(reqs):
                    # a started program's next step goes before new programs' first steps
                    rid = self.engine.submit(req.prompt_token_ids, req.params, prompt=req.prompt,
                                             pin=pid, front=bool(run.history),
                                             lora_request=lora)
                    self._owner[rid] = (pid, slot)
                    self._steps[pid].append(rid)
                return
        del self.runs[pid]
        self._steps.pop(pid, None)
        self.engine.unpin(pid)
        self.admission.end(pid)
        if run.error is not None and self.on_error == "raise":
            raise ProgramError(run.error)
        self._finished.append((pid, run.output if run.error is None else {"error": run.error}))

    def _limit(self, req: StepRequest) -> int:
        room = self.engine.max_model_len - len(req.prompt_token_ids)
        return min(req.params.max_tokens or room, room)
