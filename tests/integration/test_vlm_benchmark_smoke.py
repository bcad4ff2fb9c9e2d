"""benchmarks/vlm_throughput.py on a tiny Qwen2.5-VL-shaped model: it prints its table and one
JSON line with every system, the encoder cache's counts and the engine's idle share."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.timeout(600)]


def test_vlm_throughput_smoke() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/vlm_throughput.py", "--size", "tiny",
                           "--rows", "8", "--max-tokens", "4", "--repeats", "1"],
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    systems = result["systems"]
    assert set(systems) == {"ours-threads", "ours-inline", "hf"}
    assert result["rows"] == 8 and systems["hf"]["tok_s"] > 0
    for name in ("ours-threads", "ours-inline"):
        s = systems[name]
        assert 0.0 <= s["idle_share"] < 1.0 and s["ratio_vs_hf"] > 0
        # the 30% repeated images: some are cache hits, never more encodings than images
        assert s["cache_hits"] >= 1 and s["encoded"] + s["cache_hits"] <= result["images"]
        assert s["agree_vs_hf"] >= 0.75  # greedy tokens of the same weights
