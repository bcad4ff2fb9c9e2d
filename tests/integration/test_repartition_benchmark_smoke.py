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
