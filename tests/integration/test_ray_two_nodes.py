"""Ray Data on two nodes: a head and a worker raylet with their own object stores
(`two_node_ray.TwoNodeRay`), whose Python cannot import the checkout. The job ships the project
as the built wheel (`runtime_env={"py_modules": [the wheel's installed package]}`, plus an empty
`working_dir`, so that Ray adds neither the driver's cwd nor its script folder to the workers'
sys.path), as a cluster gets it (docs/cluster-ray.md).

Each engine actor asks for one unit of a resource every node has once, so the two actors run one
per node. Checked, with a tiny random Llama against offline `LLM.generate`:

* rows through `build_processor` and through `ds.map_batches(BatchGenPredictor, ...)` equal the
  offline tokens, with actors on both nodes, each importing `batchgen_data` from the wheel;
* a running sequence migrates from an engine on one node to one on the other with its KV
  (object store to object store, never through the coordinator) and still equals offline;
* the worker node killed mid-job (its raylet and every process under it, at once) at two points
  of its actor's work (after its first row, after a quarter of the job's rows), in completion
  order (the default) and in input order: a replacement node comes up (as an autoscaler would
  start one), Ray restarts the lost actor where an engine resource is free (the replacement, or
  the head once Ray Data has released the head's own idle actor) and retries its tasks, and every
  row comes back exactly once with the offline tokens; the coordinator (on the head) survives.
  Rows lost / repeated and the recovery times are printed per kill point.

One cluster serves the whole module (starting it costs ~10 s); a test that kills the worker
node leaves a new one in its place.
"""
from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

ray = pytest.importorskip("ray")

import pyarrow as pa  # noqa: E402

from batchgen_data import LLM, SamplingParams  # noqa: E402
from batchgen_data.connectors.ray.coordinator import NAMESPACE, coordinator_name  # noqa: E402
from batchgen_data.connectors.ray_data import (  # noqa: E402
    BatchGenPredictor, BatchGenProcessorConfig, build_processor)
from batchgen_data.connectors.ray.placement import release_groups  # noqa: E402
from batchgen_data.placement import TransferCost  # noqa: E402

import gated_engine  # noqa: E402
from gated_engine import PredictorHost  # noqa: E402
from local_ray import quiet_ray_data, start_local_ray  # noqa: E402
from two_node_ray import ENGINE, TwoNodeRay  # noqa: E402
from wheel_site import build_wheel, install_wheel  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# the nodes can import neither this module nor the fake: ship them by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(gated_engine)

ENGINE_KW = {"max_model_len": 128, "max_num_seqs": 8, "apply_chat_template": False}
ONE_PER_NODE = {ENGINE: 1}
BATCH = 4


class OnNode(BatchGenPredictor):
    """The predictor, each output row tagged with its actor's node and the `batchgen_data`
    file that actor imported; with `progress_dir`, it also appends a line per row it yields to
    a file named after its node (what the kill tests watch)."""

    def __init__(self, progress_dir: str | None = None, **kw: Any) -> None:
        self.progress_dir = progress_dir
        super().__init__(**kw)

    def __call__(self, batch: Any) -> Iterator[pa.Table]:
        import batchgen_data

        node = ray.get_runtime_context().get_node_id()
        for table in super().__call__(batch):
            n = table.num_rows
            if self.progress_dir is not None:
                with open(Path(self.progress_dir) / node, "a") as f:
                    f.write("row\n" * n)
            yield (table.append_column("node", pa.array([node] * n, pa.string()))
                   .append_column("package", pa.array([batchgen_data.__file__] * n, pa.string())))


class Host(PredictorHost):
    def where(self) -> tuple[str, str]:
        import batchgen_data

        return ray.get_runtime_context().get_node_id(), batchgen_data.__file__


@pytest.fixture(scope="module")
def wheel_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    return install_wheel(build_wheel(work), work / "site") / "batchgen_data"


@pytest.fixture(scope="module")
def cluster(wheel_package: Path) -> Iterator[TwoNodeRay]:
    was_local = ray.is_initialized()  # the suite's local Ray (`ray_local`): back afterwards
    if was_local:
        ray.shutdown()
    # short: Ray's unix socket paths under it must stay below 108 characters
    work = Path(tempfile.mkdtemp(prefix="bg2n-", dir="/tmp"))
    nodes = None
    try:
        nodes = TwoNodeRay(work, env={"HF_HUB_OFFLINE": "1"})
        job_dir = work / "job"
        job_dir.mkdir()
        ray.init(address=nodes.address, log_to_driver=False, configure_logging=False,
                 runtime_env={"py_modules": [str(wheel_package)], "working_dir": str(job_dir)})
        quiet_ray_data()
        yield nodes
    finally:
        ray.shutdown()
        if nodes is not None:
            nodes.stop()
        shutil.rmtree(work, ignore_errors=True)
        if was_local:
            start_local_ray()


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[..., Path]) -> str:
    return str(tiny_model_dir("llama"))


