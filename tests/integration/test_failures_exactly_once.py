"""Exactly once when a Ray Data engine actor is SIGKILLed (docs/guarantees.md).

Two actors, several input batches in flight on each, migration on (the default), rows sampled
with their own seeds; one actor kills its own process once per job (an exclusive flag file),
before any row has left it ("early"), after a quarter of the rows have ("mid"), or after two
thirds of its own ("late"). Ray restarts
the actor and retries its tasks; every input row must come back exactly once with the tokens of
an offline run. Each kill point runs in completion order (stream=True, the default) and in input
order (stream="ordered"); whole batches (stream=False) once.

The restarted actor's engine queues each row ahead of the waiting ones, so it takes a retried
batch's rows in reverse order and they finish in another order than the first attempt's:
completion order then stays exactly once only through the emitted-rows record
(connectors/ray/emitted.py). With a record that keeps nothing (`start_record` giving the
record used outside Ray, `emitted.NO_RECORD`) these tests lose and repeat rows in completion
order.
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
from batchgen_data.connectors.ray import emitted  # noqa: E402
from batchgen_data.connectors.ray.predictor import default_device_kwargs  # noqa: E402
from batchgen_data.connectors.ray_data import BatchGenPredictor  # noqa: E402
from batchgen_data.engine.driver import EngineDriver  # noqa: E402
from batchgen_data.engine.engine import Engine  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ENGINE = {"max_model_len": 96, "max_num_seqs": 8}
ROWS = 48


class FrontFirst(EngineDriver):
    """Queues every request ahead of the waiting ones: the engine takes a batch's rows last
    first, another engine state than the first attempt's."""

    def submit(self, *args: Any, **kw: Any) -> Any:
        return super().submit(*args, **{**kw, "front": True})


class CountsPlaceholders:
    """The job's emitted-rows record, noting in a file each yield a retry replays as
    placeholders (one line per yield, its number of rows)."""

    def __init__(self, client: Any, path: str) -> None:
        self.client, self.path = client, path

    def call(self, rows: list[dict[str, Any]]) -> Any:
        record = self.client.call(rows)
        path = self.path

        class Counted:
            def replay(self) -> list[emitted.Replay]:
                plan = record.replay()
                with open(path, "a") as f:
                    f.writelines(f"{len(r.rows)}\n" for r in plan if r.placeholder)
                return plan

            def add(self, rows: list[int], row_bytes: int) -> None:
                record.add(rows, row_bytes)

            def finish(self) -> None:
                record.finish()

        return Counted()

    def stop(self) -> None:
        self.client.stop()


class KillsOnce(BatchGenPredictor):
    """SIGKILLs its own actor once per job, when `after` rows have left it; the flag file makes
    the restarted actor (and the other one) carry on normally."""

    def __init__(self, flag: str, after: int, settle_s: float = 1.0, **kw: Any) -> None:
        self.restarted = os.path.exists(flag)  # this actor is the one Ray brought back
        self.flag, self.settle_s = flag, settle_s
        super().__init__(**kw)
        self.after, self.sent = after, 0

    def start_driver(self, model: str | None, engine_kwargs: dict[str, Any]) -> Any:
        if not self.restarted:
            return super().start_driver(model, engine_kwargs)
        return FrontFirst(Engine.from_kwargs(model, **default_device_kwargs(engine_kwargs)))

    def start_record(self, fingerprint: str, job_id: str | None) -> Any:
        client = emitted.start_emitted(fingerprint, job_id, settle_s=self.settle_s)
        return None if client is None else CountsPlaceholders(client,
                                                              self.flag + ".placeholders")

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


# settle_s: how long before its attempt's end a yield must have been handed to Ray to be
# replayed as placeholders (the default, 1 s, is longer than these jobs' rows take, so a retry
# generates its recorded rows again; 0 s makes it use placeholders for every yield the attempt had
# handed over before its next write to the record, and those must then be right)
@pytest.mark.parametrize("moment,seed,stream,settle_s", [
    ("early", 1, True, 1.0), ("early", 1, "ordered", 1.0),
    ("mid", 2, True, 1.0), ("mid", 2, True, 0.0), ("mid", 2, "ordered", 1.0),
    ("mid", 3, False, 1.0), ("late", 4, True, 0.0)])
def test_sigkilled_actor_loses_and_repeats_no_row(ray_local: None, model: str, tmp_path: Path,
                                                  moment: str, seed: int, stream: Any,
                                                  settle_s: float) -> None:
    rows = rows_for(seed)
    flag = tmp_path / "killed"
    # none of its rows / a quarter of them / two thirds (each actor gets 4 batches of 6)
    after = {"early": 0, "mid": ROWS // 4 // 2, "late": ROWS // 2 * 2 // 3}[moment]
    got = ray.data.from_items(rows).map_batches(
        KillsOnce, batch_size=6, batch_format="pyarrow",
        fn_constructor_kwargs=dict(model=model, flag=str(flag), after=after, stream=stream,
                                   settle_s=settle_s, sampling_params={"max_tokens": 8},
                                   **ENGINE),
        compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=4),
        num_cpus=0.5).take_all()
    assert flag.exists()  # an actor did die
    ids = sorted(r["id"] for r in got)
    assert ids == list(range(ROWS)), f"lost {set(range(ROWS)) - set(ids)}, " \
                                     f"twice {sorted(i for i in ids if ids.count(i) > 1)}"
    placeholders = Path(str(flag) + ".placeholders")
    if stream is True and moment == "late" and settle_s < 0.1:  # calls with several yields
        assert placeholders.exists(), "the retry used no placeholder: nothing was checked"
    want = offline(model, rows)
    for r in got:
        assert r["error"] is None
        assert list(r["generated_token_ids"]) == want[r["id"]], r["id"]
