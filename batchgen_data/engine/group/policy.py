"""What an engine group (engine/group/group.py) decides and checks without its processes: when to
join and split (`PartitionPolicy`, from the engines' load reports), what a switch reports
(`SwitchReport`), what a group refuses before anything starts (`check_group`), and how requests
are spread over engines by their KV tokens (`spread`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from batchgen_data.config import EngineConfig
from batchgen_data.placement import EngineLoad


@dataclasses.dataclass(frozen=True)
class PartitionPolicy:
    """When a group joins into one TP engine and when it splits back, from `Engine.load()`.

    Join when every engine's queue is empty, the group holds at most `join_below_seqs` live
    sequences, and the steps the tail still needs (the mean remaining tokens per live sequence
    of the busiest engine: max_tokens left, so an over-estimate for rows that stop early) times
    the step saved (a one-device engine's light-load decode step, `EngineLoad.decode_step_s`,
    times `1 - wide_step_ratio`) exceed `switch_s`. Split when the wide engine has sequences
    waiting and more than `split_above_seqs` live. `wide_step_ratio` and `switch_s` are measured
    (`benchmarks/repartition.py`; docs/parallel.md gives this box's figures)."""

    join_below_seqs: int = 8
    wide_step_ratio: float = 0.6
    switch_s: float = 2.0
    split_above_seqs: int = 32

    def __post_init__(self) -> None:
        if self.join_below_seqs < 1:
            raise ValueError(f"join_below_seqs={self.join_below_seqs!r}: must be >= 1")
        if not 0 < self.wide_step_ratio:
            raise ValueError(f"wide_step_ratio={self.wide_step_ratio!r}: must be > 0")
        if self.switch_s < 0:
            raise ValueError(f"switch_s={self.switch_s!r}: must be >= 0")

    def should_join(self, loads: list[EngineLoad]) -> bool:
        live = sum(load.num_active for load in loads)
        if live == 0 or live > self.join_below_seqs or any(load.waiting for load in loads):
            return False
        narrow_s = max(load.decode_step_s for load in loads)
        if narrow_s <= 0 or self.wide_step_ratio >= 1:
            return False
        steps = max(load.remaining_tokens_est / load.num_active
                    for load in loads if load.num_active)
        return steps * narrow_s * (1 - self.wide_step_ratio) > self.switch_s

    def should_split(self, load: EngineLoad) -> bool:
        return load.waiting > 0 and load.num_active > self.split_above_seqs


@dataclasses.dataclass
class SwitchReport:
    """One switch: which way, what moved, and where its seconds went (rank 0's wall clock;
    `reshard_s` is the slowest rank's)."""

    direction: str  # "join" (engines -> TP engines) or "split"
    seqs: int
    kv_bytes: int
    export_s: float
    group_s: float
    reshard_s: float
    import_s: float
    total_s: float
    reshard_s_per_rank: list[float] = dataclasses.field(default_factory=list)
    width: int = 0  # the TP engines' width (ranks each): the group's size for one TP engine
    engines: int = 1  # how many TP engines the join made (or the split ended)
    tp_sizes: list[int] = dataclasses.field(default_factory=list)  # a join: each TP engine's
    # model's TP size, as the process that holds it reports it (rank 0's first)


def check_group(config: EngineConfig, size: int, width: int | None = None) -> EngineConfig:
    """The config of the TP engines a join makes, `width` ranks each (None: `size`, one TP
    engine); ValueError naming what a group cannot do, before anything starts or loads."""
    from batchgen_data.worker.tp import runner as tp_runner
    from batchgen_data.worker.devices import pick_device, resolve_device
    from batchgen_data.models import loader

    if not isinstance(size, int) or size < 2:
        raise ValueError(f"size={size!r}: an engine group needs at least 2 engines")
    width = size if width is None else width
    if not isinstance(width, int) or isinstance(width, bool) or not 2 <= width <= size \
            or size % width:
        raise ValueError(f"width={width!r}: the TP width a group of {size} engines joins into "
                         f"must divide {size} and be at least 2 (its blocks of `width` "
                         "consecutive engines each become one TP engine)")
    if config.tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}: the engines of "
                         "a group start with one device each (the group sets the TP size)")
    if config.rank_devices is not None:
        raise ValueError(f"rank_devices={config.rank_devices!r}: an engine group puts process "
                         "r on the index of `device` plus r")
    if config.distributed_executor_backend == "ray":
        raise ValueError("distributed_executor_backend='ray': an engine group runs its engines "
                         "as processes on this node ('mp')")
    wide = dataclasses.replace(config, tensor_parallel_size=width)  # checks the combination
    path = loader.resolve_model_path(config.model)
    hf_config = loader.load_config(path, config.trust_remote_code)
    if getattr(hf_config, "quantization_config", None):
        raise ValueError(f"tensor_parallel_size={width}: quantized checkpoints are not sharded "
                         "yet (docs/parallel.md)")
    device = resolve_device(pick_device(config.device))
    tp_runner.check_tp(wide, hf_config, False, device, width)
    return wide


def queued(pending: dict[int, dict[str, list[Any]]], rid: str) -> bool:
    return any(kw["request_id"] == rid for w in pending.values() for kw in w.get("submit", ()))


def kv_bytes(states: list[dict[str, Any]]) -> int:
    return sum(k.numel() * k.element_size() * 2 for st in states for seq in st["seqs"]
               for k, _ in seq.get("kv") or ())


def spread(states: list[dict[str, Any]], size: int) -> list[list[dict[str, Any]]]:
    """The requests over `size` engines, the longest first onto the one with the fewest KV
    tokens so far."""
    def tokens(st: dict[str, Any]) -> int:
        return sum(len(s["output_token_ids"]) for s in st["seqs"]) + len(st["prompt_token_ids"])

    share: list[list[dict[str, Any]]] = [[] for _ in range(size)]
    load = [0] * size
    for st in sorted(states, key=tokens, reverse=True):
        r = min(range(size), key=lambda i: (load[i], i))
        share[r].append(st)
        load[r] += tokens(st)
    return share
