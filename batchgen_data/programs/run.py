"""One row's program in flight: drive its generator, guard it, record what it received.

A `ProgramRun` owns the Python generator of one row. `start()` runs it to its first yield and
`feed(results)` resumes it with the finished generations of the pending step; after each, the
run either has a `pending` step (the Generates to submit), an `output` dict, or an `error`
naming what went wrong (the program raised, yielded something that is not a Generate, returned
something that is not a dict, or went past `max_steps`). A broken program is a row error; it
never reaches the engine or the job.

The generator cannot be pickled, so the run's state is its row plus the results it has received
(`export`). `replay` feeds those results to a fresh generator and reaches the same pending step
without generating anything, on whichever engine imports it.
"""
from __future__ import annotations

from typing import Any

from batchgen_data.programs.api import Generate, GenerateResult, Program


class ProgramError(ValueError):
    """A program that cannot go on; its message becomes the row's `error` value."""


class ProgramRun:
    def __init__(self, program: Program, row: dict[str, Any]) -> None:
        if not isinstance(program, Program):
            raise TypeError(f"expected a @program, got {type(program).__name__}: decorate the "
                            "generator function with batchgen_data.program")
        self.program = program
        self.row = row
        self.pending: list[Generate] | None = None
        self.output: dict[str, Any] | None = None
        self.error: str | None = None
        self.num_steps = 0  # steps yielded so far (the pending one included)
        # per received step: whether the program yielded a list, and the results it got
        self.history: list[tuple[bool, list[GenerateResult]]] = []
        self._fanout = False
        self._gen: Any = None

    @property
    def done(self) -> bool:
        return self.output is not None or self.error is not None

    def start(self) -> None:
        try:
            self._gen = self.program(self.row)
        except Exception as e:  # noqa: BLE001 - the user's code: a row error
            self.fail(f"program {self.program.name!r} raised {type(e).__name__}: {e}")
            return
        if not hasattr(self._gen, "send"):
            self.fail(f"program {self.program.name!r} is not a generator function (it returned "
                      f"{type(self._gen).__name__}); it must yield Generate(...)")
            return
        self._advance(lambda: next(self._gen))

    def feed(self, results: list[GenerateResult]) -> None:
        """Resume the program with the results of its pending step, in the order it asked."""
        assert self.pending is not None and len(results) == len(self.pending)
        self.history.append((self._fanout, list(results)))
        reply: Any = list(results) if self._fanout else results[0]
        self._advance(lambda: self._gen.send(reply))

    def fail(self, message: str) -> None:
        self.error = message
        self.output = None
        self.pending = None
        if self._gen is not None:
            try:
                self._gen.close()  # run the program's `finally` blocks
            except Exception:  # noqa: BLE001 - already failing; the first cause is the one told
                pass

    def _advance(self, resume: Any) -> None:
        name = self.program.name
        try:
            value = resume()
        except StopIteration as stop:
            self.pending = None
            if not isinstance(stop.value, dict):
                self.fail(f"program {name!r} returned {type(stop.value).__name__}; it must "
                          "return a dict of output columns")
            else:
                self.output = stop.value
            return
        except Exception as e:  # noqa: BLE001 - the user's code: a row error
            self.fail(f"program {name!r} raised {type(e).__name__} at step {self.num_steps}: {e}")
            return
        self._fanout = isinstance(value, (list, tuple))
        steps = list(value) if self._fanout else [value]
        bad = next((s for s in steps if not isinstance(s, Generate)), None)
        if bad is not None or not steps:
            what = "an empty list" if not steps else type(bad).__name__
            self.fail(f"program {name!r} yielded {what} at step {self.num_steps + 1}; a program "
                      "yields Generate(...) or a non-empty list of them")
            return
        if self.num_steps >= self.program.max_steps:
            self.fail(f"program {name!r} exceeded max_steps={self.program.max_steps}")
            return
        self.num_steps += 1
        self.pending = steps

    # ---- moving between engines ---------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        """Plain, picklable state: the row and every step's results (not the pending step,
        which the importing side generates again)."""
        return {"program": self.program.name, "row": self.row,
                "history": [{"fanout": fan, "results": [r.to_dict() for r in res]}
                            for fan, res in self.history]}

    @classmethod
    def replay(cls, program: Program, state: dict[str, Any]) -> "ProgramRun":
        """A run brought back to the point `state` was exported at, by re-feeding its results.

        A program that yields something else on replay than it did the first time is not a
        function of its row and results; the run then fails with a message saying so."""
        if state.get("program") != program.name:
            raise ValueError(f"state is of program {state.get('program')!r}, not {program.name!r}")
        run = cls(program, state["row"])
        run.start()
        for k, step in enumerate(state["history"], start=1):
            results = [GenerateResult.from_dict(r) for r in step["results"]]
            if run.pending is None or len(run.pending) != len(results) \
                    or run._fanout != step["fanout"]:
                if run.error is None:  # an error met on the way is the one to tell
                    run.fail(f"program {program.name!r} diverged on replay at step {k}: it must "
                             "depend only on its row and the results it receives")
                return run
            run.feed(results)
        return run
