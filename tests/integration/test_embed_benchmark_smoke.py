"""benchmarks/embed_throughput.py on a tiny BERT: it prints its table and one JSON line whose
embeddings agree across the three systems."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.timeout(600)]


def test_embed_throughput_smoke() -> None:
    pytest.importorskip("sentence_transformers")
    proc = subprocess.run([sys.executable, "benchmarks/embed_throughput.py", "--shape",
                           "tiny-bert", "--passages", "24", "--repeats", "1"],
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sentence-transformers" in proc.stdout and "hf-padded" in proc.stdout
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert result["passages"] == 24 and result["ratio_vs_st"] > 0
    assert result["min_cosine_vs_st"] >= 0.99999 and result["min_cosine_vs_hf"] >= 0.99999


def test_embed_throughput_ray_arm_smoke() -> None:
    # the Ray Data arm: every passage comes back through build_processor(task_type="embed")
    # with the offline engine's embedding, and the overhead fields are in the JSON line
    # (no baselines: a Ray overhead run compares our engine with itself)
    pytest.importorskip("ray")
    proc = subprocess.run([sys.executable, "benchmarks/embed_throughput.py", "--shape",
                           "tiny-bert", "--passages", "24", "--repeats", "1", "--ray-actors", "2",
                           "--baselines", ""],
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ours-ray-2-actors" in proc.stdout
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert result["ray_actors"] == 2 and result["min_cosine_vs_ray"] >= 0.99999
    assert result["passages_s"]["ours-ray-2-actors"] > 0
    assert isinstance(result["ray_overhead"], float)
    assert "sentence-transformers" not in result["passages_s"] and result["ratio_vs_st"] is None
