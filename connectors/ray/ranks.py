"""Ranks 1.. of a tensor-parallel engine as Ray actors (`distributed_executor_backend="ray"`).

Rank 0 is the process that builds the engine, itself running in bundle 0 of a Ray placement
group: a `BatchGenPredictor` actor that `build_processor` placed there (one group per actor,
`tensor_parallel_size` bundles, PACK: a group fills a node first and spans nodes when it must),
or a driver or task a user placed. Rank r starts as a `_RankActor` in bundle r, asking for
exactly that bundle's resources, so a GPU bundle's actor sees its own GPU as cuda:0. The ranks
meet at rank 0's store on rank 0's node address, and gloo listens on each rank's own node
address, so the group works across nodes.

Lifetimes: a rank actor is owned by rank 0's process, so Ray kills it when rank 0's process
dies (no orphan, as the "mp" ranks' stdin watchdog does); rank 0 sees a rank's end in the
answer to its last `status` call: Ray's reason when the actor died, the traceback when the rank
failed; `stop` kills the actor.

The engine reaches this module by name (`worker/tp/launch.py`): only connectors import Ray.
A rank actor imports this module (its class), the engine and the model: no row connector.
"""
from __future__ import annotations

import dataclasses
import pickle
import threading
import traceback
from typing import Any

from batchgen_data.worker.tp.launch import RankArgs

_ACTOR: Any = None  # the remote class, made on first use (Ray is imported lazily)


def _rank_actor() -> Any:
    global _ACTOR
    if _ACTOR is None:
        import ray

        @ray.remote(max_restarts=0, max_concurrency=2)
        class _RankActor:
            """One rank of an engine, served on a thread of its own until rank 0 stops it or
            dies: no Ray task of the actor runs for long, so a rank that ends (killed with
            rank 0, say) is not reported to the job's driver as a task lost to a system error."""

            def __init__(self) -> None:
                self.ended: str | None = None

            def start(self, args: RankArgs, blob: bytes, num_threads: int | None) -> None:
                threading.Thread(target=self._serve, args=(args, blob, num_threads),
                                 daemon=True, name="batchgen-rank").start()

            def _serve(self, args: RankArgs, blob: bytes, num_threads: int | None) -> None:
                from batchgen_data.engine import rank_worker
                try:
                    code = rank_worker.serve(pickle.loads(blob), args,
                                             ray.util.get_node_ip_address(), num_threads)
                    self.ended = f"returned {code}"
                except BaseException:  # a rank that fails to load or serve
                    self.ended = f"failed: {traceback.format_exc()[-2000:]}"
                    raise

            def status(self) -> str | None:
                """None while the rank serves; else how it ended."""
                return self.ended

            def node_id(self) -> str:
                return ray.get_runtime_context().get_node_id()

        _ACTOR = _RankActor
    return _ACTOR


class _RayRank:
    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._asked = actor.status.remote()  # the answer rank 0 checks next

    def exit_status(self) -> str | None:
        """Never waits: the last `status` asked, if answered (then asked again)."""
        import ray

        ready, _ = ray.wait([self._asked], timeout=0)
        if not ready:
            return None
        try:
            ended = ray.get(self._asked)
        except Exception as exc:  # the actor died: Ray says why (node lost, killed, OOM...)
            return f"(a Ray actor) died: {str(exc)[-2000:]}"
        if ended is not None:
            return f"(a Ray actor) {ended}"
        self._asked = self.actor.status.remote()
        return None

    def stop(self, deadline: float) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


class RayRanks:
    """The launcher of ranks in the placement group the calling process runs in."""

    def __init__(self, size: int) -> None:
        try:
            import ray
            from ray.util import get_current_placement_group
        except ImportError as exc:
            raise ValueError("distributed_executor_backend='ray' needs Ray installed") from exc
        if not ray.is_initialized():
            raise ValueError("distributed_executor_backend='ray': this process is not connected "
                             "to a Ray cluster (run it in a Ray actor or task, or ray.init())")
        pg = get_current_placement_group()
        if pg is None:
            raise ValueError(f"distributed_executor_backend='ray' with tensor_parallel_size="
                             f"{size}: this process runs in no placement group; place it in "
                             f"bundle 0 of one with {size} bundles (build_processor does)")
        if len(pg.bundle_specs) < size:
            raise ValueError(f"tensor_parallel_size={size}: the placement group has "
                             f"{len(pg.bundle_specs)} bundles; one per rank is needed")
        self.pg = pg
        self.host = ray.util.get_node_ip_address()
        self.actors: list[Any] = []

    def launch(self, args: RankArgs, blob: bytes) -> _RayRank:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = dict(self.pg.bundle_specs[args.rank])
        cpus, gpus = bundle.pop("CPU", 0.0), bundle.pop("GPU", 0.0)
        # Ray's own bundle-scoped resource names are not the user's: keep the user's
        extra = {k: v for k, v in bundle.items() if "_group_" not in k}
        strategy = PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=args.rank)
        actor = _rank_actor().options(num_cpus=cpus, num_gpus=gpus, resources=extra or None,
                                      scheduling_strategy=strategy).remote()
        self.actors.append(actor)
        # a GPU actor sees only its bundle's GPU, as cuda:0; a CPU rank takes the bundle's
        # CPUs as its threads (at least one)
        threads = None if gpus else max(1, int(cpus))
        actor.start.remote(dataclasses.replace(args, device_index=0), blob, threads)
        return _RayRank(actor)