def make_rows(n: int, seed: int, max_tokens: tuple[int, int] = (4, 40)
              ) -> list[dict[str, Any]]:
    """Output lengths that vary (rows finish out of input order); every other row sampled with
    its own seed."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        sp: dict[str, Any] = {"max_tokens": rng.randint(*max_tokens), "ignore_eos": True,
                              "temperature": 0.0}
        if i % 2:
            sp.update(temperature=0.8, seed=1000 * seed + i)
        rows.append({"id": i, "prompt_token_ids": [rng.randint(3, 300) for _ in range(
            rng.randint(3, 12))], "sampling_params": sp})
    return rows


def offline(model: str, rows: list[dict[str, Any]]) -> dict[int, list[int]]:
    llm = LLM(model, max_model_len=128, max_num_seqs=16)
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in rows],
                        [SamplingParams(**r["sampling_params"]) for r in rows], use_tqdm=False)
    return {r["id"]: o.outputs[0].token_ids for r, o in zip(rows, outs)}


def lost_and_repeated(want: dict[int, list[int]], got: list[dict[str, Any]]
                      ) -> tuple[list[int], list[int]]:
    ids = [r["id"] for r in got]
    return sorted(set(want) - set(ids)), sorted({i for i in ids if ids.count(i) > 1})


def assert_offline_equal(want: dict[int, list[int]], got: list[dict[str, Any]]) -> None:
    lost, twice = lost_and_repeated(want, got)
    assert not lost and not twice, f"lost {lost}, twice {twice}"
    assert len(got) == len(want)
    for r in got:
        assert r["error"] is None, r["error"]
        assert list(r["generated_token_ids"]) == want[r["id"]], r["id"]


def both_actors_up(ds: Any) -> Any:
    """`ds`, run only once its pool's actors have all started: on a loaded machine one engine
    may otherwise take every input batch before the other one is up."""
    ds.context.wait_for_min_actors_s = 300
    return ds


def assert_from_the_wheel(packages: set[str], wheel_package: Path) -> None:
    # Ray unpacks the shipped folder on each node; no actor imported the checkout's copy
    assert packages and all("/runtime_resources/py_modules_files/" in p for p in packages), \
        packages
    assert all(p.endswith("/batchgen_data/__init__.py") for p in packages), packages


def test_the_nodes_cannot_import_the_checkout(cluster: TwoNodeRay, wheel_package: Path) -> None:
    import subprocess

    probe = subprocess.run([cluster.python, "-c", "import batchgen_data"], cwd=cluster.work,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'batchgen_data'" in probe.stderr

    @ray.remote(num_cpus=0.1, resources=ONE_PER_NODE)
    def where() -> tuple[str, str, list[str]]:
        import sys as worker_sys

        import batchgen_data

        return (ray.get_runtime_context().get_node_id(), batchgen_data.__file__,
                [p for p in worker_sys.path if "site-packages" not in p])

    got = ray.get([where.remote() for _ in range(2)], timeout=120)
    assert {g[0] for g in got} == {cluster.head, cluster.worker}
    assert_from_the_wheel({g[1] for g in got}, wheel_package)
    checkout = str(Path(__file__).resolve().parents[2])
    assert not any(p.startswith(checkout) for g in got for p in g[2]), got


def test_build_processor_rows_equal_offline_with_actors_on_both_nodes(
        cluster: TwoNodeRay, model: str, wheel_package: Path) -> None:
    rows = make_rows(24, seed=1)
    config = BatchGenProcessorConfig(model_source=model, batch_size=BATCH, concurrency=2,
                                     engine_kwargs={k: v for k, v in ENGINE_KW.items()
                                                    if k != "apply_chat_template"},
                                     apply_chat_template=False, resources=ONE_PER_NODE)
    processor = build_processor(config)
    processor.predictor = OnNode  # the seam: rows tagged with their actor's node
    got = both_actors_up(processor(ray.data.from_items(rows))).take_all()
    assert_offline_equal(offline(model, rows), got)
    assert {r["node"] for r in got} == {cluster.head, cluster.worker}
    assert_from_the_wheel({r["package"] for r in got}, wheel_package)


def test_map_batches_rows_equal_offline_with_actors_on_both_nodes(
        cluster: TwoNodeRay, model: str, wheel_package: Path) -> None:
    rows = make_rows(24, seed=2)
    got = both_actors_up(ray.data.from_items(rows).map_batches(
        OnNode, batch_size=BATCH, batch_format="pyarrow",
        fn_constructor_kwargs=dict(model=model, **ENGINE_KW),
        compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=2),
        num_cpus=0.5, resources=ONE_PER_NODE)).take_all()
    assert_offline_equal(offline(model, rows), got)
    assert {r["node"] for r in got} == {cluster.head, cluster.worker}
    assert_from_the_wheel({r["package"] for r in got}, wheel_package)


class RanksOnNodes(OnNode):
    """`OnNode` whose rows also carry the node of its engine's rank 1 (a Ray actor)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        (rank1,) = self.driver.engine.runner.ranks.handles
        self.rank1_node = ray.get(rank1.actor.node_id.remote(), timeout=60)

    def __call__(self, batch: Any) -> Iterator[pa.Table]:
        for table in super().__call__(batch):
            yield table.append_column("rank1_node",
                                      pa.array([self.rank1_node] * table.num_rows, pa.string()))


