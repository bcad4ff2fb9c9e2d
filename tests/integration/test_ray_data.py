"""Ray Data connector end to end on a local 2-CPU Ray with a tiny random Llama (its tokenizer
has a ChatML template).

Every good row must equal the offline output for the same prompt and seed (`LLM.chat` with the
prompt as one user turn, the default; `LLM.generate` with apply_chat_template=False); bad rows
must carry an error; no row may be lost or duplicated; input columns pass through; a dead engine
restarts its actor and the job still returns every row; a small job's stderr stays quiet.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import gc
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
# workers cannot import this test module: ship `DiesOnce` by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

from batchgen_data import LLM, SamplingParams  # noqa: E402
from batchgen_data.connectors.ray_data import (  # noqa: E402
    BatchGenPredictor, BatchGenProcessorConfig, build_processor)
from batchgen_data.connectors.ray.placement import GROUP_PREFIX, release_groups  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ENGINE = {"max_model_len": 64, "max_num_seqs": 64}
DEFAULTS = {"temperature": 0.0, "max_tokens": 8}
NO_OVERRIDE = {"max_tokens": None, "temperature": None, "seed": None, "temprature": None}


def _override(**kw: Any) -> dict[str, Any]:
    # every row has the same struct fields (Arrow needs one type); None means "not set"
    return {**NO_OVERRIDE, **kw}


def good_rows() -> list[dict[str, Any]]:
    rows = []
    for i in range(20):
        params = (_override(max_tokens=16, temperature=0.8, seed=100 + i) if i % 3 == 0
                  else _override(max_tokens=2 + i % 5) if i % 3 == 1 else None)
        rows.append({"id": i, "tag": f"t{i}", "prompt": f"The quick brown fox {i} jumps over",
                     "messages": None, "sampling_params": params})
    for i in range(20, 24):
        rows.append({"id": i, "tag": f"t{i}", "prompt": None, "sampling_params": None,
                     "messages": [{"role": "user", "content": f"Classify review {i}"}]})
    return rows


def bad_rows() -> list[dict[str, Any]]:
    base = {"tag": "bad", "messages": None, "sampling_params": None}
    return [
        {**base, "id": 100, "prompt": None},
        {**base, "id": 101, "prompt": ""},
        {**base, "id": 102, "prompt": "word " * 200},  # longer than max_model_len=64
        {**base, "id": 103, "prompt": None, "messages": [{"role": "user", "content": None}]},
        {**base, "id": 104, "prompt": "fine prompt", "sampling_params": _override(temprature=0.5)},
        {**base, "id": 105, "prompt": "fine prompt", "sampling_params": _override(max_tokens=0)},
    ]


def expected(llm: LLM, rows: list[dict[str, Any]], raw: bool = False) -> dict[int, Any]:
    """Offline outputs for the good rows, keyed by id."""
    out = {}
    for row in rows:
        overrides = {k: v for k, v in (row["sampling_params"] or {}).items() if v is not None}
        params = SamplingParams(**{**DEFAULTS, **overrides})
        prompt = row["prompt"]
        if prompt is None:
            out[row["id"]] = llm.chat([row["messages"]], params, use_tqdm=False)[0]
        elif raw:
            out[row["id"]] = llm.generate([prompt], params, use_tqdm=False)[0]
        else:  # apply_chat_template=True: a plain prompt is one user turn
            out[row["id"]] = llm.chat([{"role": "user", "content": prompt}], params,
                                      use_tqdm=False)[0]
    return out


def run(model: str, rows: list[dict[str, Any]], predictor: type = BatchGenPredictor,
        actors: int = 2, **kw: Any) -> list[dict[str, Any]]:
    ds = ray.data.from_items(rows)
    out = ds.map_batches(
        predictor, batch_size=8, batch_format="pyarrow",
        fn_constructor_kwargs=dict(model=model, sampling_params=DEFAULTS, **ENGINE, **kw),
        compute=ray.data.ActorPoolStrategy(size=actors, max_concurrent_calls_per_actor=3),
        num_cpus=0.5)
    return out.take_all()


def check_good(got: list[dict[str, Any]], good: list[dict[str, Any]], want: dict[int, Any]) -> None:
    by_id = {r["id"]: r for r in got}
    for row in good:
        out, ref = by_id[row["id"]], want[row["id"]]
        assert out["error"] is None, out["error"]
        assert out["tag"] == row["tag"] and out["prompt"] == row["prompt"]
        assert list(out["generated_token_ids"]) == ref.outputs[0].token_ids, row["id"]
        assert out["generated_text"] == ref.outputs[0].text
        assert out["finish_reason"] == ref.outputs[0].finish_reason
        assert out["num_prompt_tokens"] == len(ref.prompt_token_ids)
        assert out["num_generated_tokens"] == len(ref.outputs[0].token_ids)


@pytest.mark.parametrize("stream", [True, False])
def test_rows_match_offline_and_bad_rows_error(ray_local: None, model: str, llm: LLM,
                                               stream: bool) -> None:
    good, bad = good_rows(), bad_rows()
    got = run(model, good + bad, stream=stream)

    ids = [r["id"] for r in got]
    assert sorted(ids) == sorted(r["id"] for r in good + bad)  # none lost, none twice
    check_good(got, good, expected(llm, good))
    by_id = {r["id"]: r for r in got}
    messages = {100: "prompt is null", 101: "prompt is empty", 102: "max_model_len",
                103: "needs string 'role' and 'content'", 104: "unknown sampling parameter",
                105: "max_tokens"}
    for rid, fragment in messages.items():
        out = by_id[rid]
        assert fragment in out["error"], (rid, out["error"])
        assert out["generated_text"] == "" and len(out["generated_token_ids"]) == 0
        assert out["finish_reason"] is None and out["tag"] == "bad"


def test_whole_batch_mode_keeps_input_order(ray_local: None, model: str) -> None:
    rows = good_rows()[:16]
    got = run(model, rows, stream=False)
    # two input batches of 8, each returned whole and in order; batches may interleave
    for batch_start in (0, 8):
        ids = [r["id"] for r in got if batch_start <= r["id"] < batch_start + 8]
        assert ids == list(range(batch_start, batch_start + 8))


def test_on_error_raise_fails_the_job(ray_local: None, model: str) -> None:
    rows = good_rows()[:4] + bad_rows()[:1]
    with pytest.raises(Exception, match="prompt is null"):
        run(model, rows, on_error="raise")


def test_token_id_rows_and_build_processor(ray_local: None, model: str, llm: LLM) -> None:
    ids = llm.tokenizer.encode("Summarise paragraph 3")
    config = BatchGenProcessorConfig(model_source=model, concurrency=1, batch_size=4,
                                     engine_kwargs=ENGINE, sampling_params=DEFAULTS)
    processor = build_processor(
        config,
        preprocess=lambda row: {"id": row["id"], "prompt_token_ids": ids[: row["n"]]},
        postprocess=lambda row: {"id": row["id"], "answer": row["generated_text"],
                                 "error": row["error"]})
    got = sorted(processor(ray.data.from_items([{"id": i, "n": n} for i, n in
                                                enumerate([len(ids), 2, 1])])).take_all(),
                 key=lambda r: r["id"])
    for row, n in zip(got, [len(ids), 2, 1]):
        ref = llm.generate([{"prompt_token_ids": ids[:n]}], SamplingParams(**DEFAULTS),
                           use_tqdm=False)[0]
        assert set(row) == {"id", "answer", "error"} and row["error"] is None
        assert row["answer"] == ref.outputs[0].text


def test_processor_config_rejects_bad_values() -> None:
    with pytest.raises(TypeError, match="max_num_seq"):
        BatchGenProcessorConfig(engine_kwargs={"max_num_seq": 4})
    with pytest.raises(ValueError, match="concurrency"):
        BatchGenProcessorConfig(concurrency=(3, 2))
    with pytest.raises(TypeError, match="unknown sampling parameter"):
        BatchGenProcessorConfig(sampling_params={"temprature": 0.1})


def test_raw_prompts_without_the_chat_template(ray_local: None, model: str, llm: LLM) -> None:
    good = good_rows()[:8]
    got = run(model, good, apply_chat_template=False)
    raw, chat = expected(llm, good, raw=True), expected(llm, good)
    check_good(got, good, raw)
    # the two ways differ, so this test and the default one tell them apart
    assert any(raw[i].prompt_token_ids != chat[i].prompt_token_ids for i in raw)


def die_once(predictor: BatchGenPredictor, flag: str) -> None:
    """Kill `predictor`'s engine at the first step of the job, as a CUDA error would; only the
    first actor built does so (an exclusive flag file), so the restarted one serves the retry."""
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return

    def step() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    predictor.driver.engine.step = step


class DiesOnce(BatchGenPredictor):
    """The predictor, its engine killed at the first step of the first actor (`die_once`)."""

    def __init__(self, flag: str, **kw: Any) -> None:
        super().__init__(**kw)
        die_once(self, flag)


def test_a_dead_engine_restarts_the_actor_and_loses_no_row(ray_local: None, model: str,
                                                           llm: LLM, tmp_path: Path) -> None:
    good = good_rows()[:8]
    flag = tmp_path / "died"
    got = run(model, good, predictor=DiesOnce, flag=str(flag))
    assert flag.exists()  # the engine did die
    assert sorted(r["id"] for r in got) == [r["id"] for r in good]
    check_good(got, good, expected(llm, good))


class TwoRanks(BatchGenPredictor):
    """Fails its construction unless its engine is a group of two ranks."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        runner = self.driver.engine.runner
        assert type(runner).__name__ == "TPRunner" and runner.ranks.size == 2, runner


