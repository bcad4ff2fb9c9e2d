"""Late binding by prefix on local Ray with a tiny Llama (connectors/ray/affinity.py), on by
default: exactly once and the offline tokens, also when the importer is killed.

Two engine hosts share a coordinator; only the owner gets rows (documents of four blocks, two
questions each), and it holds its first step until it has exported a row, so every row is still
queued when the coordinator first plans. Bounded load alone forces moves then (the owner may keep
at most ceil(1.25 * 20 / 2) = 13 of the 20 rows), whichever engine each document hashes to.
"""
from __future__ import annotations

import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

ray = pytest.importorskip("ray")

from batchgen_data import LLM, SamplingParams  # noqa: E402
from batchgen_data.connectors.ray.coordinator import NAMESPACE, coordinator_name  # noqa: E402

import gated_engine  # noqa: E402
from gated_engine import PredictorHost  # noqa: E402

pytestmark = pytest.mark.timeout(600)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(gated_engine)

ENGINE = {"max_model_len": 512, "max_num_seqs": 4, "apply_chat_template": False}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    rng = random.Random(0)
    out = []
    for d in range(10):
        doc = [rng.randrange(10, 200) for _ in range(64)]  # four 16-token blocks
        for q in range(2):
            out.append({"id": 10 * d + q, "prompt_token_ids": doc + [rng.randrange(10, 200)
                                                                      for _ in range(5)],
                        "sampling_params": {"max_tokens": MAX_TOKENS, "ignore_eos": True,
                                            "temperature": 0.0}})
    rng.shuffle(out)
    return out


@pytest.fixture(scope="module")
def offline(model: str, rows: list[dict[str, Any]]) -> dict[int, list[int]]:
    llm = LLM(model, max_model_len=512, max_num_seqs=32)
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in rows],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return {r["id"]: o.outputs[0].token_ids for r, o in zip(rows, outs)}


@pytest.fixture
def job(ray_local: None) -> Iterator[str]:
    job_id = f"t-{uuid.uuid4().hex}"
    yield job_id
    try:
        ray.kill(ray.get_actor(coordinator_name(job_id, ""), namespace=NAMESPACE))
    except ValueError:
        pass


def start_pair(model: str, job: str, frozen: bool) -> tuple[Any, Any, Any]:
    """(owner, other, the other's open call); migration_options leave affinity at its default."""
    opts = {"job_id": job, "interval_s": 0.1, "dead_after_s": 4.0}
    remote = ray.remote(PredictorHost).options(max_concurrency=4, num_cpus=0.25)
    owner = remote.remote(model=model, migration_options=opts, hold_for_move_after=0,
                          late_binding=True, migration=False, **ENGINE)
    other = remote.remote(model=model, migration_options=opts, frozen=frozen,
                          late_binding=True, migration=False, **ENGINE)
    ray.get([owner.counts.remote(), other.counts.remote()])
    side = other.busy.remote()
    while ray.get(other.active_calls.remote()) == 0:
        time.sleep(0.02)
    return owner, other, side


def check_once_and_equal(want: dict[int, list[int]], got: list[dict[str, Any]]) -> None:
    assert sorted(r["id"] for r in got) == sorted(want)  # none lost, none twice
    for r in got:
        assert r["error"] is None, r["error"]
        assert list(r["generated_token_ids"]) == want[r["id"]], r["id"]


def test_affinity_moves_queued_rows_exactly_once(job: str, model: str, rows: list[dict],
                                                 offline: dict[int, list[int]]) -> None:
    owner, other, side = start_pair(model, job, frozen=False)
    got = ray.get(owner.run.remote(rows))
    other.release.remote()
    assert ray.get(side)
    check_once_and_equal(offline, got)
    sent, took = ray.get(owner.counts.remote()), ray.get(other.counts.remote())
    stats = ray.get(ray.get_actor(coordinator_name(job, ""), namespace=NAMESPACE).stats.remote())
    assert stats["affinity_moves"] >= 7, stats  # the bound alone sends 7 rows over
    assert took["imported"] == sent["exported"] == sent["delivered"], (sent, took)
    assert sent["kv_shipped"] == 0, sent  # queued rows carry no KV
    for h in (owner, other):
        ray.kill(h)


def test_killing_the_importer_with_affinity_on_loses_no_row(
        job: str, model: str, rows: list[dict], offline: dict[int, list[int]]) -> None:
    owner, other, _ = start_pair(model, job, frozen=True)
    ref = owner.run.remote(rows)
    deadline = time.monotonic() + 60
    while ray.get(other.counts.remote())["imported"] == 0:
        assert time.monotonic() < deadline, "no row was ever moved"
        time.sleep(0.02)
    ray.kill(other, no_restart=True)
    check_once_and_equal(offline, ray.get(ref))
    c = ray.get(owner.counts.remote())
    assert c["exported"] >= 1 and c["reclaimed"] == c["exported"] and c["delivered"] == 0, c
    ray.kill(owner)
