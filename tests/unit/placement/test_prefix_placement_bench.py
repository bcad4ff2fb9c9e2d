"""`benchmarks/prefix_placement.py` runs end to end on a tiny model and prints the four arms side
by side; on a document workload the affinity arm prefills less than Ray's default routing."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.bench


def test_prefix_placement_smoke(tiny_model_dir: Callable[..., Path]) -> None:
    args = ["--model", str(tiny_model_dir("llama")), "--workloads", "document", "--actors", "2",
            "--docs", "4", "--questions", "8", "--doc-tokens", "160", "--batch-size", "4",
            "--max-tokens", "2", "--repeats", "1"]
    proc = subprocess.run([sys.executable, "benchmarks/prefix_placement.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    arms = {r["arm"]: r for r in out["results"]}
    assert set(arms) == {"default", "grouping", "affinity", "both"}
    # one engine's ideal: each document once, then only the questions (a block's remainder)
    ideal = arms["default"]["ideal_prefill_tokens"]
    assert 4 * 160 <= ideal <= 4 * 160 + 32 * (16 + 16)
    # later questions of a document find it cached where affinity sends them (rows admitted in
    # one step all prefill a prefix nobody has cached yet, so grouping alone gains no hits here)
    assert arms["affinity"]["prefill_tokens"] < arms["default"]["prefill_tokens"]
    assert arms["affinity"]["hit_rate"] > arms["default"]["hit_rate"]
    assert all(r["completion_s"] > 0 for r in arms.values())
