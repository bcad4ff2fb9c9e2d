"""Cross-actor migration on local Ray with a tiny random Llama.

Two engine hosts share a coordinator; only one gets rows, so the other is short of work and
imports some. Every row must come back through its owner exactly once with the tokens an
offline run gives, also when the importer or the coordinator is killed mid-flight.

Moves are forced, not raced: the owner's engine is gated (`gated_engine.HoldingPredictor`, a
fake at the predictor's `start_driver` seam: it stops stepping until it has exported a row), and
an importer that must not finish its guests before it is killed never steps at all
(`PredictorHost(frozen=True)`).
"""
from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

ray = pytest.importorskip("ray")

from batchgen_data import LLM, SamplingParams  # noqa: E402
from batchgen_data.connectors.common import derive_seed  # noqa: E402
from batchgen_data.connectors.ray.coordinator import NAMESPACE, coordinator_name  # noqa: E402
from batchgen_data.connectors.ray_data import BatchGenPredictor  # noqa: E402
from batchgen_data.placement import TransferCost  # noqa: E402

import gated_engine  # noqa: E402
from gated_engine import GatedEngine, PredictorHost  # noqa: E402

pytestmark = pytest.mark.timeout(600)
# workers cannot import this test module or the fake: ship them by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(gated_engine)

# raw prompts, as `LLM.generate` (the oracle below) sends them: this file tests migration
ENGINE = {"max_model_len": 1024, "max_num_seqs": 4, "apply_chat_template": False}
PLACEMENT = {"min_running_age": 8, "min_kv_gain_tokens": 16}
N_ROWS, MAX_TOKENS = 12, 48


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def llm(model: str) -> LLM:
    return LLM(model, max_model_len=1024, max_num_seqs=16)


@pytest.fixture
def job(ray_local: None) -> Iterator[str]:
    """A fresh job id per test; its detached coordinator is killed afterwards, so no test
    sees another's engines or outlives it."""
    job_id = f"t-{uuid.uuid4().hex}"
    yield job_id
    try:
        ray.kill(ray.get_actor(coordinator_name(job_id, ""), namespace=NAMESPACE))
    except ValueError:
        pass  # never created, or the test killed it


