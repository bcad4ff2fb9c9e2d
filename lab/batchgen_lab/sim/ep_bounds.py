"""Lower bounds on the batch completion time (BCT) of an expert-parallel lockstep cluster.

Two floors that no schedule of `EPCluster` can beat, whatever it moves or re-partitions:

* **work bound**: the whole workload's modelled work spread over every group with perfect
  balance. Every step of a group costs at least its share of the fixed work (launch, non-expert
  weights, streaming the touched experts, the all-to-all latency floor) and every token its
  linear work (dense FLOPs, KV reads, routed-expert FLOPs, all-to-all bytes). The lockstep is
  charged through its only unavoidable part: a rank's work waits for the group's slowest GPU in
  proportion to that GPU's speed (ranks balanced so that each finishes at once: the slowest
  rank's time is at least the group's summed rank work over the summed rank speeds), and the
  routed experts wait for the slowest GPU outright (each GPU owns its experts). A group holds
  at most `seats_per_rank` decoding sequences a rank, which bounds the steps from below. Which
  group takes which work is a small linear programme; its dual gives a bound for any weights,
  so the weights are improved by mirror ascent and every iterate is a valid floor.
* **packing floor**: no schedule splits a row, so the longest row alone in the fastest group,
  at that group's best partition (DP16 ... DP2 x TP8), with its dummy ranks, is a floor.

`max_achievable_ratio` = the tuned lockstep baseline's BCT / max(floors): a schedule with a
greater BCT ratio than that does not exist in this model.
"""
from __future__ import annotations

import numpy as np

from batchgen_lab.sim.ep_preset import EPPreset
from batchgen_lab.sim.workload import Workload

TPS = (1, 2, 4, 8)


def group_unit_costs(p: EPPreset, gpu_f: np.ndarray) -> np.ndarray:
    """[3] seconds per unit for one group: decode token, prefill token, KV token read."""
    speed = float(np.sum(1.0 / gpu_f))  # the ranks' summed speeds (tp 1: the GPUs')
    f_max = float(gpu_f.max())
    # fixed work per step, over the seats it can serve; the cheapest partition counts
    fixed_per_seat = float("inf")
    for tp in TPS:
        ranks = p.group_gpus // tp
        rank_f = gpu_f.reshape(ranks, tp).max(axis=1)
        seats = ranks * p.seats_per_rank
        fixed = (ranks * (p.c_fixed + p.c_dense / tp) / float(np.sum(1.0 / rank_f))
                 + f_max * p.t_experts * p.expert_share(seats) + p.a2a_fixed
                 + (p.tp_allreduce if tp > 1 else 0.0))
        fixed_per_seat = min(fixed_per_seat, fixed / seats)
    # linear work of one token: dense FLOPs over the ranks, routed-expert FLOPs on the slowest
    # GPU, all-to-all bytes of the most loaded rank (at least the mean rank's)
    tok = p.c_tok / speed + f_max * p.c_moe / p.group_gpus + p.a2a_tok / p.group_gpus
    decode = fixed_per_seat + tok + p.c_seq / speed
    return np.array([decode, tok, p.c_kv / speed])


def workload_work(wl: Workload) -> np.ndarray:
    """[3] decode tokens, prefill tokens and KV token reads the workload needs in any schedule.

    As `EPCluster` counts them: the prefill step computes the prompt and reads its KV, then
    out - 1 decode steps each read the row's context (prompt + tokens generated so far)."""
    inp = wl.input_lens.astype(np.float64)
    out = wl.output_lens.astype(np.float64)
    kv = out * inp + out * (out - 1) / 2
    return np.array([float(np.sum(out - 1)), float(np.sum(inp)), float(np.sum(kv))])


def work_bound_s(wl: Workload, p: EPPreset, gpu_factors: np.ndarray, iters: int = 400) -> float:
    """The work bound (module docstring): max over group weights mu of sum_t W_t min_g mu_g c_tg."""
    f = np.asarray(gpu_factors, np.float64).reshape(-1, p.group_gpus)
    cost = np.stack([group_unit_costs(p, g) for g in f])  # [groups, 3]
    work = workload_work(wl)  # [3]
    mu = np.full(len(f), 1.0 / len(f))
    best = 0.0
    for i in range(iters):
        weighted = mu[:, None] * cost  # [groups, 3]
        arg = np.argmin(weighted, axis=0)
        best = max(best, float(np.sum(work * weighted[arg, np.arange(3)])))
        grad = np.zeros(len(f))
        np.add.at(grad, arg, work * cost[arg, np.arange(3)])
        mu = mu * np.exp(0.5 / np.sqrt(i + 1) * grad / max(float(grad.max()), 1e-30))
        mu /= mu.sum()
    return best


def solo_decode_s(p: EPPreset, inp: int, out: int, gpu_f: np.ndarray | None = None) -> float:
    """One row alone in a group (GPU factors `gpu_f`, default all 1) on its fastest rank, at the
    fastest width tried (tp 1..8), the other ranks running dummy steps: a floor for its finish."""
    gf = np.ones(p.group_gpus) if gpu_f is None else np.asarray(gpu_f, np.float64)
    best = float("inf")
    for tp in TPS:
        r = p.group_gpus // tp
        f = gf.reshape(r, tp).max(axis=1)
        one = np.zeros(r)
        one[int(np.argmin(f))] = 1.0

        def step(kv: float, new: float) -> float:
            return p.step_time(one, one * new, one * kv, f, tp)

        # the rank's time is linear in its KV, so out - 1 decode steps sum at the mean KV
        dec = (out - 1) * step(inp + out / 2, 1.0) if out > 1 else 0.0
        best = min(best, step(inp, inp) + dec)
    return best


def packing_floor_s(wl: Workload, p: EPPreset, gpu_factors: np.ndarray | None = None,
                    top: int = 256) -> float:
    """The longest row alone in the fastest group (`solo_decode_s`), over every row: exact,
    computed for the `top` longest outputs once the rest are shown not to matter (solo time
    grows with both lengths, so a shorter output with the longest prompt bounds the rest)."""
    groups = [None] if gpu_factors is None else \
        np.unique(np.asarray(gpu_factors, np.float64).reshape(-1, p.group_gpus), axis=0)

    def solo(i: int | None, inp: int = 0, out: int = 0) -> float:
        if i is not None:
            inp, out = int(wl.input_lens[i]), int(wl.output_lens[i])
        return min(solo_decode_s(p, inp, out, g) for g in groups)

    order = np.argsort(-wl.output_lens, kind="stable")
    best = max(solo(int(i)) for i in order[:top])
    rest = order[top:]
    if len(rest) and solo(None, int(wl.input_lens[rest].max()),
                          int(wl.output_lens[rest].max())) > best:
        best = max(best, max(solo(int(i)) for i in rest))
    return best
