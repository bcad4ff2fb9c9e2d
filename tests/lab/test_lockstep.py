"""Expert-parallel lockstep groups: step-time model, exact decode runs, modes, re-partitioning."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from batchgen_lab.sim.__main__ import main
from batchgen_lab.sim.ep_preset import EP_PRESETS
from batchgen_lab.sim.lockstep import EP_MODES, EPMode, solo_decode_s
from batchgen_lab.sim.lockstep_run import EPCluster
from batchgen_lab.sim.scenario import ep_packing_bound, straggler_factors
from batchgen_lab.sim.workload import Workload

DSV3 = EP_PRESETS["ep-moe-dsv3"]
SMALL = replace(DSV3, seats_per_rank=8, prefill_budget=2048)  # seat pressure at a few rows


def tail_rows(rows: int, seed: int, cap: int = 1500) -> Workload:
    rng = np.random.default_rng(seed)
    out = np.minimum(np.rint(rng.lognormal(5.0, 1.0, rows)), cap).astype(np.int64) + 1
    return Workload("tail", rng.integers(32, 513, rows), out, cap + 1)


def test_a_step_waits_for_the_slowest_rank_and_idle_ranks_cost_a_dummy_step() -> None:
    r = DSV3.group_gpus
    one = np.zeros(r)
    one[0] = 1.0
    ones = np.ones(r)
    lone = DSV3.step_time(one, one, one * 4000, ones)
    assert lone > DSV3.c_fixed + DSV3.c_dense  # dummy ranks, experts and all-to-all still run
    # the same 64 sequences on one rank or spread over all: spreading shortens the step
    piled, spread = np.zeros(r), np.full(r, 4.0)
    piled[0] = 64.0
    assert DSV3.step_time(spread, spread, spread * 4000, ones) < \
        DSV3.step_time(piled, piled, piled * 4000, ones)
    slow = ones.copy()
    slow[5] = 1.5  # a straggler gates the group even with no sequence of its own
    assert DSV3.step_time(one, one, one * 4000, slow) > lone
    # full ranks near the published per-GPU decode rate (LMSYS: 2,790 tok/s on H100)
    assert 2000 < DSV3.anchor_tokens_per_gpu_s() < 6000
    assert DSV3.expert_share(0) == 0.0 and DSV3.expert_share(10_000) == pytest.approx(1.0)


def test_one_row_alone_takes_exactly_its_summed_step_times() -> None:
    wl = Workload("one", np.array([700]), np.array([900]), 1000)
    res = EPCluster(wl, 16, DSV3, EPMode("continuous")).run()
    r = DSV3.group_gpus
    one = np.zeros(r)
    one[0] = 1.0
    # the prefill step: 700 new tokens, no decoding sequence yet (so no per-sequence cost)
    brute = DSV3.step_time(one * 0, one * 700, one * 700, np.ones(r))
    for j in range(1, 900):
        brute += DSV3.step_time(one, one, one * (700 + j), np.ones(r))
    assert res.bct_s == pytest.approx(brute, rel=1e-9)
    assert res.bct_s >= solo_decode_s(DSV3, 700, 900) * (1 - 1e-9)


@pytest.mark.parametrize("mode", EP_MODES)
def test_every_row_finishes_once_in_every_mode(mode: str) -> None:
    wl = tail_rows(700, seed=1)
    f = straggler_factors(64, 0.125, 1.5, seed=1)
    c = EPCluster(wl, 64, SMALL, EPMode(mode, tick_s=0.2), f)
    res = c.run()
    assert not np.isnan(res.finish_time).any() and c.done == wl.num_rows
    assert all(n == 0 for n in c.in_flight) and all(n == 0 for n in c.batch_left)
    for g in c.groups:
        assert g.active() == 0 and not g.arrivals and not g.shared and not any(g.queues)
    assert res.bct_s >= ep_packing_bound(wl, SMALL) * (1 - 1e-9)
    if mode.startswith("migrate"):
        assert c.tail_group is not None and res.moved.get("tail", 0) > 0
        assert max(g.gpu_f.max() for g in c.groups) > c.groups[c.tail_group].gpu_f.max() or \
            len({g.gpu_f.max() for g in c.groups}) == 1
    else:
        assert not res.moved


def test_with_stragglers_migration_beats_streaming_and_tuned_static() -> None:
    wl = tail_rows(900, seed=2, cap=3000)
    f = straggler_factors(64, 0.125, 1.5, seed=2)
    bct = {m: EPCluster(wl, 64, SMALL, EPMode(m, tick_s=0.2), f).run().bct_s
           for m in ("static", "static-tuned", "continuous", "migrate")}
    assert bct["migrate"] <= bct["continuous"] and bct["migrate"] <= bct["static-tuned"]
    assert bct["static-tuned"] <= bct["static"]


def test_the_tail_re_partitions_into_wider_ranks() -> None:
    wl = Workload("long", np.array([500, 300]), np.array([8000, 40]), 8001)
    base = EPCluster(wl, 16, DSV3, EPMode("migrate")).run()
    wide = EPCluster(wl, 16, DSV3, EPMode("migrate-repartition")).run()
    assert base.reshards == 0 and wide.reshards >= 1
    assert wide.bct_s < base.bct_s  # TP2+ steps are faster than the 2 s pause costs here
    assert wide.bct_s >= solo_decode_s(DSV3, 500, 8000)


def test_a_reshard_pauses_for_the_weights_it_moves_each_way() -> None:
    # the sourced preset: the fixed pause plus the KV at the link's rate, whichever way
    kv = 10_000.0
    link = DSV3.reshard_s + kv * DSV3.kv_bytes_per_token / DSV3.link_bytes_per_s
    assert DSV3.reshard_pause(1, 2, kv) == pytest.approx(link)
    assert DSV3.reshard_pause(2, 1, kv) == pytest.approx(link)
    # measured rates (lab/scripts/repartition_sim.py): seconds per GB of one GPU's non-expert
    # weights, up and down apart, and the KV at its own rate
    m = replace(DSV3, reshard_s_per_weight_gb_up=1.5, reshard_s_per_weight_gb_down=9.0,
                reshard_kv_bytes_per_s=1e9)
    kv_s = kv * DSV3.kv_bytes_per_token / 1e9
    assert m.reshard_pause(1, 4, kv) == pytest.approx(DSV3.reshard_s + 1.5 * 15 + kv_s)
    assert m.reshard_pause(4, 2, kv) == pytest.approx(DSV3.reshard_s + 9.0 * 15 + kv_s)
    # the one long row's job is longer by the extra pause of each widening
    wl = Workload("long", np.array([500, 300]), np.array([8000, 40]), 8001)
    fast = EPCluster(wl, 16, DSV3, EPMode("migrate-repartition")).run()
    slow = EPCluster(wl, 16, replace(DSV3, reshard_s_per_weight_gb_up=1.0),
                     EPMode("migrate-repartition")).run()
    assert slow.reshards == fast.reshards >= 1
    assert slow.bct_s == pytest.approx(fast.bct_s + 15.0 * slow.reshards, abs=0.5)


def test_command_line_runs_the_expert_parallel_preset(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "report.json"  # its own file: the suite's Ray driver may print to stdout
    assert main(["--preset", "ep-moe-dsv3", "--actors", "32", "--rows", "64", "--workload",
                 "uniform", "--json", "--jobs", "1", "--stragglers", "0.125:1.5",
                 "--modes", "static-tuned,continuous,migrate-repartition",
                 "--json-out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["gpus"] == 32 and set(rep["bct_s"]) == {"static-tuned", "continuous",
                                                        "migrate-repartition"}
    assert rep["ratio_vs_tuned_static"]["static-tuned"] == 1.0
    assert 0 < rep["packing_bound_s"] <= min(rep["bct_s"].values())
    with pytest.raises(ValueError, match="gpus"):
        EPCluster(Workload("x", np.array([1]), np.array([1]), 1), 20, DSV3, EPMode("static"))