def make_rows(n: int, max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        sp = {"max_tokens": max_tokens, "ignore_eos": True,
              "temperature": 0.0 if i % 2 else 0.9, "seed": 7 if i % 4 == 0 else None}
        rows.append({"id": i, "prompt": f"The quick brown fox {i} jumps over", "sampling_params": sp})
    return rows


ROWS = make_rows(N_ROWS, MAX_TOKENS)


@pytest.fixture(scope="module")
def offline(llm: LLM) -> dict[int, list[int]]:
    """The tokens of every row of ROWS from one unmoved offline batch (computed once)."""
    return offline_tokens(llm, ROWS)


def offline_tokens(llm: LLM, rows: list[dict[str, Any]]) -> dict[int, list[int]]:
    params = []
    for row in rows:
        sp = dict(row["sampling_params"])
        if sp["seed"] is None:  # the connector seeds unseeded rows from their prompt
            sp["seed"] = derive_seed(0, str(llm.tokenizer.encode(row["prompt"])))
        params.append(SamplingParams(**sp))
    refs = llm.generate([row["prompt"] for row in rows], params, use_tqdm=False)  # one batch
    return {row["id"]: ref.outputs[0].token_ids for row, ref in zip(rows, refs)}


def assert_offline_equal(want: dict[int, list[int]], got: list[dict[str, Any]]) -> None:
    assert sorted(r["id"] for r in got) == sorted(want)  # none lost, none twice
    for out in got:
        assert out["error"] is None, out["error"]
        assert list(out["generated_token_ids"]) == want[out["id"]], out["id"]


def start_pair(model: str, job: str, owner: dict[str, Any] | None = None,
               other: dict[str, Any] | None = None, frozen: bool = False) -> tuple[Any, Any]:
    """(owner, importer); `owner`/`other`: extra MigrationOptions for each. The owner holds
    before its first step unless told otherwise."""
    opts = {"job_id": job, "interval_s": 0.1, "placement": PLACEMENT}
    remote = ray.remote(PredictorHost).options(max_concurrency=4, num_cpus=0.25)
    extras = [{"hold_for_move_after": 0, **(owner or {})}, dict(other or {})]
    hold = [e.pop("hold_for_move_after", -1) for e in extras]
    hosts = [remote.remote(model=model, migration_options={**opts, **extra}, frozen=f,
                           hold_for_move_after=h, **ENGINE)
             for extra, f, h in zip(extras, (False, frozen), hold)]
    ray.get([h.counts.remote() for h in hosts])
    return hosts[0], hosts[1]


def side_job(host: Any) -> Any:
    """Keep a call open on the importer: engines with no task in flight take no work."""
    ref = host.busy.remote()
    while ray.get(host.active_calls.remote()) == 0:
        time.sleep(0.02)
    return ref


def wait_for_import(host: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while ray.get(host.counts.remote())["imported"] == 0:
        assert time.monotonic() < deadline, "no row was ever migrated"
        time.sleep(0.02)


def test_exported_rows_finish_elsewhere_with_identical_tokens(
        job: str, model: str, offline: dict[int, list[int]]) -> None:
    owner, other = start_pair(model, job)
    side = side_job(other)
    got = ray.get(owner.run.remote(ROWS))
    other.release.remote()
    assert ray.get(side)
    assert_offline_equal(offline, got)
    sent, took = ray.get(owner.counts.remote()), ray.get(other.counts.remote())
    assert sent["exported"] >= 1 and took["imported"] == sent["exported"], (sent, took)
    assert sent["delivered"] >= 1 and sent["delivered"] + sent["reclaimed"] == sent["exported"]
    # the importer computed work of its own (the rows it took were waiting: no KV came along)
    assert took["computed_tokens"] > 0 and sent["kv_shipped"] == 0
    for h in (owner, other):
        ray.kill(h)


def test_running_rows_move_with_their_kv(job: str, model: str, llm: LLM) -> None:
    prompt_len, max_tokens = 6, 64
    rows = [{"id": i, "prompt_token_ids": [5 + i, 17, 42, 9, 33, 21],
             "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}}
            for i in range(4)]
    # all four rows run at once (max_num_seqs=4); the owner holds after 12 steps, when each has
    # generated past min_running_age, so what moves is running; a transfer cost model that
    # always favours shipping makes the policy send its KV (the measured one may not on CPU)
    ship = {"placement": {**PLACEMENT, "transfer": TransferCost(1, 1e15, 1e15, 1.0, 0.0)}}
    owner, other = start_pair(model, job, owner={"hold_for_move_after": 12, **ship}, other=ship)
    side = side_job(other)
    got = ray.get(owner.run.remote(rows))
    other.release.remote()
    assert ray.get(side)
    refs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in rows],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    assert_offline_equal({r["id"]: o.outputs[0].token_ids for r, o in zip(rows, refs)}, got)
    sent, took = ray.get(owner.counts.remote()), ray.get(other.counts.remote())
    assert sent["kv_shipped"] >= 1 and took["imported"] == sent["exported"], (sent, took)
    assert took["kv_imported_tokens"] >= sent["kv_shipped"] * (prompt_len + 8)
    # the receiver computed only what the shipped KV did not cover: per imported row, the
    # context of its finished output (prompt + output - 1) minus the KV it arrived with
    assert took["computed_tokens"] == (took["imported"] * (prompt_len + max_tokens - 1)
                                       - took["kv_imported_tokens"]), (sent, took)
    for h in (owner, other):
        ray.kill(h)


def test_killing_the_importer_loses_no_row(job: str, model: str,
                                           offline: dict[int, list[int]]) -> None:
    dead = {"dead_after_s": 4.0}
    owner, other = start_pair(model, job, owner=dead, other=dead, frozen=True)
    side_job(other)
    ref = owner.run.remote(ROWS)
    wait_for_import(other)
    ray.kill(other, no_restart=True)
    got = ray.get(ref)
    assert_offline_equal(offline, got)
    c = ray.get(owner.counts.remote())
    assert c["exported"] >= 1 and c["reclaimed"] == c["exported"] and c["delivered"] == 0, c
    ray.kill(owner)


def test_coordinator_death_degrades_to_no_migration(job: str, model: str,
                                                    offline: dict[int, list[int]]) -> None:
    owner, other = start_pair(model, job, frozen=True)
    side = side_job(other)
    ref = owner.run.remote(ROWS)
    wait_for_import(other)
    ray.kill(ray.get_actor(coordinator_name(job, ""), namespace=NAMESPACE))
    got = ray.get(ref)
    assert_offline_equal(offline, got)
    c = ray.get(owner.counts.remote())
    assert c["disabled"] and c["exported"] >= 1 and c["reclaimed"] == c["exported"], c
    other.release.remote()
    assert ray.get(side)  # the importer's own call ends too
    assert ray.get(other.counts.remote())["disabled"]
    for h in (owner, other):
        ray.kill(h)


class HoldTail(BatchGenPredictor):
    """The predictor with a step gate for the Ray Data job: an engine whose rows include one
    past 10 generated tokens (only the long tail gets there) stops stepping until it has moved
    a row, so the tail is still there when the other engine runs dry."""

    def start_driver(self, model: str | None, engine_kwargs: dict[str, Any]) -> Any:
        from batchgen_data.connectors.ray.predictor import default_device_kwargs
        from batchgen_data.engine.driver import EngineDriver
        from batchgen_data.engine.engine import Engine

        engine = Engine.from_kwargs(model, **default_device_kwargs(engine_kwargs))
        deadline = time.monotonic() + 40.0  # a move comes within seconds when it comes

        def gate() -> bool:
            m = getattr(self, "migration", None)
            moved = m is not None and (m.counts["exported"] or m.counts["imported"])
            tail = any(r.num_output_tokens >= 10 for r in engine.movable())
            return bool(moved) or not tail or time.monotonic() > deadline

        return EngineDriver(GatedEngine(engine, gate))  # type: ignore[arg-type]


def test_ray_data_job_matches_offline_and_moves_rows(job: str, model: str, llm: LLM) -> None:
    rows = []
    for i in range(24):  # heavy tail, all in the first input block: one engine gets it all
        sp = {"max_tokens": 64 if i < 4 else 8, "ignore_eos": True,
              "temperature": 0.8 if i % 2 else 0.0, "seed": None}
        rows.append({"id": i, "prompt": f"Summarise paragraph {i}", "sampling_params": sp})
    opts = {"job_id": job, "interval_s": 0.1, "placement": PLACEMENT}
    ds = ray.data.from_items(rows).repartition(target_num_rows_per_block=4)
    out = ds.map_batches(
        HoldTail, batch_size=4, batch_format="pyarrow",
        fn_constructor_kwargs=dict(model=model, migration=True, migration_options=opts, **ENGINE),
        # late binding, as build_processor sets it with migration on: no batch waits queued at
        # the engine that holds the tail, so the other one gets the rest
        compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=2,
                                           max_tasks_in_flight_per_actor=2),
        num_cpus=0.5).take_all()
    assert_offline_equal(offline_tokens(llm, rows), out)
    stats = ray.get(ray.get_actor(coordinator_name(job, ""), namespace=NAMESPACE).stats.remote())
    # both engines took part; one that finished first may already be pruned from `engines`
    assert len(stats["engines_seen"]) == 2, str(stats)
    # the engine that runs dry first lingers as a receiver even when its rows were done before
    # the coordinator had heard that the other one owns any (the stale-report case, mended)
    assert stats["num_moves"] >= 1, str(stats)
