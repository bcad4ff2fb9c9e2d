"""Interleaved A/B timing of engine steps (the lab's step scripts: scripts/moe_tile_ab.py,
scripts/moe_decode_ab.py)."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def interleaved_steps(step: Callable[[], Any], set_arm: Callable[[str], None],
                      names: Sequence[str], rounds: int, batch: int,
                      base: str) -> list[dict[str, Any]]:
    """Time one engine step per arm per round, rotating the arms' order every round so that
    the box's drift falls on every arm alike; one untimed warm-up step per arm first. Returns a
    row per arm: median wall and CPU ms, the p10-p90 spread, and the speed-up over `base`."""
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for name in names:
        set_arm(name)
        step()
    for rnd in range(rounds):
        k = rnd % len(names)
        for name in list(names[k:]) + list(names[:k]):
            set_arm(name)
            c0, w0 = time.process_time(), time.perf_counter()
            step()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    base_s = statistics.median(wall[base])
    out = []
    for name in names:
        w = sorted(wall[name])
        out.append({"batch": batch, "arm": name, "wall_ms": round(statistics.median(w) * 1e3, 1),
                    "p10_ms": round(w[len(w) // 10] * 1e3, 1),
                    "p90_ms": round(w[(len(w) * 9) // 10] * 1e3, 1),
                    "cpu_ms": round(statistics.median(cpu[name]) * 1e3, 1),
                    "speedup": round(base_s / statistics.median(w), 3)})
    return out
