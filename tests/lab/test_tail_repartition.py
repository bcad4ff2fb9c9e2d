"""lab/batchgen_lab/tail_repartition.py: the TP step ratio against the cost model written out by
hand, the tail's re-partition on a three-row run whose answer is worked out below, and a tiny
end-to-end run whose arms never beat the critical path their binding leaves."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from batchgen_lab import tail_repartition as tr
from batchgen_lab.sim.costmodel import PRESETS

COLL = tr.Collectives(2.0, 2.0, "test")


def test_tp_ratio_is_the_cost_model_split_by_hand() -> None:
    c = PRESETS["h200-llama8b"]
    kv = 4000.0
    one = c.c0 + c.c_seq + c.c_mem + c.c_tok + c.c_kv * kv
    calls = 2 * 32 + 2
    coll = calls * 10e-6 + ((calls - 1) * 4096 * 2 * 1.0 + 128256 * 2 / 2) / 450e9
    two = c.c0 + c.c_seq + (c.c_mem + c.c_tok + c.c_kv * kv) / 2 + coll
    got = tr.tp_ratio(c, 2, kv, COLL, 10e-6, 450e9)
    assert got == pytest.approx(two / one, rel=1e-9)
    wider = [tr.tp_ratio(c, k, kv, COLL, 10e-6, 450e9) for k in (1, 2, 4, 8)]
    assert wider[0] == 1.0 and wider == sorted(wider, reverse=True)  # wider is faster here
    # with a slow link the collectives eat the gain
    assert tr.tp_ratio(c, 2, kv, COLL, 200e-6, 450e9) > 1.0


def test_join_width_takes_fast_actors_a_node_at_most() -> None:
    assert [tr.join_width(n, 14) for n in (1, 2, 3, 4, 7, 8)] == [8, 4, 4, 2, 2, 1]


def _run(finish: list[float], bound: list[float], by: list[int]) -> SimpleNamespace:
    return SimpleNamespace(finish_time=np.array(finish), bound_at_s=np.array(bound),
                           finished_by=np.array(by))


def test_the_tail_joins_once_its_rows_are_few() -> None:
    # rows end at 10, 20, 30 s; all bound at 0; 16 actors, actor 1 a 2x straggler
    factors = [1.0, 2.0] + [1.0] * 14
    run = _run([10.0, 20.0, 30.0], [0.0, 0.0, 0.0], [0, 0, 1])

    def half(k: int, row: int) -> float:
        return {2: 0.8, 4: 0.6, 8: 0.5}[k]

    # J=1: joins at 20 s (one row left, 10 s on the straggler = 5 s at a fast pace), 8 wide
    bct, info = tr.repartitioned_bct(run, factors, 1, 1.0, half)
    assert info["k"] == 8 and info["t_join"] == 20.0
    assert bct == pytest.approx(20.0 + 1.0 + 5.0 * 0.5)
    # J=2: joins at 10 s, two rows 4 wide (15 fast actors // 2 -> 4): row 2 has 10 s left,
    # row 3 20 s on the straggler = 10 s fast; both at 0.6 after a 1 s pause
    bct, info = tr.repartitioned_bct(run, factors, 2, 1.0, half)
    assert info["k"] == 4 and bct == pytest.approx(10.0 + 1.0 + 10.0 * 0.6)
    # widening: row 2 ends at 17 s, row 3 has 10 - 6/0.6 = 0 s left: it ends with it
    bct_w, info = tr.repartitioned_bct(run, factors, 2, 1.0, half, widen=True)
    assert bct_w == pytest.approx(17.0)
    # rows bound late: the join waits for the last binding
    late = _run([10.0, 20.0, 30.0], [0.0, 0.0, 25.0], [0, 0, 0])
    bct, info = tr.repartitioned_bct(late, factors, 2, 1.0, half)
    assert info["t_join"] == 25.0 and bct == pytest.approx(25.0 + 1.0 + 5.0 * 0.5)


def test_per_row_widths_worked_out_by_hand() -> None:
    """Two rows left at 10 and 30 s, 4 fast actors: the oracle widens the longer row, then the
    shorter (each saving pays the 1 s pause), and when the short one ends at 9 s gives the long
    one the freed actors (4 wide from 10 s): 20 s left at 0.6 ends at 22 s."""
    run = _run([10.0, 30.0], [0.0, 0.0], [0, 0])
    ratio = {1: 1.0, 2: 0.8, 4: 0.6, 8: 0.5}
    bct = tr.greedy_bct(run, [1.0] * 4, 1.0, lambda k, r: ratio[k])
    assert bct == pytest.approx(22.0)
    # oldest first, always widening: the same here (row 1 has produced more)
    assert tr.greedy_bct(run, [1.0] * 4, 1.0, lambda k, r: ratio[k],
                         lambda r, left: float(r)) == pytest.approx(22.0)


@pytest.mark.bench
@pytest.mark.timeout(300)
def test_tiny_run_prints_its_table_and_json(capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    # the figures come from the run's own file: the suite's Ray driver may print to stdout
    summary = tr.main(["--actors", "4", "--rows", "192", "--seeds", "2", "--max-num-seqs", "8",
                       "--batch-size", "4", "--stragglers", "0.25:1.5", "--join-below", "1,2",
                       "--json-out", str(tmp_path / "out.json")])
    assert "SIMULATED: 4 actors" in capsys.readouterr().out
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["summary"] == summary
    assert summary["seeds"] == 2 and summary["goal"] == 0.70
    rows = written["per_seed"]
    assert [r["seed"] for r in rows] == [0, 1]
    for r in rows:  # a 2 s pause at most 1 row wide on 3 fast actors: J1 may join 2 wide
        assert r["J1_src_x"] <= r["migrate_x"] + 2.0 / r["tuned_s"] + 1e-3


def test_collectives_fit_and_the_expert_parallel_preset_rebased() -> None:
    """The TP step's collectives as tp_step.py counted them at two depths (rank 0's model
    counters: 10 calls at 4 layers, 18 at 8), and the EP preset's per-step TP collective
    re-based on that count (lab/scripts/repartition_sim.py --collectives)."""
    import importlib.util

    def run(layers: int, calls: float) -> dict[str, object]:
        return {"model": {"num_hidden_layers": layers},
                "rows": [{"tp": 2, "model_calls_per_step": calls},
                         {"tp": 1, "model_calls_per_step": 0.0}]}

    fit = tr.Collectives.fit([run(4, 10.0), run(8, 18.0)])
    assert (fit.per_layer, fit.fixed) == pytest.approx((2.0, 2.0))
    with pytest.raises(SystemExit, match="two model depths"):
        tr.Collectives.fit([run(8, 18.0)])
    path = Path(__file__).resolve().parents[2] / "lab" / "scripts" / "repartition_sim.py"
    spec = importlib.util.spec_from_file_location("repartition_sim", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    from batchgen_lab.sim.ep_preset import EP_PRESETS

    base = EP_PRESETS["ep-moe-dsv3"]
    rates = {"up_s_per_weight_gb": 1.0, "down_s_per_weight_gb": 2.0, "kv_bytes_per_s": 1e9}
    assert mod.measured_preset(base, rates).tp_allreduce == base.tp_allreduce
    assert mod.measured_preset(base, rates, (2.0, 2.0)).tp_allreduce == pytest.approx(
        (2 * 61 + 2) * 10e-6)
