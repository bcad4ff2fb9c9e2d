"""The placement speed rules in the cluster simulator: a straggler's lone long row moves to a
faster idle actor (`shed_slow_factor`), and each actor's load report carries its measured
decode-step floor, higher on a straggler by its slowdown."""
from __future__ import annotations

import numpy as np

from batchgen_data.placement import PlacementConfig
from batchgen_lab.sim import Cluster, CostModel, EngineShape, ModeConfig
from batchgen_lab.sim.workload import Workload

COST = CostModel("test-linear", c0=2e-3, c_tok=50e-6, c_kv=2e-7, c_seq=0.4e-3,
                 bytes_per_token=4096, kv_capacity_tokens=200_000,
                 pcie_bytes_per_s=10e9, link_bytes_per_s=5e9)
SHAPE = EngineShape(4, max_num_batched_tokens=2048, block_size=16, max_finishes=1)


def run(shed: float, no_slower: bool = False) -> tuple[Cluster, float]:
    # batch 0 (four short rows) on the fast actor 0, batch 1 (one long row and three short
    # ones) on actor 1, which steps 1.5x slower: the long row is the job's tail
    out = np.array([40, 50, 60, 70, 2000, 30, 40, 50])
    wl = Workload("straggler-tail", np.full(8, 64), out, 2048)
    placement = PlacementConfig(queue_depth=0, min_running_age=16, min_kv_gain_tokens=64,
                                max_receiver_slowdown=1.2 if no_slower else 0.0,
                                shed_slow_factor=shed)
    mode = ModeConfig("migrate", batch_size=4, max_concurrent_batches=1, placement=placement,
                      migrate=True, tick_s=0.05, max_tasks_in_flight=1, ray_tasks=True)
    c = Cluster(wl, 2, COST, SHAPE, mode, slowdown=[1.0, 1.5], plan=[[0], [1]])
    return c, c.run().bct_s


def test_shedding_moves_the_tail_off_the_straggler() -> None:
    kept, bct_kept = run(shed=0.0)
    shed, bct_shed = run(shed=1.3, no_slower=True)
    # without the rule the lone long row has no KV gain to offer and stays on the straggler
    assert kept.finished_by[4] == 1 and kept.moved.get("running", 0) == 0
    # with it, it leaves for the idle fast actor and the job ends sooner: the long row's
    # remaining tokens step 1.5x faster there
    assert shed.finished_by[4] == 0 and shed.moved["running"] == 1
    assert bct_shed < 0.8 * bct_kept
    # the floor each actor measured: the straggler's is 1.5x the fast one's (both ran one row)
    floors = [a.min_decode_step_s for a in kept.actors]
    assert floors[0] > 0 and abs(floors[1] / floors[0] - 1.5) < 0.05