@pytest.mark.slow
def test_a_tensor_parallel_actor_and_its_restart(ray_local: None, model: str, llm: LLM,
                                                 tmp_path: Path) -> None:
    """`tensor_parallel_size=2` through the predictor: the actor is rank 0 and starts rank 1
    as its own process (docs/parallel.md); its rows equal the one-device offline engine's. Its
    engine then dies at the first step (`DiesOnce`): the actor restarts with a new pair of
    ranks and the job still returns every row once, with the same outputs."""
    good = good_rows()[:8]
    got = run(model, good, predictor=TwoRanks, actors=1, tensor_parallel_size=2)
    assert sorted(r["id"] for r in got) == [r["id"] for r in good]
    check_good(got, good, expected(llm, good))
    flag = tmp_path / "died"
    got = run(model, good, predictor=DiesOnce, actors=1, flag=str(flag), tensor_parallel_size=2)
    assert flag.exists()
    assert sorted(r["id"] for r in got) == [r["id"] for r in good]
    check_good(got, good, expected(llm, good))


class RanksInGroup(BatchGenPredictor):
    """Fails its construction unless its engine is two ranks, rank 1 a Ray actor in bundle 1 of
    the placement group this actor runs in (bundle 0)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        from ray.util import get_current_placement_group

        runner = self.driver.engine.runner
        assert type(runner).__name__ == "TPRunner" and runner.ranks.size == 2, runner
        (rank1,) = runner.ranks.handles
        assert type(rank1).__name__ == "_RayRank", rank1
        pg = get_current_placement_group()
        assert pg is not None and len(pg.bundle_specs) == 2
        table = ray.util.placement_group_table(pg)
        assert table["strategy"] == "PACK", table


class RanksInGroupDieOnce(RanksInGroup):
    """`RanksInGroup` whose first actor's engine dies at its first step (`die_once`)."""

    def __init__(self, flag: str, **kw: Any) -> None:
        super().__init__(**kw)
        die_once(self, flag)


