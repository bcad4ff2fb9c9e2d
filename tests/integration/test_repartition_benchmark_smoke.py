"""benchmarks/repartition.py on a tiny Llama: a join and a split of a real EngineGroup, its
table and one JSON line with each switch's phases and the step ratio."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.timeout(600)]


def test_repartition_smoke(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/repartition.py", "--tiny", "--seqs", "3",
                           "--prompt-len", "16", "--steps", "3", "--repeats", "1",
                           "--cache", str(tmp_path)],
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    join, split = result["switches"]
    assert (join["switch"], split["switch"]) == ("join", "split")
    assert join["seqs"] == split["seqs"] == 3 and join["kv_bytes"] > 0
    assert join["total_s"] >= join["reshard_s"] > 0 and split["total_s"] > 0
    assert result["wide_step_ratio"] > 0 and result["tokens_equal"] in (0, 1)
    # the simulator's re-partition arm, rerun with these measured rates (lab/scripts)
    measured = tmp_path / "repartition.log"
    measured.write_text(proc.stdout)
    sim = subprocess.run([sys.executable, "lab/scripts/repartition_sim.py", "--measured",
                          str(measured), "--actors", "32", "--rows", "300", "--jobs", "1"],
                         capture_output=True, text=True, timeout=300)
    assert sim.returncode == 0, sim.stderr[-3000:]
    out = json.loads([ln for ln in sim.stdout.splitlines() if ln.startswith("{")][-1])
    rates = out["measured_rates"]
    assert rates["up_s_per_weight_gb"] == join["reshard_s_per_gb_weights"]
    assert rates["down_s_per_weight_gb"] == split["reshard_s_per_gb_weights"]
    assert set(out["bct_s"]) == {"static-tuned", f"{out['mode']} (assumed)",
                                 f"{out['mode']} (measured)"}
    assert all(v > 0 for v in out["bct_s"].values())
