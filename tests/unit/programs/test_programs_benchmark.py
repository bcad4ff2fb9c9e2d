"""`benchmarks/programs.py` runs end to end on a tiny model: both arms give the same rows, the
program computes fewer prompt tokens, and the time split adds up to the wall time."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[3]


def _bench(model: Path, *args: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/programs.py", "--model", str(model),
                           "--engine", "max_model_len=512", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_programs_benchmark_document_workload(tiny_model_dir: Callable[..., Path]) -> None:
    out = _bench(tiny_model_dir("llama"), "--rows", "6", "--max-tokens", "4",
                 "--context-words", "40")
    assert out["context_words"] == 40 and out["identical_rows"] == 6
    stages, prog = out["stages"], out["program"]
    assert stages["requests"] == prog["requests"] == 18
    # the passage is prefilled once per program, three times by the chained stages
    assert out["prefill_ratio"] > 1.5
    assert prog["reuse"]["by_step"]["3"]["hit_rate"] > 0.5
    for arm in (stages, prog):
        split = arm["decode_s"] + arm["prefill_s"] + arm["other_s"]
        assert abs(split - arm["wall_s"]) < 0.05 + 0.01 * arm["wall_s"]
        assert arm["decode_steps"] > 0 and arm["prefill_steps"] > 0
    assert out["time_ratio_bound"] >= out["time_ratio"] > 0


def test_programs_benchmark_program_only_with_admission_settings(
        tiny_model_dir: Callable[..., Path]) -> None:
    out = _bench(tiny_model_dir("llama"), "--rows", "4", "--max-tokens", "2",
                 "--context-words", "20", "--program-only", "--admission", "guard=False")
    assert out["admission"] == {"guard": False} and "stages" not in out
    prog = out["program"]
    assert prog["requests"] == 12 and prog["reuse"]["admission_paused"] == 0


def test_every_row_gets_its_own_passage() -> None:
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_programs", ROOT / "benchmarks" /
                                                  "programs.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.make_rows(400, context_words=400, seed=0)
    passages = [r["question"].split("\n\nUsing")[0] for r in rows]
    assert len(set(passages)) == 400
    assert bench.make_rows(5, 400, seed=0) == rows[:5] != bench.make_rows(5, 400, seed=1)
    lengths = [len(p.split()) for p in passages]
    assert 400 <= min(lengths) and max(lengths) < 420