@pytest.mark.slow
def test_a_tensor_parallel_processor_places_its_ranks_in_a_group(
        ray_local: None, model: str, llm: LLM, tmp_path: Path) -> None:
    """`build_processor` with `tensor_parallel_size=2` (ray.data.llm's way): each engine actor
    gets a placement group of two bundles (PACK), sits in bundle 0 as rank 0, and its engine
    starts rank 1 as a Ray actor in bundle 1 (`distributed_executor_backend="ray"`); rows equal
    the one-device offline engine's. Then an engine that dies at its first step: the actor
    restarts in its group, starts a new rank 1 there, and every row comes back once."""
    good = good_rows()[:8]
    want = expected(llm, good)

    def through(predictor: type, **kw: Any) -> list[dict[str, Any]]:
        config = BatchGenProcessorConfig(
            model_source=model, batch_size=4, concurrency=1, num_cpus=0.5,
            sampling_params=DEFAULTS, apply_chat_template=True,
            engine_kwargs=dict(ENGINE, tensor_parallel_size=2))
        processor = build_processor(config)
        processor.predictor, processor.predictor_kwargs = predictor, kw
        return processor(ray.data.from_items(good)).take_all()

    got = through(RanksInGroup)
    assert sorted(r["id"] for r in got) == [r["id"] for r in good]
    check_good(got, good, want)
    (first,) = own_groups()  # kept until the next engine actor starts (Ray Data says no "done")
    gc.collect()  # the finished Dataset lets its actor go
    wait_for(lambda: bundle_free(first), 120)
    flag = tmp_path / "died"
    got = through(RanksInGroupDieOnce, flag=str(flag))
    assert flag.exists()
    assert sorted(r["id"] for r in got) == [r["id"] for r in good]
    check_good(got, good, want)
    # the first job's group went when this job's actor started; this job's one is left
    (second,) = own_groups()
    assert second != first
    assert release_groups() == 1 and not own_groups()


