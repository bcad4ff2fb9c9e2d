"""Floors on the expert-parallel cluster's BCT: the work bound and the packing floor."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from batchgen_lab.sim.__main__ import main
from batchgen_lab.sim.ep_bounds import (packing_floor_s, solo_decode_s, work_bound_s,
                                         workload_work)
from batchgen_lab.sim.ep_preset import EP_PRESETS
from batchgen_lab.sim.lockstep import EPMode
from batchgen_lab.sim.lockstep_run import EPCluster
from batchgen_lab.sim.scenario import straggler_factors
from batchgen_lab.sim.workload import Workload, make_workload


def run_json(args: list[str], tmp_path: Path) -> dict:
    """The command's JSON report, read from its own file (`--json-out`), never from stdout,
    where the suite's Ray driver may print a cluster message."""
    out = tmp_path / "report.json"
    assert main(args + ["--json-out", str(out)]) == 0
    return json.loads(out.read_text())


DSV3 = EP_PRESETS["ep-moe-dsv3"]
SMALL = replace(DSV3, seats_per_rank=8, prefill_budget=2048)


def test_the_workload_work_counts_tokens_and_kv_reads_as_the_cluster_does() -> None:
    wl = Workload("two", np.array([10, 4]), np.array([3, 1]), 3)
    # row 0: prefill reads 10, decode steps read 11 and 12; row 1: prefill only, reads 4
    assert workload_work(wl).tolist() == [2.0, 14.0, 10 + 11 + 12 + 4]


def test_without_stragglers_the_work_bound_is_the_even_split_of_the_cheapest_steps() -> None:
    wl = make_workload("reasoning", 2000, seed=3)
    d, pre, kv = workload_work(wl)
    p, g = DSV3, DSV3.group_gpus
    full = g * p.seats_per_rank  # DP16 with every seat taken has the cheapest fixed work a seat
    fixed = g * (p.c_fixed + p.c_dense) / g + p.t_experts * p.expert_share(full) + p.a2a_fixed
    tok = p.c_tok / g + p.c_moe / g + p.a2a_tok / g
    per_group = d * (fixed / full + tok + p.c_seq / g) + pre * tok + kv * p.c_kv / g
    assert work_bound_s(wl, p, np.ones(64)) == pytest.approx(per_group / 4, rel=1e-9)


@pytest.mark.parametrize("seed", [0, 1])
def test_no_mode_beats_either_floor_and_stragglers_raise_both(seed: int) -> None:
    rng = np.random.default_rng(seed)
    wl = Workload("t", rng.integers(32, 700, 900),
                  np.minimum(np.rint(rng.lognormal(5.5, 1.0, 900)), 3000).astype(np.int64) + 1,
                  3001)
    f = np.asarray(straggler_factors(64, 0.125, 1.5, seed))
    work, pack = work_bound_s(wl, SMALL, f), packing_floor_s(wl, SMALL, f)
    assert work > work_bound_s(wl, SMALL, np.ones(64))
    assert pack >= packing_floor_s(wl, SMALL) * (1 - 1e-12)
    for mode in ("static-tuned", "continuous", "migrate", "migrate-repartition"):
        bct = EPCluster(wl, 64, SMALL, EPMode(mode, tick_s=0.2), f.tolist()).run().bct_s
        assert bct >= max(work, pack) * (1 - 1e-9), mode


def test_a_lone_row_on_a_group_with_a_straggler_waits_for_its_dummy_steps() -> None:
    slow = np.ones(16)
    slow[5] = 1.5  # the lone row sits on a fast rank; the slow rank's dummy step still gates
    assert solo_decode_s(DSV3, 500, 4000, slow) > solo_decode_s(DSV3, 500, 4000)
    assert solo_decode_s(DSV3, 500, 4000, np.full(16, 1.5)) > solo_decode_s(DSV3, 500, 4000, slow)


def test_the_report_and_table_state_the_bounds_and_the_verdict(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    args = ["--preset", "ep-moe-dsv3", "--actors", "32", "--rows", "300", "--jobs", "1",
            "--stragglers", "0.125:1.5", "--modes", "static-tuned,continuous"]
    b = run_json(args + ["--json"], tmp_path)["bounds"]
    capsys.readouterr()
    assert 0 < b["work_bound_s"] and 0 < b["packing_floor_s"]
    assert b["goal_ratio"] == 2.3
    assert b["goal_reachable_in_model"] == (b["max_achievable_ratio"] >= 2.3)
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "work bound" in table and "max achievable ratio" in table
    assert ("UNREACHABLE" in table) != b["goal_reachable_in_model"]


def test_diagnosis_charges_every_unit_of_work_once_and_follows_the_last_row(tmp_path: Path) -> None:
    from batchgen_lab.sim.ep_bounds import group_unit_costs

    args = ["--preset", "ep-moe-dsv3", "--actors", "64", "--rows", "400", "--jobs", "1",
            "--stragglers", "0.125:1.5", "--modes", "static-tuned,migrate-repartition+pin",
            "--diagnose", "--json"]
    rep = run_json(args, tmp_path)
    wl = make_workload("reasoning", 400, seed=0)
    ideal_all = float(workload_work(wl) @ group_unit_costs(DSV3, np.ones(16)))
    for mode, d in rep["diagnosis"].items():
        phases = [d[p] for p in ("ramp", "steady", "tail")]
        # each phase is rounded to 0.1 group-s in the report
        assert sum(x["ideal"] for x in phases) == pytest.approx(ideal_all, abs=0.16), mode
        for x in phases:  # the four parts add up to the phase's group time
            assert x["ideal"] + x["straggler"] + x["lockstep"] + x["underfill"] == \
                pytest.approx(x["group_s"], abs=0.5)
        assert d["bct_s"] == pytest.approx(rep["bct_s"][mode], abs=1e-3)
        assert d["last_row"]["finish_s"] == pytest.approx(d["bct_s"], abs=0.1)
    assert rep["diagnosis"]["static-tuned"]["last_row"]["hops"] == 0
