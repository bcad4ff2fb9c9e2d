"""What one simulated run reports: batch completion time, GPU idle time, moves, accounting."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from batchgen_lab.sim.cluster import Cluster
    from batchgen_lab.sim.costmodel import CostModel
    from batchgen_lab.sim.workload import Workload


def solo_times(wl: "Workload", cost: "CostModel") -> np.ndarray:
    """[rows] seconds each row takes alone on an idle engine: its prefill, then its decodes."""
    return np.array([cost.step_time(i, i, 1) + cost.decode_steps_time(1, i + 1, 1, o - 1)
                     for i, o in zip(wl.input_lens.tolist(), wl.output_lens.tolist())])


def home_last(finish: np.ndarray, home: np.ndarray, actors: int) -> list[float]:
    """[actors] the last finish among each actor's home rows (nan for an actor with none)."""
    out = np.full(actors, np.nan)
    np.fmax.at(out, home, finish)
    return out.tolist()


@dataclass
class SimResult:
    mode: str
    actors: int
    rows: int
    bct_s: float  # batch completion time: when the last row's last token is produced
    busy_gpu_s: float  # sum over actors of time spent in steps
    idle_gpu_s: float  # actors x BCT - busy: GPU time paid for but not stepping
    steps: int  # engine steps, real and extrapolated
    spans: int  # real scheduler calls (one per span)
    preemptions: int
    moved: dict[str, int]
    shipped_gb: float
    rows_finished: int
    sim_wall_s: float
    # no schedule finishes every row before max(row bound to an actor + its solo time)
    tail_floor_s: float
    finish_time: np.ndarray = field(repr=False)  # [rows] seconds
    traces: list[list[tuple[float, int]]] = field(repr=False)  # per actor (time, running)
    # per actor, when the last row it received (its home rows) finished; nan: it got none.
    # What a Ray run measures per actor: a row's result returns through its home task.
    home_last_s: list[float] = field(default_factory=list, repr=False)
    # per row: the actor that produced its last token (-1: unfinished), and when its input
    # batch was bound to an actor
    finished_by: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32), repr=False)
    bound_at_s: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)

    @classmethod
    def collect(cls, c: "Cluster", wall_s: float) -> "SimResult":
        bct = float(np.nanmax(c.finish)) if c.wl.num_rows else 0.0
        busy = sum(a.busy_s for a in c.actors)
        bound = c.batch_bound_at[np.arange(c.wl.num_rows) // c.mode.batch_size]
        floor = float(np.max(bound + solo_times(c.wl, c.cost))) if c.wl.num_rows else 0.0
        return cls(
            mode=c.mode.name, actors=len(c.actors), rows=c.wl.num_rows, bct_s=bct,
            busy_gpu_s=busy, idle_gpu_s=len(c.actors) * bct - busy,
            steps=sum(a.steps for a in c.actors), spans=sum(a.spans for a in c.actors),
            preemptions=sum(a.num_preemptions for a in c.actors),
            moved=dict(c.moved), shipped_gb=c.shipped_bytes / 1e9,
            rows_finished=int(np.count_nonzero(~np.isnan(c.finish))), sim_wall_s=wall_s,
            tail_floor_s=floor, finish_time=c.finish, traces=[a.trace for a in c.actors],
            home_last_s=home_last(c.finish, np.asarray(c.batch_home)[
                np.arange(c.wl.num_rows) // c.mode.batch_size], len(c.actors)),
            finished_by=c.finished_by.copy(), bound_at_s=bound)

    @property
    def utilization(self) -> float:
        total = self.actors * self.bct_s
        return self.busy_gpu_s / total if total else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "bct_s": round(self.bct_s, 3),
            "idle_gpu_s": round(self.idle_gpu_s, 1), "busy_gpu_s": round(self.busy_gpu_s, 1),
            "utilization": round(self.utilization, 4),
            "p50_row_finish_s": round(float(np.nanmedian(self.finish_time)), 3),
            "steps": self.steps, "scheduler_calls": self.spans, "preemptions": self.preemptions,
            "moved": self.moved, "shipped_gb": round(self.shipped_gb, 3),
            "tail_floor_s": round(self.tail_floor_s, 3),
            "rows_finished": self.rows_finished, "sim_wall_s": round(self.sim_wall_s, 2),
        }

    def active_grid(self, t_end: float, bins: int) -> np.ndarray:
        """[actors, bins] running sequences per actor, sampled at bin starts (for plots)."""
        grid = np.zeros((self.actors, bins))
        edges = np.linspace(0.0, t_end, bins, endpoint=False)
        for i, tr in enumerate(self.traces):
            if not tr:
                continue
            ts = np.array([p[0] for p in tr])
            ns = np.array([p[1] for p in tr])
            idx = np.searchsorted(ts, edges, side="right") - 1
            grid[i] = np.where(idx >= 0, ns[np.clip(idx, 0, None)], 0)
        return grid