def bundle_free(name: str) -> bool:
    """Whether bundle 0 of the named group has no actor in it."""
    pg = ray.util.get_placement_group(name)
    free = ray.available_resources()
    return free.get(f"CPU_group_0_{pg.id.hex()}", 0.0) >= pg.bundle_specs[0]["CPU"]


def wait_for(cond: Any, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def own_groups() -> list[str]:
    """The placement groups `build_processor` made that are still there."""

    return [g["name"] for g in ray.util.placement_group_table().values()
            if g["name"].startswith(GROUP_PREFIX) and g["state"] != "REMOVED"]


def test_a_killed_ray_rank_ends_the_engine_with_its_reason(ray_local: None, model: str,
                                                          llm: LLM) -> None:
    """An engine whose rank 1 is a Ray actor (in bundle 1 of the group its rank 0 runs in):
    its tokens equal the one-device engine's; with rank 1's actor killed, the next steps end
    the engine with EngineDeadError naming the rank and Ray's reason, within seconds, and
    every later call says so again."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0.25)
    class Rank0:
        def __init__(self) -> None:
            self.llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray",
                           **ENGINE)
            self.engine = self.llm.engine

        def greedy(self, prompt: list[int], n: int) -> list[int]:
            out = self.llm.generate([{"prompt_token_ids": prompt}],
                                    SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                    use_tqdm=False)
            return list(out[0].outputs[0].token_ids)

        def kill_rank_then_step(self) -> tuple[str, float, str]:
            from batchgen_data.engine.driver import EngineDeadError
            self.engine.submit([5, 6, 7], SamplingParams(max_tokens=50, temperature=0))
            self.engine.step()
            ray.kill(self.engine.runner.ranks.handles[0].actor)
            t0 = time.monotonic()
            try:
                while self.engine.has_unfinished():
                    self.engine.step()
            except EngineDeadError as exc:
                first = str(exc)
            else:
                return "", 0.0, ""
            took = time.monotonic() - t0
            try:
                self.engine.step()
            except EngineDeadError as exc:
                return first, took, str(exc)
            return first, took, ""

    pg = ray.util.placement_group([{"CPU": 0.25}, {"CPU": 0.25}])
    try:
        ray.get(pg.ready(), timeout=60)
        rank0 = Rank0.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0)).remote()
        prompt = [11, 12, 13, 14]
        want = llm.generate([{"prompt_token_ids": prompt}],
                            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
        assert ray.get(rank0.greedy.remote(prompt, 6), timeout=120) == list(want)
        first, took, again = ray.get(rank0.kill_rank_then_step.remote(), timeout=180)
        assert "rank 1 (a Ray actor) died" in first, first
        assert took < 30.0, took
        assert again, "a dead engine must stay dead"
    finally:
        ray.util.remove_placement_group(pg)


def test_ray_ranks_need_a_placement_group(ray_local: None, model: str) -> None:
    """`distributed_executor_backend="ray"` in a Ray task placed in no group, or in a group too
    small, is refused by name before any weight loads."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0.25)
    def build() -> str:
        try:
            LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
        except ValueError as exc:
            return str(exc)
        return "built"

    assert "runs in no placement group" in ray.get(build.remote(), timeout=120)
    pg = ray.util.placement_group([{"CPU": 0.25}])
    try:
        ray.get(pg.ready(), timeout=60)
        placed = build.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0)).remote()
        assert "the placement group has 1 bundles" in ray.get(placed, timeout=120)
    finally:
        ray.util.remove_placement_group(pg)


