"""The Spark connector on a real standalone cluster (tests/integration/spark_cluster.py): a
Master, a Worker and two executors of 1 core each, whose Python workers import batchgen_data
from a wheel shipped with `spark.archives`, never from the checkout.

  * `batchgen_udf` and `generate_df` equal offline `LLM.generate`, token for token;
  * the Databricks notebook runs against the cluster, its model given as a `file://` URL that
    each node copies once into its model cache (batchgen_data/models/sources.py);
  * an executor JVM and its Python workers SIGKILLed in the middle of a `generate_df` job: Spark
    retries the lost task (and recomputes the shuffle output that died with the executor) and
    the output holds every row exactly once, with the offline tokens.

One cluster serves the whole module (~1 min to start on 2 cores); the driver is a child process
of its own (one JVM holds one SparkContext, and the test session's `spark` is `local[2]`).
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pandas")

import spark_cluster  # noqa: E402
from spark_cluster import Cluster, ancestor_executor, kill_executor, start_cluster  # noqa: E402

from batchgen_data import LLM, SamplingParams  # noqa: E402
from batchgen_data.connectors.common import derive_seed  # noqa: E402
from batchgen_data.models import sources  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ENGINE = {"max_model_len": 64, "max_num_seqs": 4}  # 16 rows a task finish in 4 waves
GREEDY = {"temperature": 0.0, "max_tokens": 8}
SAMPLED = {"temperature": 0.8, "max_tokens": 12}  # unseeded: each row is seeded from its id
PROMPTS = [f"Row {i}: the quick brown fox " + "jumps " * (i % 5) for i in range(32)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if shutil.which("java") is None:
        pytest.skip("no java: a standalone Spark cluster needs a JVM")
    c = start_cluster(tmp_path_factory.mktemp("spark-cluster"))
    print(f"\nstandalone cluster {c.master_url} up in {c.started_in_s:.1f} s")
    try:
        yield c
    finally:
        left = c.stop()
        assert left == [], f"processes outlived the cluster: {left}"


def offline(llm: LLM, prompts: list[str], params: dict[str, Any],
            seeded: bool = False) -> list[list[int]]:
    sp = ([SamplingParams(**params, seed=derive_seed(0, str(i))) for i in range(len(prompts))]
          if seeded else SamplingParams(**params))
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def call(cluster: Cluster, job: str, timeout_s: float = 150, **kwargs: Any) -> Any:
    assert cluster.driver is not None
    try:
        return cluster.driver.call(job, timeout_s, **kwargs)
    except (RuntimeError, TimeoutError) as err:
        raise AssertionError(f"{err}\n{cluster.logs()}") from None


def test_executors_import_the_project_from_the_wheel(cluster: Cluster) -> None:
    probes = call(cluster, "probe", root=str(ROOT))
    assert len({p["cwd"] for p in probes}) == spark_cluster.EXECUTORS  # both executors ran
    for p in probes:
        site = os.path.join(p["cwd"], "bgsite")
        assert p["cwd"].startswith(str(cluster.work / "spark-work")), p
        assert p["file"].startswith(site + os.sep) and not p["file"].startswith(str(ROOT)), p
        assert p["module_files"] and all(d.startswith(site) for d in p["module_files"]), p
        assert p["checkout_on_path"] == [] and p["editable_hooks"] == [], p
        assert p["executable"] == str(cluster.executor_python), p


def test_udf_and_generate_df_equal_offline_generate(cluster: Cluster, model: str,
                                                    llm: LLM) -> None:
    rows = call(cluster, "udf", model=model, prompts=PROMPTS, params=GREEDY, engine=ENGINE)
    assert [r[0] for r in rows] == list(range(len(PROMPTS)))
    assert [r[3] for r in rows] == [None] * len(PROMPTS)
    assert [r[1] for r in rows] == offline(llm, PROMPTS, GREEDY)

    rows = call(cluster, "generate_df", model=model, prompts=PROMPTS, params=SAMPLED,
                engine=ENGINE)
    assert [r[0] for r in rows] == list(range(len(PROMPTS)))
    assert [r[1] for r in rows] == offline(llm, PROMPTS, SAMPLED, seeded=True)


def test_databricks_notebook_on_the_cluster(cluster: Cluster, model: str) -> None:
    url = Path(model).as_uri()  # as a shared mount would be named: file:///dbfs/models/x
    params = f"MODEL = {url!r}\nNUM_ROWS = 8\nMAX_TOKENS = 4\n"
    out = call(cluster, "notebook", timeout_s=200,
               path=str(EXAMPLES / "databricks_notebook.py"), params=params)
    assert "rows            8 (6 good, 2 errors)" in out, out
    assert "error      2  messages must be a non-empty list" in out, out
    assert "empty " in out and "tokens " in out and "rows/s" in out
    # both executors needed the model: one copy in the node's cache, no half-done one left
    cached = sorted(p.name for p in cluster.model_cache.iterdir())
    target = sources.cache_path(url, cluster.model_cache)
    assert cached == [target.name, target.name + ".lock"], cached
    assert sources.fetch(url, cluster.model_cache) == sources.Fetched(target, copied=False)


def test_a_killed_executor_loses_and_repeats_no_row(cluster: Cluster, model: str, llm: LLM,
                                                    tmp_path: Path,
                                                    record_property: Callable[..., None]
                                                    ) -> None:
    url = Path(model).as_uri()
    want = offline(llm, PROMPTS, SAMPLED, seeded=True)
    # the same job with a gate that never closes: the baseline, and warm workers for both
    calm = call(cluster, "killed_executor", model=url, prompts=PROMPTS, params=SAMPLED,
                engine=ENGINE, flag=str(tmp_path / "never"), after_rows=10**9)
    calm_s = calm["wall_s"]
    assert [r[1] for r in calm["rows"]] == want and calm["failed_tasks"] == 0

    flag = tmp_path / "gate"
    assert cluster.driver is not None
    cluster.driver.send("killed_executor", model=url, prompts=PROMPTS, params=SAMPLED,
                        engine=ENGINE, flag=str(flag), after_rows=4)
    deadline = time.monotonic() + 120
    while not (flag.exists() and flag.read_text()):
        assert time.monotonic() < deadline, f"the gate never closed\n{cluster.logs()}"
        assert cluster.driver.service.proc.poll() is None, cluster.logs()
        time.sleep(0.05)
    jvm = ancestor_executor(int(flag.read_text()))
    assert jvm is not None and jvm in cluster.executor_jvms()
    killed_at = time.time()
    victims = kill_executor(jvm)
    try:
        out = cluster.driver.result(240)
    except (RuntimeError, TimeoutError) as err:
        raise AssertionError(f"{err}\n{cluster.logs()}") from None
    ids = [r[0] for r in out["rows"]]
    lost = sorted(set(range(len(PROMPTS))) - set(ids))
    repeated = len(ids) - len(set(ids))
    recover_s = out["done_at"] - killed_at
    report = (f"executor kill: {len(victims)} processes (JVM + Python workers) killed; rows "
              f"lost {len(lost)}, repeated {repeated}; {out['failed_tasks']} task(s) failed and "
              f"retried; job done {recover_s:.1f} s after the kill ({out['wall_s']:.1f} s in "
              f"all, undisturbed run {calm_s:.1f} s)")
    print("\n" + report)
    record_property("executor_kill", report)
    assert lost == [] and repeated == 0 and ids == list(range(len(PROMPTS))), report
    assert [r[3] for r in out["rows"]] == [None] * len(PROMPTS)
    assert [r[1] for r in out["rows"]] == want  # the retried rows drew the same tokens
    assert out["failed_tasks"] >= 1  # the lost task ran again
