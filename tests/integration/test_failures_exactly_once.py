"""Exactly once when a Ray Data engine actor is SIGKILLed (docs/guarantees.md).

Two actors, several input batches in flight on each, migration on (the default), rows sampled
with their own seeds; one actor kills its own process once per job (an exclusive flag file),
before any row has left it ("early") or after a quarter of the rows have ("mid"). Ray restarts
the actor and retries its tasks; every input row must come back exactly once with the tokens of
an offline run. Rows leave one at a time in input order (stream="ordered", the default) or as
whole batches (stream=False): the two modes whose exactly-once does not rest on timing.
Completion order (stream=True) is not tested here: CI saw it lose and repeat rows.
"""
from __future__ import annotations

import os
import random
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import us

from batchgen_data import LLM, SamplingParams  # noqa: E402
from batchgen_data.connectors.ray_data import BatchGenPredictor  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ENGINE = {"max_model_len": 96, "max_num_seqs": 8}
ROWS = 48


class KillsOnce(BatchGenPredictor):
    """SIGKILLs its own actor once per job, when `after` rows have left it; the flag file makes
    the restarted actor (and the other one) carry on normally."""

    def __init__(self, flag: str, after: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.flag, self.after, self.sent = flag, after, 0

    def __call__(self, batch: Any) -> Iterator[Any]:
        for table in super().__call__(batch):
            if self.sent >= self.after:
                self._die_once()
            self.sent += table.num_rows
            yield table

    def _die_once(self) -> None:
        try:
            os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


def rows_for(seed: int) -> list[dict[str, Any]]:
    """Prompts and output lengths that vary, so rows finish out of input order."""
    rng = random.Random(seed)
    rows = []
    for i in range(ROWS):
        words = " ".join(rng.choice(["fox", "sea", "wind", "paris", "review", "invoice"])
                         for _ in range(rng.randint(2, 12)))
        params = {"temperature": 0.8, "seed": 1000 * seed + i, "max_tokens": rng.randint(2, 24),
                  "ignore_eos": True}
        rows.append({"id": i, "prompt": f"Row {i}: {words}", "sampling_params": params})
    return rows


def offline(model: str, rows: list[dict[str, Any]]) -> dict[int, list[int]]:
    llm = LLM(model, **ENGINE)
    outs = llm.chat([[{"role": "user", "content": r["prompt"]}] for r in rows],
                    [SamplingParams(**r["sampling_params"]) for r in rows], use_tqdm=False)
    return {r["id"]: o.outputs[0].token_ids for r, o in zip(rows, outs)}


@pytest.mark.parametrize("moment,seed,stream", [("early", 1, "ordered"), ("mid", 2, "ordered"),
                                                ("mid", 3, False), ("mid", 4, "ordered")])
def test_sigkilled_actor_loses_and_repeats_no_row(ray_local: None, model: str, tmp_path: Path,
                                                  moment: str, seed: int, stream: Any) -> None:
    rows = rows_for(seed)
    flag = tmp_path / "killed"
    after = 0 if moment == "early" else ROWS // 4 // 2  # a quarter of the rows, over 2 actors
    got = ray.data.from_items(rows).map_batches(
        KillsOnce, batch_size=6, batch_format="pyarrow",
        fn_constructor_kwargs=dict(model=model, flag=str(flag), after=after, stream=stream,
                                   sampling_params={"max_tokens": 8}, **ENGINE),
        compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=4),
        num_cpus=0.5).take_all()
    assert flag.exists()  # an actor did die
    ids = sorted(r["id"] for r in got)
    assert ids == list(range(ROWS)), f"lost {set(range(ROWS)) - set(ids)}, " \
                                     f"twice {sorted(i for i in ids if ids.count(i) > 1)}"
    want = offline(model, rows)
    for r in got:
        assert r["error"] is None
        assert list(r["generated_token_ids"]) == want[r["id"]], r["id"]