def test_importing_the_predictor_adds_the_row_streaming_rule_once() -> None:
    """`ds.map_batches(BatchGenPredictor, ...)` streams as written: the import that names the
    class puts the rule in the driver's optimizer (once), nothing else in Ray changes."""
    script = textwrap.dedent("""
        from ray.data._internal.logical.optimizers import get_physical_ruleset
        before = [r.__name__ for r in get_physical_ruleset()]
        from batchgen_data.connectors.ray_data import BatchGenPredictor
        assert [r.__name__ for r in get_physical_ruleset()] == before + ["StreamRowsRule"]
        import batchgen_data.connectors.ray_data as rd
        rd.build_processor(rd.BatchGenProcessorConfig())
        assert rd.enable_row_streaming() is True  # kept for old jobs: adds nothing more
        assert [r.__name__ for r in get_physical_ruleset()] == before + ["StreamRowsRule"]
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


QUIET_JOB = """
import sys, ray
from batchgen_data.connectors.ray_data import BatchGenProcessorConfig, build_processor
config = BatchGenProcessorConfig(model_source=sys.argv[1], concurrency=2,
                                 sampling_params={"max_tokens": 8, "temperature": 0.0},
                                 engine_kwargs={"max_model_len": 64})
ds = ray.data.from_items([{"id": i, "prompt": f"The quick brown fox {i}"} for i in range(20)])
rows = build_processor(config)(ds).take_all()
assert len(rows) == 20 and all(r["error"] is None for r in rows)
"""
# Lines Ray prints for any job, whatever it runs; each is justified in docs/row-errors.md.
RAY_OWN = {
    # ray.init() of a new local cluster when RAY_AUTH_MODE is unset; a library must not pick a
    # cluster's auth mode (RAY_AUTH_MODE=token keeps Ray's default and silences it)
    "auth": "Token authentication is enabled for this Ray cluster",
    # Ray Data ray.put()s every actor pool's map transformer and DataContext and creates the
    # actors with max_restarts=-1; only max_restarts=0 removes the line, and that would turn a
    # dead engine into a failed job instead of a restarted actor (test above)
    "restarts": "has constructor arguments in the object store and max_restarts > 0",
    # on a host this loaded (2 cores, several test runs) the new node can take over a minute to
    # report its CPUs ("0/0 CPU" in the progress log), and Ray Data warns that the first
    # operator is starved; on a machine that starts Ray in seconds it never appears
    "slow start": "Cluster resources are not enough to run any task from",
}
SEVERE = re.compile(r"WARNING|ERROR|Error|Warning|^\[\S+ \S+ [EWF] ")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_small_job_is_quiet(model: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    proc = subprocess.run([sys.executable, "-c", QUIET_JOB, model], capture_output=True,
                          text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    severe = [ln for ln in lines if SEVERE.search(ln)
              and not any(known in ln for known in RAY_OWN.values())]
    assert severe == [], "\n".join(severe)
    # Ray Data's periodic progress report (a progress bar on a terminal) is not counted
    shown = [ln for ln in lines if "logging_progress.py" not in ln]
    assert len(shown) <= 15, "\n".join(shown)
