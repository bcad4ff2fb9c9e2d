"""Row-level late binding and KV through the object store, on local Ray with a tiny Llama.

Two engine hosts share a coordinator; only the owner gets rows. The owner holds its first step
until it has exported a row (`gated_engine.HoldingPredictor`, a fake at the predictor's
`start_driver` seam), so the moves are forced, not raced:

* late binding alone (`late_binding=True, migration=False`): only queued rows (never scheduled,
  no KV) may move; each comes back once, through its owner, with the offline tokens;
* migration of running sequences with KV: the KV travels as an `ObjectRef` and the coordinator
  receives no KV bytes in its mail, while the tokens still equal an unmoved run's.
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
from batchgen_data.connectors.ray.coordinator import NAMESPACE, coordinator_name  # noqa: E402
from batchgen_data.placement import TransferCost  # noqa: E402

import gated_engine  # noqa: E402
from gated_engine import PredictorHost  # noqa: E402

pytestmark = pytest.mark.timeout(600)
# workers cannot import this test module or the fake: ship them by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(gated_engine)

ENGINE = {"max_model_len": 512, "max_num_seqs": 4, "apply_chat_template": False}
PLACEMENT = {"min_running_age": 8, "min_kv_gain_tokens": 16}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture
def job(ray_local: None) -> Iterator[str]:
    job_id = f"t-{uuid.uuid4().hex}"
    yield job_id
    try:
        ray.kill(ray.get_actor(coordinator_name(job_id, ""), namespace=NAMESPACE))
    except ValueError:
        pass  # never created


def run_pair(model: str, job: str, rows: list[dict[str, Any]], owner: dict[str, Any],
             both: dict[str, Any]) -> tuple[list[dict[str, Any]], dict, dict, dict]:
    """Rows through the owner while the other host keeps a call open; (outputs, owner counts,
    importer counts, coordinator stats)."""
    opts = {"job_id": job, "interval_s": 0.1, "placement": PLACEMENT}
    remote = ray.remote(PredictorHost).options(max_concurrency=4, num_cpus=0.25)
    kw = {k: v for k, v in both.items() if k != "placement"}
    opts["placement"] = {**PLACEMENT, **both.get("placement", {})}
    owner = dict(owner)
    hold = owner.pop("hold_for_move_after", -1)
    src = remote.remote(model=model, migration_options={**opts, **owner},
                        hold_for_move_after=hold, **kw, **ENGINE)
    dst = remote.remote(model=model, migration_options=opts, **kw, **ENGINE)
    ray.get([src.counts.remote(), dst.counts.remote()])
    side = dst.busy.remote()
    while ray.get(dst.active_calls.remote()) == 0:
        time.sleep(0.02)
    got = ray.get(src.run.remote(rows))
    dst.release.remote()
    assert ray.get(side)
    coordinator = ray.get_actor(coordinator_name(job, ""), namespace=NAMESPACE)
    out = got, ray.get(src.counts.remote()), ray.get(dst.counts.remote()), \
        ray.get(coordinator.stats.remote())
    for h in (src, dst):
        ray.kill(h)
    return out


def greedy_offline(model: str, rows: list[dict[str, Any]], max_tokens: int) -> dict[int, list]:
    llm = LLM(model, max_model_len=512, max_num_seqs=16)
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in rows],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return {r["id"]: o.outputs[0].token_ids for r, o in zip(rows, outs)}


def check_once_and_equal(want: dict[int, list], got: list[dict[str, Any]]) -> None:
    assert sorted(r["id"] for r in got) == sorted(want)  # none lost, none twice
    for r in got:
        assert r["error"] is None, r["error"]
        assert list(r["generated_token_ids"]) == want[r["id"]], r["id"]


def rows_of(n: int, max_tokens: int) -> list[dict[str, Any]]:
    return [{"id": i, "prompt_token_ids": [7 + i, 17, 42, 9, 33, 21],
             "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True,
                                 "temperature": 0.0}} for i in range(n)]


def test_late_binding_moves_only_queued_rows_and_each_comes_back_once(job: str,
                                                                      model: str) -> None:
    rows = rows_of(12, 24)  # 4 seats: 8 rows queued behind them at the owner
    got, sent, took, stats = run_pair(model, job, rows, owner={"hold_for_move_after": 0},
                                      both={"late_binding": True, "migration": False})
    check_once_and_equal(greedy_offline(model, rows, 24), got)
    assert sent["exported"] >= 1 and took["imported"] == sent["exported"], (sent, took)
    assert sent["delivered"] + sent["reclaimed"] == sent["exported"], sent
    # late binding alone never moves a started sequence: nothing moved carried KV
    assert sent["kv_shipped"] == 0 and sent["kv_bytes_sent"] == 0, sent
    assert stats["kv_bytes_moved"] == 0 and stats["num_moves"] >= 1, stats


def test_running_sequences_ship_kv_through_the_object_store(job: str, model: str) -> None:
    rows = rows_of(4, 64)
    # all four rows run at once; the owner holds after 12 steps, when each has generated past
    # min_running_age, so what moves is running, and a cost model that always favours shipping
    # makes the policy send its KV
    ship = {"placement": {"transfer": TransferCost(1, 1e15, 1e15, 1.0, 0.0)}}
    got, sent, took, stats = run_pair(model, job, rows, owner={"hold_for_move_after": 12},
                                      both={"migration": True, **ship})
    check_once_and_equal(greedy_offline(model, rows, 64), got)
    assert sent["kv_shipped"] >= 1 and took["imported"] == sent["exported"], (sent, took)
    # the bytes went owner -> object store -> importer, all of them, timed on both sides
    assert sent["kv_bytes_sent"] > 0 and took["kv_bytes_received"] == sent["kv_bytes_sent"]
    assert sent["kv_put_s"] > 0 and took["kv_get_s"] > 0, (sent, took)
    # ... and never through the coordinator, which only saw ObjectRefs in its mail
    assert stats["kv_bytes_relayed"] == 0, stats
    assert stats["kv_bytes_moved"] == took["kv_bytes_received"], stats
