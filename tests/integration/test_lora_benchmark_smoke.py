"""benchmarks/lora_throughput.py on a tiny Llama: it prints its tables and one JSON line, and
the mixed engine gives the tokens of the one-adapter-at-a-time run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.timeout(600)]


def test_lora_throughput_smoke(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("peft")
    proc = subprocess.run([sys.executable, "benchmarks/lora_throughput.py", "--quick",
                           "--model", str(tiny_model_dir("llama")), "--repeats", "1"],
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "one adapter at a time" in proc.stdout and "base engine" in proc.stdout
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert result["benchmark"] == "lora_throughput" and result["same_tokens_mixed_and_one_at_a_time"]
    assert result["speedup_vs_one_at_a_time"] > 0 and result["lora_step_vs_base"] > 0
