"""lab/batchgen_lab/migrate_headroom.py on a tiny configuration: the floors it prints bound the runs
they stand beside, and the clairvoyant order is a permutation of the same rows."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest


from batchgen_lab import migrate_headroom  # noqa: E402

from batchgen_lab.sim.workload import make_workload  # noqa: E402


def test_longest_first_is_the_same_rows_reordered() -> None:
    wl = make_workload("reasoning", 64, 0)
    lpt = migrate_headroom.longest_first(wl)
    assert list(lpt.output_lens) == sorted(wl.output_lens.tolist(), reverse=True)
    pairs = sorted(zip(wl.input_lens.tolist(), wl.output_lens.tolist()))
    assert sorted(zip(lpt.input_lens.tolist(), lpt.output_lens.tolist())) == pairs
    assert lpt.max_output == wl.max_output


@pytest.mark.bench
@pytest.mark.timeout(300)
def test_tiny_headroom_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # the figures come from the run's own file: the suite's Ray driver may print to stdout
    summary = migrate_headroom.main(["--actors", "4", "--rows", "192", "--seeds", "2",
                                     "--max-num-seqs", "8", "--batch-size", "4",
                                     "--stragglers", "0.25:1.5",
                                     "--json-out", str(tmp_path / "out.json")])
    assert "SIMULATED: 4 actors" in capsys.readouterr().out
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["summary"] == summary
    rows = written["per_seed"]
    assert [r["seed"] for r in rows] == [0, 1] and summary["seeds"] == 2
    for r in rows:
        # the binding's critical path bounds the migrate run it was read from, and the
        # longest row alone bounds that path
        assert r["packing_s"] <= r["bind_floor_s"] <= r["migrate_s"] + 0.05
        assert r["lpt_migrate_s"] >= r["packing_s"] and r["lpt_tuned_s"] >= r["packing_s"]
        assert r["ratio"] == pytest.approx(r["migrate_s"] / r["tuned_s"], abs=2e-3)
    assert summary["ratio_migration_vs_tuned_median"] == pytest.approx(
        float(np.median([r["ratio"] for r in rows])), abs=1e-3)
    assert 0 <= summary["seeds_meeting_goal"] <= 2
