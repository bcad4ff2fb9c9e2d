"""`benchmarks/_common.interleaved_steps`: every arm gets a warm-up step and then one timed step
per round, the arms' order rotates every round, and the speed-up is read against the base arm."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from batchgen_lab.ab import interleaved_steps


def test_rotation_warmup_and_speedup() -> None:
    order: list[str] = []
    current = {"arm": ""}
    delay = {"slow": 0.004, "fast": 0.001}

    def step() -> None:
        order.append(current["arm"])
        time.sleep(delay[current["arm"]])

    def set_arm(name: str) -> None:
        current["arm"] = name

    rows = interleaved_steps(step, set_arm, ["slow", "fast"], rounds=4, batch=8, base="slow")
    assert order[:2] == ["slow", "fast"]  # warm-up, one step each
    assert order[2:] == ["slow", "fast", "fast", "slow", "slow", "fast", "fast", "slow"]
    by_arm = {r["arm"]: r for r in rows}
    assert by_arm["slow"]["speedup"] == 1.0 and by_arm["slow"]["batch"] == 8
    assert by_arm["fast"]["speedup"] > 1.5  # 4 ms against 1 ms, with room for timer noise
    assert by_arm["fast"]["p10_ms"] <= by_arm["fast"]["wall_ms"] <= by_arm["fast"]["p90_ms"]
