"""The engine's two kinds of failure, as vLLM has them: one request's, which the caller
recovers from (`RequestFailedError`: a row error), and the engine's, which it cannot
(`EngineDeadError`; `StepError` is a step's verdict that leads to it). Plain classes in the
innermost unit, so a runner, the engine and the connectors raise and catch the same ones."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop failed; every request in flight on it failed with this error.
    `suspects`: the requests of the step that failed when none of them could be blamed alone
    (`StepError`): one of them may have caused it, or nothing did (the device); empty when the
    loop died elsewhere. Connectors keep them as evidence (a poison-row record). Raised inside
    a step (a tensor-parallel rank that is gone), it is the engine's verdict already: no part
    of the step is run again."""

    def __init__(self, message: str, suspects: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.suspects = suspects


class StepError(RuntimeError):
    """A step failed and no single request could be blamed: the engine's failure.
    `suspects`: the request ids of the step when every part of it failed (one of them may have
    caused it, or the device is gone), empty when no part reproduced the failure."""

    def __init__(self, message: str, suspects: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.suspects = suspects


class RequestFailedError(RuntimeError):
    """A step failed for this request alone (`batchgen_data.engine.step_failure`): its Future's error, a row
    error to the connectors; the engine and the other requests run on."""
