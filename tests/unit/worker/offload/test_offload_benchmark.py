"""`benchmarks/offload.py --cpu` runs end to end (tiny model, CPU "device", accelerate's disk
offload as the baseline) and reports both systems under the same weight budget, and the engine
with a KV host tier beside a device KV cache too small for the batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[4]


def _bench(tmp_path: Path, *args: str, **env_kw: str) -> tuple[str, list[dict[str, Any]]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_kw}
    proc = subprocess.run([sys.executable, "benchmarks/offload.py", "--cpu", "--workdir",
                           str(tmp_path), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout, [json.loads(line) for line in proc.stdout.splitlines()
                         if line.startswith("{")]


@pytest.mark.bench
def test_offload_benchmark_cpu_smoke(tmp_path: Path) -> None:
    # a device KV of 3 blocks (3072 B a token, 16 a block): two sequences per step without
    # the host tier
    stdout, lines = _bench(tmp_path, "--kv-device-bytes", str(3 * 16 * 3072),
                           "--kv-host-tier-bytes", str(4 << 20))
    runs = {r["system"]: r for r in lines if "system" in r}
    assert set(runs) == {"hf_accelerate", "batchgen_data", "batchgen_data_kv_host_tier"}
    hf, ours = runs["hf_accelerate"], runs["batchgen_data"]
    assert hf["output_tokens"] == ours["output_tokens"] > 0
    assert hf["bytes_per_token"] > 0 and ours["bytes_per_token"] > 0
    assert 0 < ours["peak_resident_bytes"] <= ours["budget_bytes"]
    summary = next(r for r in lines if r.get("summary") == "offload")
    assert summary["check"] is True and "PASS" in stdout
    # nobody moves less than the weights beyond the budget once per output position
    assert summary["floor_bytes_per_token"] <= min(hf["bytes_per_token"],
                                                   ours["bytes_per_token"])
    tier = runs["batchgen_data_kv_host_tier"]
    assert tier["output_tokens"] == ours["output_tokens"]
    assert tier["max_batch_seqs"] > ours["max_batch_seqs"] and tier["kv_host_seqs_peak"] > 0
    assert summary["kv_tier_vs_device_bytes"] < 1


@pytest.mark.bench
def test_offload_benchmark_without_accelerate_reports_the_bound(tmp_path: Path) -> None:
    # the device machine's image has accelerate; where it lacks it the run still reports ours
    out = tmp_path / "out"
    out.mkdir()
    stdout, lines = _bench(tmp_path, "--no-hf", "--no-check", OUT=str(out))
    assert "HF accelerate: unavailable" in stdout
    runs = {r["system"]: r for r in lines if "system" in r}
    assert set(runs) == {"batchgen_data"}
    ours = runs["batchgen_data"]
    assert ours["output_tokens"] > 0 and 0 < ours["tok_s"] and ours["bound_tok_s"] > 0
    summary = next(r for r in lines if r.get("summary") == "offload")
    assert summary["hf_accelerate"] == "unavailable" and summary["speedup_vs_hf_accelerate"] is None
    assert summary["ours_s"] > 0 and "hf_s" not in summary
    saved = [json.loads(line) for line in (out / "offload_tiny.json").read_text().splitlines()]
    assert saved == lines  # the JSON lines the device call brings back


@pytest.mark.bench
@pytest.mark.slow
def test_offload_benchmark_moe_reports_expert_and_layer_streaming(tmp_path: Path) -> None:
    stdout, lines = _bench(tmp_path, "--model", "tiny_moe")
    runs = {r["system"]: r for r in lines if "system" in r}
    assert set(runs) == {"hf_accelerate", "batchgen_data", "batchgen_data_whole_layers"}
    experts, layers = runs["batchgen_data"], runs["batchgen_data_whole_layers"]
    assert experts["output_tokens"] == layers["output_tokens"] > 0
    assert 0 < experts["bytes_per_token"] < layers["bytes_per_token"]
    summary = next(r for r in lines if r.get("summary") == "offload")
    assert summary["check"] is True
    assert summary["expert_vs_layer_bytes"] < 1
