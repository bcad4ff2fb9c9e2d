"""A tiny emulated Ray Data job (lab/batchgen_lab/ray_emulated.py): real predictor, scheduler,
coordinator and migration over engines that sleep the cost model's step time.

The benchmark itself fails if a row is lost, repeated or stops at the wrong length; here we also
check that no arm beats the packing bound (no schedule splits a row across engines) and that the
report carries the simulator's BCT for the same configuration.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from batchgen_lab import ray_emulated  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.bench]


def test_tiny_emulated_job_with_a_straggler(ray_local: None, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--actors", "2", "--rows", "96", "--seeds", "1", "--arms", "tuned,migrate",
            "--stragglers", "0.5:2", "--scale", "0.05", "--max-num-seqs", "8",
            "--batch-size", "4", "--trace", str(tmp_path / "trace")]
    records = ray_emulated.main(argv)
    out = capsys.readouterr().out
    assert "EMULATED COMPUTE" in out and "bct_ratio_migration_vs_tuned_static" in out
    assert [r["arm"] for r in records] == ["tuned", "migrate"]
    for r in records:
        assert r["bct_ray_s"] >= 0.98 * r["packing_bound_s"] > 0
        assert 0.0 <= r["overhead"] < 1.0
    assert records[0]["vs_tuned"] == 1.0
    # the simulator replays Ray's own dispatch (whole 4-row batches) and gives its verdict
    assert "10% BCT rule" in out
    for r in records:
        assert r["replayed"] and r["agree"] in ("PASS", "FAIL") and r["bct_sim_s"] > 0
    # --resim: the same Ray figures, the simulator's recomputed from the printed lines and the
    # traces (no Ray job runs)
    (tmp_path / "out.txt").write_text(out)
    again = ray_emulated.main(argv + ["--resim", str(tmp_path / "out.txt")])
    for a, b in zip(records, again):
        assert (b["arm"], b["bct_ray_s"], b["moves"]) == (a["arm"], a["bct_ray_s"], a["moves"])
        assert b["replayed"] and b["bct_sim_s"] == pytest.approx(a["bct_sim_s"], rel=0.02)
