"""Ray in the loop at 16+ actors, with EMULATED compute: BCT of four ways to feed the actors.

A real Ray Data job (`build_processor`, the real `BatchGenPredictor`, engine scheduler,
coordinator and migration protocol) where the model is replaced by the emulated runner
(lab/batchgen_lab/emulated_runner.py): each engine step sleeps the simulator's modelled
step time (`--preset`, default h200-llama8b: c0 + c_mem + per-token + per-KV terms) and each row
stops at the output length the workload drew for it. No model runs: **compute is emulated**,
so 16-32 actors fit on a 2-core box. Times are reported in modelled seconds (wall / `--scale`).

* `--tokens-per-step g`: one emulated token stands for g real ones (`emulated_runner.coarsen`);
  the workload's lengths are rounded up to multiples of g, rows finish and join every g tokens.
* `--scale`: wall seconds slept per modelled second; the engines' measured Python/Ray overhead
  (time between two steps of a busy engine over its step time) is printed: keep it < 10%.
* `--stragglers FRAC:FACTOR`: round(FRAC x actors) actors step FACTOR x slower, the same ones
  the simulator slows for that seed (`sim.scenario.straggler_factors`).

Arms (docs/ray_data.md): `tuned` whole batch as ray.data.llm runs it (stream=False,
max_concurrent_batches = max(8, ceil(max_num_seqs / batch_size)), Ray's default queue of 2 x
that per actor); `stream` (rows stay where Ray bound them; `--window-depth` x max_num_seqs rows
per engine); `late` (+ row-level late binding); `migrate` (+ moving started sequences). Each
seed draws a new workload (sim/workload.py). Next to each Ray BCT the simulator's, on the same
coarse cost model, lengths, stragglers and tick (`_emulated_sim.py`): `bct_sim_s` (the arm as the
connector runs it: Ray's task dispatch, sim/modes.py, with each actor up when it first stepped
in the Ray run: the first actors up take a full queue of batches each), `sim_at0_s` (the same
with every actor up at once: the prediction before the run), `agree` (PASS when Ray is within 10% of
it), `actor_gap` (largest gap between the two runs' per-actor finish times, matched by rank),
`sim_credited_s` (the simulator mode the arm stands for, with its row-level window) and
`sim_slots_s` (the connector's slots, no coordinator). `--trace PREFIX` writes each arm's rows
(owner, input batch, call and yield times) for a closer look.
BCT counts from the moment every actor has built its engine (actor start-up is not emulated).

    PYTHONPATH=lab python -m batchgen_lab.ray_emulated --quick --stragglers 0.25:1.5   # 4 actors, ~5 min loaded
    PYTHONPATH=lab python -m batchgen_lab.ray_emulated --actors 16 --window-depth 4 --seeds 5 --both
    PYTHONPATH=lab python -m batchgen_lab.ray_emulated --actors 16 --window-depth 4 --seeds 5 --both --sim-only
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from batchgen_lab.ray_emulated_report import load_records, ray_plan, report, save_trace  # noqa: E402
from batchgen_lab.ray_emulated_sim import measured_start, sim_bcts  # noqa: E402

from batchgen_lab import emulated_runner  # noqa: E402
from batchgen_lab.emulated_runner import EmulatedSpec, coarsen, encode_prompt  # noqa: E402
from batchgen_lab.sim.modes import tuned_concurrency  # noqa: E402
from batchgen_lab.sim.result import solo_times  # noqa: E402
from batchgen_lab.sim.scenario import parse_stragglers, straggler_factors  # noqa: E402
from batchgen_lab.sim.workload import Workload, make_workload  # noqa: E402

ARMS = ("tuned", "stream", "late", "migrate")
# actors whose first batches reached them less than this apart (wall s) came up together: Ray's
# pool saw them alive in one pass and shared the queued batches among them by rule 2 of
# sim/modes.py; their first calls differ only by Ray's task-submission latency
WAVE_GAP_WALL_S = 0.1
# the actors import the emulated runner and the cost model from lab/: a local
# experiment, so the actors' PYTHONPATH names this checkout's lab/ (a runtime_env of the actor)
LAB = str(Path(__file__).resolve().parents[1])


def coarse_workload(name: str, rows: int, seed: int, g: int) -> Workload:
    """The simulator's workload with lengths in coarse tokens (rounded up to g real tokens)."""
    wl = make_workload(name, rows, seed)
    up = lambda a: np.maximum(1, -(-a // g))  # noqa: E731
    return Workload(f"{name}/g{g}", up(wl.input_lens), up(wl.output_lens), -(-wl.max_output // g))


def emulated_predictor(barrier_name: str, factors: list[float]) -> type:
    """`BatchGenPredictor` whose engine is emulated: the actor takes a ticket from the barrier
    (ticket i steps `factors[i]` x slower, as the simulator's actor i does), waits there until
    every actor has its engine (so start-up, which is not emulated, stays out of the BCT), and
    tags each output row with its owner, yield time and the runner's measured overhead. Built
    here so importing this module does not import Ray."""
    import pyarrow as pa
    import ray

    from batchgen_data.connectors.ray_data import BatchGenPredictor
    from batchgen_data.engine.driver import EngineDriver

    class EmulatedPredictor(BatchGenPredictor):  # type: ignore[misc, valid-type]
        def start_driver(self, model: str | None, engine_kwargs: dict[str, Any]) -> Any:
            import torch

            torch.set_num_threads(1)  # logits of [seats, 512]: one thread, no oversubscription
            barrier = ray.get_actor(barrier_name)
            self.ticket = ray.get(barrier.ticket.remote())
            spec = EmulatedSpec.parse(model or "")
            spec = EmulatedSpec(spec.preset, spec.scale, factors[self.ticket],
                                spec.tokens_per_step)
            driver = EngineDriver(emulated_runner.build_engine(spec.model_string(),
                                                              **engine_kwargs))
            ray.get(barrier.arrive.remote())
            return driver

        def __call__(self, batch: Any):  # type: ignore[no-untyped-def]
            called = time.time()  # when Ray's actor thread ran this batch's call
            first_id = min(pa.table(batch)["id"].to_pylist()) if len(batch) else -1
            for table in super().__call__(batch):
                n = table.num_rows
                runner = self.driver.engine.runner
                for name, value, typ in (("bench_owner", self.ticket, pa.int64()),
                                         ("bench_called", called, pa.float64()),
                                         ("bench_batch", first_id, pa.int64()),
                                         ("bench_wall", time.time(), pa.float64()),
                                         ("bench_overhead", runner.overhead(), pa.float64()),
                                         ("bench_first_step", runner.first_step_at, pa.float64()),
                                         ("bench_floor", self.driver.engine.stats.decode_step_s(),
                                          pa.float64())):
                    table = table.append_column(name, pa.array([value] * n, typ))
                yield table

    return EmulatedPredictor


class Barrier:
    """Hands out actor tickets and holds every actor until all `n` have built their engines."""

    def __init__(self, n: int) -> None:
        import threading

        self.n, self.tickets, self.arrived = n, 0, 0
        self.t0: float | None = None
        self.cv = threading.Condition()

    def ticket(self) -> int:
        with self.cv:
            self.tickets += 1
            return self.tickets - 1

    def arrive(self) -> float:
        with self.cv:
            self.arrived += 1
            if self.arrived == self.n:
                self.t0 = time.time()
                self.cv.notify_all()
            self.cv.wait_for(lambda: self.t0 is not None)
            return self.t0  # type: ignore[return-value]

    def start(self) -> float | None:
        return self.t0


def arm_config(arm: str, args: argparse.Namespace, model: str, max_len: int,
               max_tokens: int) -> Any:
    from batchgen_data.connectors.ray.processor import BatchGenProcessorConfig

    seats = args.max_num_seqs
    cost = EmulatedSpec.parse(model).cost_model()
    feed: dict[str, Any] = {
        # ray.data.llm's 8 concurrent batches, raised to fill the seats as Ray's warning says
        "tuned": dict(stream=False, migration=False, late_binding=False,
                      max_concurrent_batches=tuned_concurrency(seats, args.batch_size)),
        "stream": dict(stream="ordered", migration=False, late_binding=False),
        "late": dict(stream="ordered", migration=False, late_binding=True),
        "migrate": dict(stream="ordered", migration=True),
    }[arm]
    return BatchGenProcessorConfig(
        model_source=model, concurrency=args.actors, batch_size=args.batch_size,
        num_cpus=args.actor_cpus, sampling_params={"max_tokens": max_tokens, "temperature": 0.0},
        engine_kwargs={"max_num_seqs": seats, "max_num_batched_tokens": args.max_num_batched_tokens,
                       "max_model_len": max_len},
        window_depth=args.window_depth, runtime_env={"env_vars": {"PYTHONPATH": LAB}},
        # the emulated cluster's links are the cost model's, as the simulator charges them, so
        # the coordinator's ship-or-recompute choice is the simulator's
        migration_options={"interval_s": args.interval, "placement": placement(args),
                           "link_bytes_per_s": cost.link_bytes_per_s,
                           "pcie_bytes_per_s": cost.pcie_bytes_per_s}, **feed)


def placement(args: argparse.Namespace) -> dict[str, Any]:
    """The connector's placement switches, with thresholds counted in tokens in coarse tokens
    (the defaults / g), so a coarse run moves the same rows a real one would; both the connector
    and the simulator get these. `--no-speed-rules`: without the straggler rules."""
    from batchgen_data.connectors.migration_options import DEFAULT_PLACEMENT, SPEED_RULES
    from batchgen_data.placement import PlacementConfig

    g, cfg = args.tokens_per_step, PlacementConfig()
    out = {**DEFAULT_PLACEMENT, "min_running_age": -(-cfg.min_running_age // g),
           "min_kv_gain_tokens": -(-cfg.min_kv_gain_tokens // g)}
    if not args.no_speed_rules:
        out.update(SPEED_RULES)
    return out


def slots(arm: str, args: argparse.Namespace) -> tuple[int, int | None]:
    """(input batches an actor serves at once, batches bound to it; None: Ray's 2x default)."""
    cfg = arm_config(arm, args, EmulatedSpec().model_string(), 4096, 1)
    calls = cfg.concurrent_batches
    return calls, calls if (cfg.migration_on or cfg.late_binding_on) else None


def run_arm(arm: str, rows: list[dict[str, Any]], wl: Workload, args: argparse.Namespace,
            factors: list[float], seed: int = 0) -> dict[str, Any]:
    import ray

    from batchgen_data.connectors.ray.coordinator import NAMESPACE, coordinator_name
    from batchgen_data.connectors.ray.processor import build_processor

    spec = EmulatedSpec(args.preset, args.scale, 1.0, args.tokens_per_step)
    max_len = int(wl.input_lens.max()) + wl.max_output + 1
    processor = build_processor(arm_config(arm, args, spec.model_string(), max_len, wl.max_output))
    name = f"emul-barrier-{processor.job_id}"
    barrier = ray.remote(num_cpus=0, max_concurrency=args.actors + 8)(Barrier).options(
        name=name).remote(args.actors)
    processor.predictor = emulated_predictor(name, factors)
    wall0 = time.time()
    out = processor(ray.data.from_items(rows)).take_all()
    wall = time.time() - wall0
    t0 = ray.get(barrier.start.remote())
    ids = sorted(r["id"] for r in out)
    assert ids == list(range(len(rows))), f"{arm}: a row was lost or repeated"
    bad = [r for r in out if r["error"] is not None
           or r["num_generated_tokens"] != int(wl.output_lens[r["id"]])]
    assert not bad, f"{arm}: {len(bad)} rows wrong, e.g. {bad[0]['error']!r}"
    moves, coord_stats = 0, {}
    if arm in ("late", "migrate"):
        coord = ray.get_actor(coordinator_name(processor.job_id, ""), namespace=NAMESPACE)
        coord_stats = ray.get(coord.stats.remote())
        moves = coord_stats["num_moves"]
    ray.kill(barrier)
    if args.trace:
        save_trace(f"{args.trace}.{arm}.s{seed}.json", out, t0, args, factors)
    last: dict[int, tuple[float, float]] = {}
    tokens: dict[int, int] = {}
    first = {r["bench_owner"]: r["bench_first_step"] for r in out}
    called: dict[int, float] = {}
    batch_call: dict[int, tuple[float, int]] = {}  # input batch -> (its call, its actor)
    for r in out:
        called[r["bench_owner"]] = min(r["bench_called"], called.get(r["bench_owner"], math.inf))
        batch_call[r["bench_batch"]] = (r["bench_called"], r["bench_owner"])
    floor: dict[int, float] = {}  # the speed each owner reported as of its last yield
    for r in out:  # each owner's tokens, and its overhead as of its last yield
        owner = r["bench_owner"]
        tokens[owner] = tokens.get(owner, 0) + r["num_generated_tokens"]
        if r["bench_wall"] >= last.get(owner, (0.0, 0.0))[0]:
            last[owner] = (r["bench_wall"], r["bench_overhead"])
            floor[owner] = r["bench_floor"]
    ends = sorted((w - t0) / args.scale for w, _ in last.values())
    return {"arm": arm, "bct_ray_s": ends[-1], "moves": moves,
            # the coordinator's CPU seconds (its start-up included) and exchanges served: the
            # planner's share of the 2 cores the emulated engines also run on
            "coordinator_cpu_s": coord_stats.get("cpu_s"),
            "exchanges": coord_stats.get("num_exchanges"),
            # engines pruned as silent (reports stalled for dead_after_s) and imports dropped
            "pruned": coord_stats.get("pruned"), "dropped_imports": coord_stats.get("dropped_imports"),
            "overhead": max(o for _, o in last.values()), "wall_s": round(wall, 1),
            # how Ray bound the rows (tokens owned per actor, by ticket; factors say which were
            # slow) and when each owner yielded its last row: the imbalance behind the BCT
            "owned_tokens": [tokens.get(i, 0) for i in range(args.actors)],
            "last_yield_s": [round(e, 1) for e in ends],
            # when each engine first computed: Ray's dispatch lag after the barrier, which
            # 1 / scale magnifies in modelled seconds (compute is scaled, Ray's latency is not)
            "first_step_s": sorted(round((f - t0) / args.scale, 1) for f in first.values()
                                   if f is not None),
            # the same by ticket (None: the actor never got a row), and each actor's last yield
            "first_step_by_actor": [None if first.get(i) is None
                                    else round((first[i] - t0) / args.scale, 2)
                                    for i in range(args.actors)],
            # the speed each engine reported to placement at its last yield
            # (`EngineLoad.decode_step_s`: the fitted reference step, `DecodeSpeed`), in
            # modelled ms: a straggler's is its factor times the others'
            "decode_floor_ms_by_actor": [None if i not in floor or not floor[i]
                                         else round(floor[i] / args.scale * 1e3, 2)
                                         for i in range(args.actors)],
            # when each actor's first input batch reached it (Ray had it alive by then)
            "first_call_by_actor": [None if i not in called
                                    else round((called[i] - t0) / args.scale, 2)
                                    for i in range(args.actors)],
            "_plan": ray_plan(batch_call, args),
            # each engine's overhead as of its last yield (the run's `overhead` is the most)
            "overhead_by_actor": [None if i not in last else round(last[i][1], 3)
                                  for i in range(args.actors)],
            "last_yield_by_actor": [None if i not in last
                                    else round((last[i][0] - t0) / args.scale, 2)
                                    for i in range(args.actors)]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="4 actors (one 1.5x slower), 1 seed, 512 rows")
    ap.add_argument("--actors", type=int, default=16)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--workload", default="reasoning")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--stragglers", default="0.125:1.5", help="FRAC:FACTOR; '' for none")
    ap.add_argument("--both", action="store_true", help="run with and without stragglers")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--preset", default="h200-llama8b")
    ap.add_argument("--tokens-per-step", type=int, default=64)
    ap.add_argument("--scale", type=float, default=0.2, help="wall s per modelled s")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--window-depth", type=float, default=2.0,
                    help="streaming arms: rows in an engine's window per seat (connector option)")
    ap.add_argument("--interval", type=float, default=0.1,
                    help="migration interval_s (wall): how often engines report")
    ap.add_argument("--actor-cpus", type=float, default=0.05)
    ap.add_argument("--trace", default="",
                    help="path prefix: write each arm's per-row trace (owner, batch, times)")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulator comparison")
    ap.add_argument("--no-speed-rules", action="store_true",
                    help="placement without the straggler rules (max_receiver_slowdown, "
                         "shed_slow_factor): the policy before them")
    ap.add_argument("--sim-only", action="store_true",
                    help="only the simulator's figures for this configuration (no Ray)")
    ap.add_argument("--resim", default="",
                    help="a file with an earlier run's output: its Ray figures as they were, "
                         "the simulator's recomputed (needs that run's --trace prefix)")
    args = ap.parse_args(argv)
    if args.quick:
        args.actors, args.seeds, args.rows = 4, 1, 512
        if args.stragglers == ap.get_default("stragglers"):
            args.stragglers = "0.25:1.5"  # one of 4 actors (0.125 x 4 would round to none)
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    import ray
    from ray import cloudpickle

    args = parse_args(argv)
    if __name__ != "__main__":  # imported (tests): ship the classes by value to the actors
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    arms = args.arms.split(",")
    settings = [args.stragglers, ""] if args.both else [args.stragglers]
    arm_slots = {arm: slots(arm, args) for arm in arms}
    print(f"EMULATED COMPUTE: engines sleep the '{args.preset}' cost model's step time x "
          f"{args.scale} (no model runs); {args.actors} actors, {args.max_num_seqs} seats, "
          f"{args.rows} {args.workload} rows, g={args.tokens_per_step} tokens per step", flush=True)
    # a caller's Ray (a test session, a notebook) is used as it is, and left running
    stored = load_records(args.resim, args) if args.resim else None
    owns_ray = not args.sim_only and stored is None and not ray.is_initialized()
    if owns_ray:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 configure_logging=False, object_store_memory=1 << 30)
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
    cost = coarsen(EmulatedSpec(args.preset).cost_model(), args.tokens_per_step)
    records: list[dict[str, Any]] = []
    try:
        for stragglers in settings:
            frac, factor = parse_stragglers(stragglers)
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                factors = straggler_factors(args.actors, frac, factor, seed)
                wl = coarse_workload(args.workload, args.rows, seed, args.tokens_per_step)
                rows = [{"id": i, "prompt_token_ids": encode_prompt(int(o), int(n), i)}
                        for i, (n, o) in enumerate(zip(wl.input_lens, wl.output_lens))]
                bound = float(solo_times(wl, cost).max())
                sim = {} if args.no_sim else sim_bcts(wl, args, cost, factors, arm_slots,
                                                      placement(args))
                for k in range(len(arms)):  # rotate the order: the box is shared and noisy
                    arm = arms[(k + seed) % len(arms)]
                    if args.sim_only:
                        rec = {"arm": arm, "bct_ray_s": None, "moves": None, "overhead": None,
                               "wall_s": None}
                    elif stored is not None:
                        rec = stored[(stragglers or "none", seed, arm)]
                    else:
                        rec = run_arm(arm, rows, wl, args, factors, seed)
                    got = waves = sim.get(arm, {})
                    plan = rec.pop("_plan", None)
                    if got and not args.sim_only:
                        # the dispatch rule with the start-up this Ray run had, and the replay
                        # of Ray's own dispatch (which actor ran which batches, from when)
                        first = rec["first_call_by_actor"]
                        up = measured_start(first, WAVE_GAP_WALL_S / args.scale)
                        waves = sim_bcts(wl, args, cost, factors, arm_slots, placement(args),
                                         up, [arm])[arm]
                        got = waves if plan is None else sim_bcts(
                            wl, args, cost, factors, arm_slots, placement(args),
                            [w if t is None else t for t, w in zip(first, up)], [arm], plan)[arm]
                    rec.update(stragglers=stragglers or "none", seed=seed,
                               packing_bound_s=round(bound, 1),
                               bct_sim_s=got.get("sim"), replayed=plan is not None,
                               sim_waves_s=waves.get("sim"),
                               sim_at0_s=sim.get(arm, {}).get("sim"),
                               sim_credited_s=got.get("sim_credited"),
                               sim_slots_s=got.get("sim_slots"),
                               sim_home_last_s=got.get("sim_home_last"))
                    print(json.dumps(rec), flush=True)
                    records.append(rec)
    finally:
        if owns_ray:
            ray.shutdown()
    return report(records, args)



if __name__ == "__main__":
    main()
