"""The GPU benchmark script runs end to end on the CPU (`--quick`: tiny model, few requests),
and neither it nor the engine pulls in ray or pyspark, which the GPU machine does not have."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_engine_import_needs_no_ray_or_spark() -> None:
    code = ("import sys, batchgen_data, batchgen_data.engine.engine, batchgen_data.llm\n"
            "bad = {'ray', 'pyspark', 'gguf', 'accelerate'} & {m.split('.')[0] for m in sys.modules}\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.bench
def test_gpu_throughput_quick(tmp_path: Path) -> None:
    # the simulator's fit is opt-in (the lab, on PYTHONPATH)
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT / "lab")}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_throughput.py", "--quick",
                           "--systems", "ours,sim,hf_static,hf_cb,moe"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "correctness: PASS" in proc.stdout
    records = json.loads((tmp_path / "gpu_throughput.json").read_text())
    runs = {r["system"]: r for r in records if r["bench"] == "throughput"}
    assert set(runs) == {"ours", "hf_static", "hf_cb"}
    for name, r in runs.items():
        assert "error" not in r, r
        assert r["finished"] == "6/6" and r["tok_s"] > 0, r
    assert runs["ours"]["output_tokens"] == runs["hf_static"]["output_tokens"]
    checks = [r for r in records if r["bench"] == "check"]
    assert checks and all(c["top5_ok"] for c in checks)
    assert all(not r["ray_or_pyspark_imported"] for r in records if "ray_or_pyspark_imported" in r)
    _check_moe_case(records)
    # the simulator's cost model was fitted on this device and saved as a loadable preset
    from batchgen_lab.sim import get_preset

    cal = [r for r in records if r["bench"] == "sim_calibration"]
    assert len(cal) == 1 and "error" not in cal[0] and cal[0]["steps"] >= 10, cal
    preset = get_preset(str(tmp_path / "sim_preset_cpu.json"))
    assert preset.name == "cpu-tiny-measured" and preset.max_num_seqs == 4
    # a step with more of everything costs more; which term carries it is the fit's call (on a
    # fast AVX-512 box the tiny model's per-token cost is below the timing noise: c_tok = c_kv
    # = 0, c_seq > 0), so no single coefficient is required to be positive
    assert preset.step_time(64, 64, 4) > preset.step_time(1, 8, 1) > 0
    assert preset.step_time(64, 64, 1) >= preset.step_time(1, 8, 1)


def _check_moe_case(records: list[dict]) -> None:
    """The MoE case ran (check, ours and both HF baselines, tokens per expert for each) when
    the engine has Qwen3-MoE, and left one record saying it was skipped otherwise."""
    from batchgen_data.models.registry import supported_architectures

    checks = [r for r in records if r["bench"] == "moe_check"]
    if "Qwen3MoeForCausalLM" not in supported_architectures():
        assert len(checks) == 1 and "skipped" in checks[0], checks
        return
    assert len(checks) == 1 and checks[0]["top5_ok"], checks
    runs = {r["system"]: r for r in records if r["bench"] == "moe_throughput"}
    assert set(runs) == {"ours", "hf_static", "hf_cb"}, runs
    for r in runs.values():
        assert "error" not in r and r["finished"] == "4/4", r
        assert r["tokens_per_expert"]["mean"] > 0, r


@pytest.mark.bench
def test_moe_kernel_bench_quick() -> None:
    # the fused-MoE kernel benchmark on tiny shapes through the Triton interpreter
    import pytest

    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/moe_kernel_bench.py", "--quick"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["tokens"] for r in rows] == [3, 40]
    assert all(r["max_abs_err"] < 1e-4 and r["ours_ms"] > 0 for r in rows), rows


@pytest.mark.bench
def test_gpu_quant_quick(tmp_path: Path) -> None:
    # benchmarks/gpu_quant.py (run_gpu.sh quant) on tiny models: each quantized checkpoint is
    # checked against HF on its dequantized weights, then every format is timed
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_quant.py", "--quick"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "correctness: PASS" in proc.stdout
    records = json.loads((tmp_path / "gpu_quant.json").read_text())
    checks = {(r["bench"], r["system"]): r for r in records if r["bench"].endswith("_check")}
    assert set(checks) == {("quant_dense_check", "fp8_block"), ("quant_dense_check", "w4a16"),
                           ("quant_moe_check", "fp8_block")}
    for c in checks.values():
        assert c["top5_ok"] and c["quantized_weights"] > 0, c
    runs = {(r["bench"], r["system"]): r for r in records if r["bench"] in ("quant_dense",
                                                                          "quant_moe")}
    assert set(runs) == {("quant_dense", "bf16"), ("quant_dense", "fp8_block"),
                         ("quant_dense", "w4a16"), ("quant_moe", "bf16"),
                         ("quant_moe", "fp8_block")}
    for r in runs.values():
        assert "error" not in r and r["tok_s"] > 0, r
    base = runs["quant_dense", "bf16"]
    for fmt in ("fp8_block", "w4a16"):  # same tokens generated; fewer weight bytes
        assert runs["quant_dense", fmt]["output_tokens"] == base["output_tokens"]
        assert runs["quant_dense", fmt]["weights_mib"] < base["weights_mib"]
    ratios = [r for r in records if r["bench"].endswith("_ratio")]
    assert len(ratios) == 3 and all(r["vs_bf16"] > 0 for r in ratios)
