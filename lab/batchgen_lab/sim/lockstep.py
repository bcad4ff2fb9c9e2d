"""Expert-parallel MoE groups whose data-parallel ranks step in lockstep (see ep_preset.py).

A cluster of `gpus` GPUs is cut into groups of `group_gpus` (16); each group is one serving
engine (vLLM / SGLang with DP attention + EP MoE) with 16 / tp ranks of `seats_per_rank` seats.
Each group step, every rank admits waiting rows into free seats (their prompts prefill in that
step, up to `prefill_budget` tokens a rank), every seated sequence decodes one token, and the
step lasts `EPPreset.step_time`: the slowest rank plus the shared expert / all-to-all time. A
rank without work runs a dummy batch; that is already in the max. Between finishes and
admissions nothing changes but the KV length, so such runs of steps are summed in one go.

Feeding modes (the names of modes.py, at group granularity; a group is one Ray Data actor):
* `static` / `static-tuned`: ray.data.llm on a DP+EP deployment: input batches of 32 rows, 8 (or,
  tuned, ceil(seats / 32)) running per group, 2x that bound; a batch returns when its slowest
  row is done. A row goes to the rank with the fewest rows at arrival (vLLM's DP load
  balancer) and stays there.
* `continuous`: streaming, a window of 2 x the group's seats, rows stay on their rank.
* `late-bind`: a window of seats + one batch; a row is seated on the least loaded rank only
  when a seat frees.
* `migrate`: late binding, plus every `tick_s`: sequences move from the rank whose work gates
  the step to the least loaded one, and, once every row is bound, from the groups with the
  slowest steps to groups short of work (oldest first: the long tail).
* `migrate-repartition`: `migrate`, and a group left with at most half as many sequences as
  ranks re-partitions into half as many ranks twice as wide (DP16 -> DP8 x TP2 -> ...; up to
  TP8) when the model says its step gets faster, pausing `reshard_s`.
KV memory is not modelled (DeepSeek-V3 leaves ~75 GB of KV per H200: ~1M tokens a rank, more
than 256 seats of this workload hold).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from batchgen_lab.sim.ep_bounds import solo_decode_s  # noqa: F401  (re-exported)
from batchgen_lab.sim.ep_preset import EPPreset

EP_MODES = ("static", "static-tuned", "continuous", "late-bind", "migrate",
            "migrate-repartition")
# remedies a migrate mode may add, one each, as "+name" (e.g. "migrate-repartition+pin"), so an
# arm that adds one shows that one's effect alone (lockstep_policy.py / lockstep_tiers.py):
# pin: a sequence that moved between groups stays put for `pin_s` (no ping-pong of the oldest)
# tiers: as the remaining rows stop filling every group, whole groups turn light one by one
#        (the fastest first), shed their young sequences to full groups and take the oldest
# early: re-partition any group, at any time, to the width the model says steps fastest
# align: admissions wait for a round: a group seats waiting rows only once it has
#        `align_seats` free seats per rank (or the queue's last rows, or after
#        `align_wait_s`), and spreads their
#        prompts' tokens evenly over its ranks; the prefill then costs one step for the group
#        instead of one slow step per admission (lockstep: every rank waits for the one that
#        prefills)
EP_FEATURES = ("pin", "tiers", "early", "align")
BATCH = 32  # ray.data.llm's batch_size


@dataclass(frozen=True, slots=True)
class EPMode:
    name: str
    tick_s: float = 0.5
    min_age: int = 256  # tokens a sequence must have generated before it moves between groups
    starve_fraction: float = 0.5  # a group with fewer active rows than this share of seats
    tail_seats: int = 64  # migrate modes, 4+ groups: sequences the tail group holds at most
    tail_age: int = 512  # tokens generated before a sequence may join the tail group
    pin_s: float = 5.0  # +pin: seconds a sequence stays in the group it moved to
    align_wait_s: float = 1.0  # +align: the longest a free seat waits for its round
    # +align: free seats per rank (on average) that open a round: 4 rows a rank let the round
    # even out prompt lengths (200k rows, seed 0: 1 -> 1477 s, 2 -> 1381 s, 4 -> 1317 s, 8 ->
    # 1321 s, 16 -> 1326 s)
    align_seats: int = 4

    def __post_init__(self) -> None:
        base, *feats = self.name.split("+")
        if base not in EP_MODES:
            raise ValueError(f"mode {self.name!r}: valid: {EP_MODES}, migrate modes with "
                             f"+feature from {EP_FEATURES}")
        bad = [f for f in feats if f not in EP_FEATURES]
        if bad or len(set(feats)) != len(feats) or (feats and not base.startswith("migrate")):
            raise ValueError(f"mode {self.name!r}: features {EP_FEATURES}, each once, on a "
                             f"migrate mode only")
        if "early" in feats and base != "migrate-repartition":
            raise ValueError(f"mode {self.name!r}: +early needs migrate-repartition")

    @property
    def base(self) -> str:
        return self.name.split("+")[0]

    def has(self, feature: str) -> bool:
        return feature in self.name.split("+")[1:]

    @property
    def late(self) -> bool:
        return self.base in ("late-bind", "migrate", "migrate-repartition")


class Group:
    def __init__(self, gid: int, p: EPPreset, gpu_f: np.ndarray) -> None:
        self.gid, self.p, self.gpu_f = gid, p, gpu_f  # gpu_f: [group_gpus] step-time factors
        cap = p.group_gpus * p.seats_per_rank
        self.row = np.full(cap, -1, np.int64)
        self.ctx = np.zeros(cap, np.int64)  # tokens with KV (prompt + generated)
        self.left = np.zeros(cap, np.int64)  # tokens still to generate
        self.gen = np.zeros(cap, np.int64)
        self.fresh = np.zeros(cap, bool)  # admitted this step: prefills
        self.queues: list[deque[int]] = [deque() for _ in range(p.group_gpus)]
        self.shared: deque[int] = deque()  # late binding: any rank takes from here
        # moved sequences on their way: (ready, row, ctx, left, gen, rank or -1 for any)
        self.arrivals: list[tuple[float, int, int, int, int, int]] = []
        self.busy_until = 0.0
        self.scheduled = False
        self.free_since: float | None = None  # +align: when a seat freed with rows waiting
        self.set_tp(1)

    def set_tp(self, tp: int) -> None:
        self.tp = tp
        self.ranks = self.p.group_gpus // tp
        self.f = self.gpu_f.reshape(self.ranks, tp).max(axis=1)  # a rank waits for its slowest GPU

    @property
    def seat_rank(self) -> np.ndarray:
        return np.arange(len(self.row)) // self.p.seats_per_rank

    def active(self) -> int:
        return int(np.count_nonzero(self.row >= 0))

    def loads(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[ranks] decoding sequences, new tokens and KV tokens of the next step."""
        on = self.row >= 0
        rank = self.seat_rank[on]
        r = self.ranks
        b = np.bincount(rank[~self.fresh[on]], minlength=r)[:r].astype(np.float64)
        pre = np.bincount(rank, weights=np.where(self.fresh[on], self.ctx[on], 0), minlength=r)[:r]
        kv = np.bincount(rank, weights=self.ctx[on], minlength=r)[:r]
        return b, b + pre, kv

    def step_time(self) -> float:
        b, new, kv = self.loads()
        return self.p.step_time(b, new, kv, self.f, self.tp)

    def rank_times(self) -> np.ndarray:
        b, new, kv = self.loads()
        return self.p.rank_times(b, new, kv, self.f, self.tp)

    def seat(self, row: int, ctx: int, left: int, gen: int, rank: int, fresh: bool) -> bool:
        s0 = rank * self.p.seats_per_rank
        free = np.flatnonzero(self.row[s0:s0 + self.p.seats_per_rank] < 0)
        if not len(free):
            return False
        s = s0 + int(free[0])
        self.row[s], self.ctx[s], self.left[s], self.gen[s], self.fresh[s] = row, ctx, left, gen, fresh
        return True

    def free_seats(self) -> np.ndarray:
        """[ranks] free seats per rank."""
        used = np.bincount(self.seat_rank[self.row >= 0], minlength=self.ranks)[:self.ranks]
        return self.p.seats_per_rank - used

    def take(self, s: int) -> tuple[int, int, int, int]:
        """Remove the sequence in seat s: (row, ctx, left, gen)."""
        out = (int(self.row[s]), int(self.ctx[s]), int(self.left[s]), int(self.gen[s]))
        self.row[s] = -1
        return out

    def repack(self, tp: int) -> None:
        """Re-partition into ranks tp GPUs wide, spreading the live sequences over them."""
        on = np.flatnonzero(self.row >= 0)
        keep = [(int(self.row[s]), int(self.ctx[s]), int(self.left[s]), int(self.gen[s]))
                for s in on]
        self.row[:] = -1
        self.fresh[:] = False
        self.set_tp(tp)
        for i, (row, ctx, left, gen) in enumerate(keep):
            assert self.seat(row, ctx, left, gen, i % self.ranks, False)


@dataclass
class EPResult:
    mode: str
    bct_s: float
    finish_time: np.ndarray
    moved: dict[str, int]
    reshards: int
    group_steps: int
    busy_gpu_s: float

    def summary(self) -> dict[str, object]:
        return {"mode": self.mode, "bct_s": round(self.bct_s, 3), "moved": self.moved,
                "reshards": self.reshards, "group_steps": self.group_steps,
                "busy_gpu_s": round(self.busy_gpu_s, 1),
                "p50_row_finish_s": round(float(np.median(self.finish_time)), 3)}