def test_a_tensor_parallel_engine_spans_both_nodes(cluster: TwoNodeRay, model: str,
                                                    wheel_package: Path) -> None:
    """`tensor_parallel_size=2` through `build_processor`: the actor's placement group has a
    bundle per rank, each asking for the engine resource every node has once, so PACK must put
    rank 0 on one node and rank 1 on the other; the ranks meet over gloo at their nodes'
    addresses, and the rows equal the one-device offline engine's."""
    rows = make_rows(12, seed=5)
    config = BatchGenProcessorConfig(model_source=model, batch_size=BATCH, concurrency=1,
                                     engine_kwargs={"max_model_len": 128, "max_num_seqs": 8,
                                                    "tensor_parallel_size": 2},
                                     apply_chat_template=False, resources=ONE_PER_NODE)
    processor = build_processor(config)
    processor.predictor = RanksOnNodes
    try:
        got = processor(ray.data.from_items(rows)).take_all()
    finally:  # its group holds the engine resource of both nodes: free them for the next tests
        assert release_groups() == 1
    assert_offline_equal(offline(model, rows), got)
    (rank0,), (rank1,) = {r["node"] for r in got}, {r["rank1_node"] for r in got}
    assert {rank0, rank1} == {cluster.head, cluster.worker}
    assert_from_the_wheel({r["package"] for r in got}, wheel_package)


def test_a_running_sequence_moves_to_the_other_node_with_its_kv(
        cluster: TwoNodeRay, model: str) -> None:
    job = f"t-{uuid.uuid4().hex}"
    # all four rows run at once; the owner holds after 12 steps (each row past
    # min_running_age), and a cost model that always favours shipping sends their KV
    placement = {"min_running_age": 8, "min_kv_gain_tokens": 16,
                 "transfer": TransferCost(1, 1e15, 1e15, 1.0, 0.0)}
    opts = {"job_id": job, "interval_s": 0.1, "placement": placement}
    remote = ray.remote(Host).options(max_concurrency=4, num_cpus=0.25, resources=ONE_PER_NODE)
    src = remote.remote(model=model, migration_options=opts, hold_for_move_after=12,
                        migration=True, **ENGINE_KW)
    dst = remote.remote(model=model, migration_options=opts, migration=True, **ENGINE_KW)
    try:
        (src_node, _), (dst_node, _) = ray.get([src.where.remote(), dst.where.remote()],
                                               timeout=120)
        assert {src_node, dst_node} == {cluster.head, cluster.worker}
        side = dst.busy.remote()  # a call open on the receiver: only such engines take work
        while ray.get(dst.active_calls.remote()) == 0:
            time.sleep(0.02)
        rows = [{"id": i, "prompt_token_ids": [5 + i, 17, 42, 9, 33, 21],
                 "sampling_params": {"max_tokens": 48, "ignore_eos": True, "temperature": 0.0}}
                for i in range(4)]
        got = ray.get(src.run.remote(rows), timeout=300)
        dst.release.remote()
        assert ray.get(side, timeout=120)
        assert_offline_equal(offline(model, rows), got)
        sent, took = ray.get([src.counts.remote(), dst.counts.remote()])
        assert sent["kv_shipped"] >= 1 and took["imported"] == sent["exported"], (sent, took)
        # the KV crossed from one node's object store to the other's, all of it
        assert sent["kv_bytes_sent"] > 0 and took["kv_bytes_received"] == sent["kv_bytes_sent"]
        stats = ray.get(ray.get_actor(coordinator_name(job, ""), namespace=NAMESPACE)
                        .stats.remote())
        assert stats["kv_bytes_relayed"] == 0, stats
    finally:
        for h in (src, dst):
            ray.kill(h)
        try:
            ray.kill(ray.get_actor(coordinator_name(job, ""), namespace=NAMESPACE))
        except ValueError:
            pass


