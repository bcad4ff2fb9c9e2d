"""The fair comparison: every mode on the same engine, tuned static, stragglers, skew, seeds."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from batchgen_lab.sim import (MODES, Cluster, CostModel, EngineShape, SimConfig, compare,
                               evaluate, make_workload, mode_config)
from batchgen_lab.sim.__main__ import main
from batchgen_lab.sim.scenario import parse_stragglers, startup_delays, straggler_factors
from batchgen_lab.sim.workload import Workload

LINEAR = CostModel("test-linear", c0=2e-3, c_tok=50e-6, c_kv=2e-7, c_seq=0.4e-3,
                   bytes_per_token=4096, kv_capacity_tokens=400_000,
                   pcie_bytes_per_s=10e9, link_bytes_per_s=5e9)


def heavy_tail(rows: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    out = np.minimum(np.rint(rng.lognormal(4.5, 1.2, rows)), 2048).astype(np.int64) + 1
    return Workload("tail", rng.integers(32, 257, rows), out, 2049)


def test_static_tuned_fills_the_seats_as_rays_warning_asks() -> None:
    tuned = mode_config("static-tuned", 1024, batch_size=32, max_concurrent_batches=8)
    assert tuned.max_concurrent_batches == 32 and tuned.static and not tuned.migrate
    assert mode_config("static-tuned", 100, batch_size=32).max_concurrent_batches == 8
    assert mode_config("static", 1024).max_concurrent_batches == 8
    assert mode_config("late-bind", 64).movable == ("waiting",)
    assert set(mode_config("migrate", 64).movable) == {"waiting", "held", "running"}
    assert mode_config("continuous", 64).movable == ()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tuned_static_is_never_slower_than_default_static_when_rows_are_plenty(seed: int) -> None:
    # 64 seats, default feed 4 x 8 = 32 rows in flight; tuned 4 x 16 = 64
    wl = make_workload("uniform", 2400, seed)
    res = compare(wl, 3, LINEAR, EngineShape(64), ("static", "static-tuned"),
                  batch_size=4, max_concurrent_batches=8)
    assert max(n for tr in res["static"].traces for _, n in tr) <= 32
    assert max(n for tr in res["static-tuned"].traces for _, n in tr) > 32
    assert res["static-tuned"].bct_s <= res["static"].bct_s


@pytest.mark.parametrize("seed", [0, 1])
def test_with_stragglers_migration_is_not_slower_than_streaming(seed: int) -> None:
    wl = heavy_tail(2400, seed)
    slowdown = straggler_factors(8, 0.25, 2.0, seed)
    res = compare(wl, 8, LINEAR, EngineShape(32), ("continuous", "late-bind", "migrate"),
                  slowdown=slowdown, batch_size=4)
    assert res["migrate"].bct_s <= res["continuous"].bct_s
    assert res["late-bind"].moved.get("running", 0) == res["late-bind"].moved.get("held", 0) == 0
    assert res["migrate"].moved.get("running", 0) > 0


def test_a_straggler_is_slower_by_exactly_its_factor() -> None:
    # one actor, ample memory (nothing swaps over PCIe): every step costs `factor` times more
    wl = heavy_tail(300, seed=3)
    cost = replace(LINEAR, kv_capacity_tokens=2_000_000)
    mode = mode_config("continuous", 32)
    base = Cluster(wl, 1, cost, EngineShape(32), mode).run().bct_s
    slow = Cluster(wl, 1, cost, EngineShape(32), mode, slowdown=[1.5]).run().bct_s
    assert slow == pytest.approx(1.5 * base, rel=1e-9)


def test_an_actor_takes_no_rows_before_it_starts() -> None:
    wl = heavy_tail(300, seed=4)
    mode = mode_config("continuous", 32)
    base = Cluster(wl, 1, LINEAR, EngineShape(32), mode).run().bct_s
    late = Cluster(wl, 1, LINEAR, EngineShape(32), mode, start_at=[7.0]).run().bct_s
    assert late == pytest.approx(base + 7.0, rel=1e-9)
    for name in ("static", "migrate"):  # the late actor gets rows only once it is up
        c = Cluster(heavy_tail(800, seed=5), 3, LINEAR, EngineShape(16),
                    mode_config(name, 16, batch_size=4), start_at=[0.0, 0.0, 3.0])
        assert c.run().rows_finished == 800
        late_rows = np.flatnonzero(c.finished_by == 2)
        assert len(late_rows) > 0
        bound = c.batch_bound_at[np.array(c.batch_home) == 2]
        assert (bound >= 3.0).all() and (c.finish[late_rows] > 3.0).all()


def test_stragglers_and_delays_are_drawn_per_seed() -> None:
    assert parse_stragglers("0.125:1.5") == (0.125, 1.5) and parse_stragglers(None) == (0.0, 1.0)
    for bad in ("1.5", "2:1.5", "0.5:0", "a:b"):
        with pytest.raises(ValueError, match="stragglers"):
            parse_stragglers(bad)
    f0 = straggler_factors(16, 0.125, 1.5, seed=0)
    assert sorted(f0) == [1.0] * 14 + [1.5] * 2 and f0 == straggler_factors(16, 0.125, 1.5, 0)
    assert any(straggler_factors(16, 0.125, 1.5, s) != f0 for s in range(1, 6))
    d = startup_delays(16, 30.0, seed=0)
    assert len(d) == 16 and 0.0 <= min(d) and max(d) <= 30.0 and len(set(d)) == 16
    assert startup_delays(4, 0.0, seed=0) == [0.0] * 4


def test_evaluate_reports_medians_ratios_and_the_packing_bound() -> None:
    cfg = SimConfig(actors=3, rows=400, workload="uniform", seeds=3, preset="cpu-smollm2", max_num_seqs=32,
                    batch_size=4, stragglers="0.34:1.5", startup_skew_s=2.0, tick_s=2.0)
    rep = evaluate(cfg)
    assert rep["seeds"] == [0, 1, 2] and set(rep["bct_s"]) == set(MODES)
    for m in MODES:
        runs = rep["bct_s_by_seed"][m]
        assert len(runs) == 3 and rep["bct_s"][m] == pytest.approx(float(np.median(runs)), abs=1e-3)
        assert rep["bct_s_spread"][m] == [min(runs), max(runs)]
        for b, r in zip(rep["packing_bound_s_by_seed"], runs):
            assert r >= b  # no schedule beats the longest row alone
    assert rep["ratio_vs_tuned_static"]["static-tuned"] == 1.0
    assert rep["ratio_vs_continuous"]["continuous"] == 1.0
    tuned = rep["bct_s_by_seed"]["static-tuned"]
    want = float(np.median([a / b for a, b in zip(rep["bct_s_by_seed"]["migrate"], tuned)]))
    assert rep["ratio_vs_tuned_static"]["migrate"] == pytest.approx(want, abs=1e-4)
    assert rep["static_feed"]["static-tuned"]["max_concurrent_batches"] == 8  # ceil(32 / 4)
    again = evaluate(replace(cfg, seed=1, seeds=1, modes=("migrate",)))  # deterministic
    assert again["bct_s_by_seed"]["migrate"] == rep["bct_s_by_seed"]["migrate"][1:2]


def test_command_line_seeds_stragglers_skew(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "report.json"  # its own file: the suite's Ray driver may print to stdout
    assert main(["--actors", "2", "--rows", "200", "--workload", "uniform", "--json", "--jobs", "1", "--seeds", "2",
                 "--stragglers", "0.5:2", "--startup-skew", "1.5", "--preset", "cpu-smollm2",
                 "--tick", "2", "--max-num-seqs", "32", "--modes", "static-tuned,continuous,migrate",
                 "--json-out", str(out)]) == 0
    rep = json.loads(out.read_text())
    capsys.readouterr()
    assert set(rep["bct_s"]) == {"static-tuned", "continuous", "migrate"}
    assert rep["stragglers"] == "0.5:2" and rep["startup_skew_s"] == 1.5
    assert len(rep["bct_s_by_seed"]["migrate"]) == 2 and rep["packing_bound_s"] > 0
    assert main(["--actors", "2", "--rows", "100", "--jobs", "1", "--modes", "static,migrate",
                 "--preset", "a100-qwen0.5b", "--max-num-seqs", "32"]) == 0
    assert "packing bound" in capsys.readouterr().out
