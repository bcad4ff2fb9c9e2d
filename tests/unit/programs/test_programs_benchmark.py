"""`benchmarks/programs.py` runs end to end on a tiny model: both arms give the same rows, the
program computes fewer prompt tokens, and the time split adds up to the wall time."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[3]


pytestmark = pytest.mark.bench


def _run(*args: str) -> Any:
    proc = subprocess.run([sys.executable, "benchmarks/programs.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _bench(model: Path, *args: str) -> dict[str, Any]:
    return _run("--model", str(model), "--engine", "max_model_len=512", *args)


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


def _rows(n: int, words: int, seed: int) -> list[dict[str, Any]]:
    return _run("--dump-rows", "--rows", str(n), "--context-words", str(words),
                "--seed", str(seed))


def test_every_row_gets_its_own_passage() -> None:
    rows = _rows(400, 400, 0)
    passages = [r["question"].split("\n\nUsing")[0] for r in rows]
    assert len(set(passages)) == 400
    assert _rows(5, 400, 0) == rows[:5] != _rows(5, 400, 1)
    lengths = [len(p.split()) for p in passages]
    assert 400 <= min(lengths) and max(lengths) < 420
