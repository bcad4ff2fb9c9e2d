"""Fakes at the engine's seams for the poisoned-row tests (issue 57): a runner or a sampler that
raises inside a step whenever a poisoned row is in it, as a bug that one row's values trigger
would. A row is poisoned when its prompt holds the token id `POISON`. The product has no such
option: the tests build engines with these parts. (A plain module, not a conftest: Ray and
Spark ship it to their workers by value.)"""
from __future__ import annotations

from typing import Any

from batchgen_data.config import make_engine_config
from batchgen_data.engine.engine import Engine
from batchgen_data.sample.sampler import Sampler
from batchgen_data.engine.setup import build_parts

POISON = 7  # a token id of the tiny models' vocabulary
MESSAGE = "a poisoned row is in this step"


def poisoned(seqs: Any) -> bool:
    return any(POISON in s.prompt_token_ids for s in seqs)


class PoisonRunner:
    """The model runner, but `run` raises for a step with a poisoned row. With `kills_device`
    the first such step breaks every later run too, poisoned or not (a device error that takes
    the CUDA context with it): no part of a step runs again, so no row can be blamed."""

    def __init__(self, runner: Any, kills_device: bool = False) -> None:
        self.runner, self.kills_device = runner, kills_device
        self.broken = False

    def run(self, inp: Any) -> Any:
        if self.broken or poisoned(inp.flat[0]):
            self.broken = self.kills_device
            raise RuntimeError(MESSAGE)
        return self.runner.run(inp)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


class PoisonSampler(Sampler):
    """The sampler, but `where` raises for rows of a poisoned prompt: "launch" (the draw on
    the device), "batch" (its host half, built ahead of the step under async_scheduling) or
    "draw" (the launch of a step whose rows do more than an argmax: a greedy row with nothing
    to report, as the neutral control runs it, passes)."""

    where = "launch"

    def batch(self, seqs: Any, vocab: int, device: Any) -> Any:
        if self.where == "batch" and poisoned(seqs):
            raise OverflowError(MESSAGE)
        return super().batch(seqs, vocab, device)

    def launch(self, logits: Any, b: Any, seqs: Any) -> Any:
        draws = self.where == "draw" and b is not None
        if (self.where == "launch" or draws) and poisoned(seqs):
            raise RuntimeError(MESSAGE)
        return super().launch(logits, b, seqs)


def poisoned_engine(model: str | None, where: str = "run", kills_device: bool = False,
                    **kwargs: Any) -> Engine:
    """An engine whose step fails for poisoned rows: in the runner (`where="run"`) or in the
    sampler ("launch", "batch", "draw")."""
    config = make_engine_config(model, **kwargs)
    parts = build_parts(config)
    if where == "run":
        parts.runner = PoisonRunner(parts.runner, kills_device)
    else:
        parts.sampler = PoisonSampler(parts.stopper.eos_token_ids, parts.tokenizer)
        parts.sampler.where = where
    return Engine(config, parts)


def poisoned_run_engine(model: str | None, **kwargs: Any) -> Engine:
    """`engine_factory=poisoned_run_engine`: an engine whose runner fails poisoned rows, for
    workers that build their engine themselves (Spark executors, which import this module once
    the test ships it with `addPyFile`)."""
    return poisoned_engine(model, "run", **kwargs)


def device_killing_engine(model: str | None, **kwargs: Any) -> Engine:
    """As `poisoned_run_engine`, with a runner that loses its device on the poisoned row."""
    return poisoned_engine(model, "run", kills_device=True, **kwargs)
