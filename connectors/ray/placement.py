"""Where a tensor-parallel engine actor of `build_processor` runs: a placement group of its own.

As `ray.data.llm` does for vLLM, each engine actor gets a fresh placement group of
`tensor_parallel_size` bundles (PACK by default: one node when it fits, several when it must),
made by Ray Data's `ray_remote_args_fn` when it starts the actor. Unlike vLLM's stage, the actor
itself is rank 0 and sits in bundle 0, asking for exactly that bundle's resources; its engine
starts ranks 1.. in bundles 1.. as Ray actors (`distributed_executor_backend="ray"`,
connectors/ray/ranks.py). An actor that Ray restarts comes back in the same
group, and its engine starts its ranks there again.

Bundles: `placement_group_config={"bundles": [...], "strategy": ...}` (ray.data.llm's name;
`bundle_per_worker` repeats one bundle per rank), else one bundle per rank of the processor's
per-actor `num_cpus`, `num_gpus / tensor_parallel_size` GPUs and `resources`.
"""
from __future__ import annotations

import copy
import functools
import sys
import uuid
from collections.abc import Callable, Mapping
from typing import Any

_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
GROUP_PREFIX = "batchgen-tp-"  # the groups made here (each actor's own)


def rank_bundles(tp: int, num_cpus: float, num_gpus: float,
                 resources: Mapping[str, float] | None,
                 placement_group_config: Mapping[str, Any] | None
                 ) -> tuple[list[dict[str, float]], str]:
    """The bundles (one per rank) and the strategy of an engine actor's placement group;
    ValueError naming the field when they cannot hold `tp` ranks."""
    if placement_group_config is None:
        bundle = {"CPU": float(num_cpus), **dict(resources or {})}
        if num_gpus:
            bundle["GPU"] = num_gpus / tp
        return [dict(bundle) for _ in range(tp)], "PACK"
    cfg = copy.deepcopy(dict(placement_group_config))
    unknown = set(cfg) - {"bundles", "bundle_per_worker", "strategy"}
    if unknown:
        raise ValueError(f"placement_group_config: unknown key(s) {sorted(unknown)}; use "
                         "bundles or bundle_per_worker, and strategy")
    if "bundle_per_worker" in cfg:
        one = dict(cfg.pop("bundle_per_worker"))
        cfg["bundles"] = [dict(one) for _ in range(tp)]
    bundles = cfg.get("bundles")
    if not isinstance(bundles, list) or len(bundles) != tp or not all(
            isinstance(b, Mapping) and b for b in bundles):
        raise ValueError(f"placement_group_config bundles={bundles!r}: give "
                         f"tensor_parallel_size={tp} non-empty bundles, one per rank")
    strategy = cfg.get("strategy", "PACK")
    if strategy not in _STRATEGIES:
        raise ValueError(f"placement_group_config strategy={strategy!r}: use one of "
                         f"{_STRATEGIES}")
    return [{k: float(v) for k, v in b.items()} for b in bundles], strategy


def actor_resources(bundle: Mapping[str, float]) -> dict[str, Any]:
    """map_batches' resource arguments for rank 0's actor: exactly bundle 0."""
    rest = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    out: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0.0)}
    if bundle.get("GPU"):
        out["num_gpus"] = bundle["GPU"]
    if rest:
        out["resources"] = rest
    return out


def _starting_an_actor() -> bool:
    """Whether Ray Data calls us to start an actor: Ray 2.60 also calls `ray_remote_args_fn`
    from its memory issue detector (to read "memory"), and a group made then would hold its
    bundles for the whole job with no actor in it (on a small cluster, every CPU the read tasks
    need). If a later Ray renames the frame, no group is made and the engine refuses to start,
    naming the missing group: loud, not a hang."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_start_actor":
            return True
        frame = frame.f_back
    return False


def _in_new_group(bundles: list[dict[str, float]], strategy: str) -> dict[str, Any]:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not _starting_an_actor():
        return {}
    _reap()
    pg = ray.util.placement_group(bundles, strategy=strategy,
                                  name=f"{GROUP_PREFIX}{uuid.uuid4().hex}")
    _MADE.append(pg)
    # the actor in bundle 0; its engine places the other ranks by bundle index itself
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=0)}


def remote_args_fn(bundles: list[dict[str, float]], strategy: str
                   ) -> Callable[[], dict[str, Any]]:
    """Ray Data's `ray_remote_args_fn`: a new placement group for each actor it starts."""
    return functools.partial(_in_new_group, bundles, strategy)


_MADE: list[Any] = []  # the groups this driver made, until reaped
_CLAIM = "batchgen-tp-claimed/"  # GCS key of a group whose actor has started


def release_groups() -> int:
    """Remove every placement group this driver made for engine actors, and say how many: for
    a driver (a notebook) that runs more jobs on the same cluster, once a job's rows are in.
    An engine actor still in one of them is ended by Ray."""
    import ray

    count = 0
    while _MADE:
        ray.util.remove_placement_group(_MADE.pop())
        count += 1
    return count


def claim_own_group() -> None:
    """In an engine actor, once its engine is up: mark the group it runs in as claimed, so the
    driver may remove the group once this actor is gone (`_reap`)."""
    from ray.experimental.internal_kv import _internal_kv_put
    from ray.util import get_current_placement_group

    pg = get_current_placement_group()
    if pg is not None:
        _internal_kv_put(_CLAIM + pg.id.hex(), b"1")


def _reap() -> None:
    """Remove the groups made here whose actor has started and is gone (bundle 0 free again):
    a finished job's. Ray Data drops a finished job's actors without calling back, so this runs
    when the driver starts the next engine actor (and the driver's exit removes the rest). A
    group whose actor has not started yet is not claimed, and a crashed actor is restarted by
    Ray within its job, where no new actor starts."""
    import ray
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get

    free = ray.available_resources()
    for pg in list(_MADE):
        key = _CLAIM + pg.id.hex()
        if not _internal_kv_get(key):
            continue
        bundle = pg.bundle_specs[0]
        if all(free.get(f"{r}_group_0_{pg.id.hex()}", 0.0) >= amount - 1e-9
               for r, amount in bundle.items() if amount > 0):
            ray.util.remove_placement_group(pg)
            _internal_kv_del(key)
            _MADE.remove(pg)
