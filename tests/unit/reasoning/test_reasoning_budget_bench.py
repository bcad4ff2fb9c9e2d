"""`benchmarks/reasoning_budget.py` runs end to end on the emulated runner (tiny sizes) and
prints its four arms; a budget's arm never reasons past the budget plus the appended end, and
never ends the batch later than the arm without one."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.bench


def test_smoke() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/reasoning_budget.py", "--rows", "40",
                           "--scale", "0.0001", "--tokens-per-step", "256", "--repeats", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    arms = {a["arm"]: a for a in result["arms"]}
    assert list(arms) == ["none", "budget", "p95", "budget+p95"]
    # coarse tokens of 256: a budget of 4000 is 16 of them, the 30-token end 1
    assert arms["budget"]["max_reasoning"] <= (16 + 1) * 256
    assert arms["none"]["max_reasoning"] > 8000 and arms["none"]["rows_cut"] == 0
    assert arms["budget"]["completion_s"] <= arms["none"]["completion_s"]
