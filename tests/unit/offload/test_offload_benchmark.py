"""`benchmarks/offload.py --cpu` runs end to end (tiny model, CPU "device", accelerate's disk
offload as the baseline) and reports both systems under the same weight budget."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_offload_benchmark_cpu_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/offload.py", "--cpu", "--workdir",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    runs = {r["system"]: r for r in lines if "system" in r}
    assert set(runs) == {"hf_accelerate", "batchgen_data"}
    hf, ours = runs["hf_accelerate"], runs["batchgen_data"]
    assert hf["output_tokens"] == ours["output_tokens"] > 0
    assert hf["bytes_per_token"] > 0 and ours["bytes_per_token"] > 0
    assert 0 < ours["peak_resident_bytes"] <= ours["budget_bytes"]
    summary = next(r for r in lines if r.get("summary") == "offload")
    assert summary["check"] is True and "PASS" in proc.stdout
    # nobody moves less than the weights beyond the budget once per output position
    assert summary["floor_bytes_per_token"] <= min(hf["bytes_per_token"],
                                                   ours["bytes_per_token"])