KILL_ROWS = 32


@pytest.fixture(scope="module")
def kill_rows(model: str) -> tuple[list[dict[str, Any]], dict[int, list[int]]]:
    rows = make_rows(KILL_ROWS, seed=3, max_tokens=(16, 96))
    return rows, offline(model, rows)


# rows the worker node's actor has yielded when its node is killed: its first (its window full,
# most of its rows still to run), or half of its share (some calls done, others half way)
KILL_AFTER = {"early": 1, "mid": KILL_ROWS // 4}


@pytest.mark.parametrize("moment", ["early", "mid"])
@pytest.mark.parametrize("stream", [True, "ordered"], ids=["completion", "ordered"])
def test_the_worker_node_killed_mid_job_loses_and_repeats_no_row(
        cluster: TwoNodeRay, model: str, kill_rows: tuple[list[dict[str, Any]], dict],
        moment: str, stream: Any, tmp_path: Path) -> None:
    rows, want = kill_rows
    job = f"t-{uuid.uuid4().hex}"
    doomed = cluster.worker
    ds = ray.data.from_items(rows, override_num_blocks=KILL_ROWS // BATCH).map_batches(
        OnNode, batch_size=BATCH, batch_format="pyarrow",
        fn_constructor_kwargs=dict(model=model, stream=stream, progress_dir=str(tmp_path),
                                   **ENGINE_KW,
                                   # an engine silent 4 s counts as dead (10 s by default):
                                   # rows it had taken from the head's engine run there again
                                   migration_options={"job_id": job, "dead_after_s": 4.0}),
        compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=2),
        num_cpus=0.5, resources=ONE_PER_NODE)
    both_actors_up(ds)
    timeline: dict[str, float] = {}
    done = threading.Event()

    def yielded_on(node: str) -> int:
        try:
            return len((tmp_path / node).read_text().splitlines())
        except FileNotFoundError:
            return 0

    def kill_and_replace() -> None:
        while yielded_on(doomed) < KILL_AFTER[moment]:
            if done.wait(0.01):
                return
        timeline["kill"] = time.monotonic()
        timeline["yielded_before"] = yielded_on(doomed)
        cluster.kill_worker()
        timeline["killed"] = time.monotonic()
        cluster.add_worker()
        timeline["replaced"] = time.monotonic()

    got: list[dict[str, Any]] = []
    killer = threading.Thread(target=kill_and_replace)
    killer.start()
    t0 = time.monotonic()
    arrivals: list[float] = []
    try:
        # prefetch_batches=0: Ray's default (iter_rows too) holds each block until the next
        # one arrives, which would time a row by its successor
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow",
                                     prefetch_batches=0):
            got += batch.to_pylist()
            arrivals += [time.monotonic()] * batch.num_rows
    finally:
        done.set()
    killer.join(timeout=120)
    assert "replaced" in timeline, "the kill never happened"
    lost, twice = lost_and_repeated(want, got)
    new_node = [a for a, r in zip(arrivals, got) if r["node"] == cluster.worker]  # replacement
    record = {"stream": "completion" if stream is True else stream, "moment": moment,
              "yielded_before_kill": timeline["yielded_before"], "lost": len(lost),
              "repeated": len(twice),
              "kill_at_s": round(timeline["kill"] - t0, 2),
              "node_back_after_s": round(timeline["replaced"] - timeline["kill"], 2),
              "first_row_from_new_node_after_s":
                  round(min(new_node) - timeline["kill"], 2) if new_node else None,
              "job_end_after_kill_s": round(arrivals[-1] - timeline["kill"], 2),
              "rows_from_new_node": len(new_node),
              "rows_by_node": {name: sum(r["node"] == node for r in got) for name, node in (
                  ("head", cluster.head), ("lost", doomed), ("replacement", cluster.worker))},
              # rows (and placeholders) yielded by every attempt, beyond the job's rows
              "yielded_again": sum(yielded_on(p.name) for p in tmp_path.iterdir()) - KILL_ROWS}
    print("two-node kill:", json.dumps(record))
    assert_offline_equal(want, got)
    # the kill cut the lost node's work short: some of it was done again (by its restarted
    # actor on the replacement node, or by the head's actor)
    assert record["yielded_again"] > 0, record
    # the coordinator lives on the head: it outlived the worker node (on a loaded machine an
    # engine may have given up on it first: a coordinator call slower than `rpc_timeout_s` makes
    # that engine run its own rows, which loses nothing either)
    coordinator = ray.get_actor(coordinator_name(job, ""), namespace=NAMESPACE)
    stats = ray.get(coordinator.stats.remote(), timeout=30)
    print("two-node kill: coordinator saw", len(stats["engines_seen"]), "engines")
    ray.kill(coordinator)
