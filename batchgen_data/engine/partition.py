"""Re-partition as an engine primitive: engines on one node that turn into one wider
tensor-parallel engine mid-job, and back, keeping every live sequence (docs/parallel.md).

`EngineGroup(config, size=2)` runs `size` one-device engines ("DP", data parallel): this
process's, which is rank 0, and `size - 1` engine processes it starts
(`python -m batchgen_data.engine.rank_worker ... engine`, `partition_worker.serve`), each with
the full weights on its own device. `submit` places a request on the engine with the fewest
live ones; `step` steps them all at once (rank 0 sends the step, with whatever each engine is
to submit, then steps its own while the others step theirs, then gathers their finished
outputs and loads). `repartition()` joins them into ONE engine of `tensor_parallel_size=size`:

  1. export: every live request leaves its engine as plain data with its KV (all heads);
  2. group: the processes build a model group (gloo on the CPU, NCCL on CUDA);
  3. reshard: each process cuts its full weights to its shard in memory (no reload from
     disk; `models/reshard.py`, the slices of `models/tp_shards.py`), after its old KV cache
     is freed, and lays out a KV cache of its heads (the ranks agree on the block count);
  4. import: the requests enter the TP engine on rank 0; their KV is split by heads as it is
     written (`TPRunner.write_kv`: each rank keeps its heads) at their first step.
The sequence coroutines restart from the exported state (`Engine.export` / `import_`), so
every generated token, seed and stop state carries over and greedy or seeded tokens are those
of a run without the switch. `split()` is the way back: export from the TP engine (its KV read
whole from the ranks), release the ranks, all-gather every weight whole again on every rank
(the shards are the only copy: no host copy is kept), then the requests are spread over the
engines by KV tokens.

A `PartitionPolicy` passed in decides when, each step, from the engines' `load()` reports: join
once the job's tail is short (at most `join_below_seqs` live sequences, none waiting) and the
modelled saving pays for the switch; split when new work queues up behind a wide engine.

Every wait of rank 0 on another process is bounded by `collective_timeout_s`: a process that
dies or stalls, between switches or during one, makes the group dead, `EngineDeadError`
naming the rank and the end of its log, now and on every later call (as a TP engine).
MoE models re-shard their experts as the wide engine runs them: a slice of every expert's
width, or whole experts per rank with `enable_expert_parallel=True` (the one-device engines
ignore the flag). Not built: more than one TP engine per group (N engines -> N / k engines k
wide), quantized checkpoints, FP8 KV caches, LoRA (each refused by name when the group is
built).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from batchgen_data.config import EngineConfig, make_engine_config
from batchgen_data.distributed import launch, messages
from batchgen_data.engine.engine import Engine
from batchgen_data.engine.partition_worker import Member, ModelPieces
from batchgen_data.layers.parallel import CollectiveError
from batchgen_data.outputs import RequestOutput
from batchgen_data.placement import EngineLoad
from batchgen_data.sampling_params import SamplingParams


def _dead_error(msg: str) -> Exception:
    from batchgen_data.engine.driver import EngineDeadError  # driver imports the engine

    return EngineDeadError(msg)


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

    direction: str  # "join" (engines -> one TP engine) or "split"
    seqs: int
    kv_bytes: int
    export_s: float
    group_s: float
    reshard_s: float
    import_s: float
    total_s: float
    reshard_s_per_rank: list[float] = dataclasses.field(default_factory=list)


class EngineGroup:
    def __init__(self, config: EngineConfig, size: int = 2,
                 policy: PartitionPolicy | None = None,
                 on_phase: Callable[[str], None] | None = None) -> None:
        """`on_phase(name)`: called as each switch phase starts ("export", "group",
        "reshard", "import"), the seam benchmarks and failure tests use."""
        self.wide_config = _check(config, size)
        self.config, self.size, self.policy = config, size, policy
        self.on_phase = on_phase
        device_type = "cuda" if config.device.startswith("cuda") else (
            "cuda" if config.device == "auto" and torch.cuda.is_available() else "cpu")
        if device_type == "cpu" and config.num_threads is None:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # as the others do
        self.ranks = launch.start(config, size, device_type, config.collective_timeout_s,
                                  role="engine")
        self.member = Member(config, self.ranks, device_type)
        self._dead: str | None = None
        try:
            self.engine: Engine = Engine(config)  # this process's, while they are separate
            self.ranks.agree_min("engine_ready", 1)  # the others loaded theirs
        except BaseException:
            self.ranks.close()
            raise
        self.width = 1  # 1: `size` separate engines; `size`: one TP engine (self.engine)
        self.where: dict[str, int] = {}  # live request -> the engine (rank) that holds it
        self.loads: list[EngineLoad] = [self.engine.load(r) for r in range(size)]
        self.switches: list[SwitchReport] = []
        self._work: dict[int, dict[str, list[Any]]] = {}  # for the others' next step
        self._ids = itertools.count()
        self._tags = itertools.count()

    @classmethod
    def from_kwargs(cls, model: str | None = None, size: int = 2,
                    policy: PartitionPolicy | None = None, **kwargs: Any) -> "EngineGroup":
        return cls(make_engine_config(model, **kwargs), size, policy)

    # ---- work -----------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def check_request(self, prompt_token_ids: Any, params: Any) -> None:
        """`Engine.check_request` (every engine of a group has the same model and limits)."""
        self.engine.check_request(prompt_token_ids, params)

    def check_lora(self, lora_request: Any) -> None:
        if lora_request is not None:
            raise ValueError("lora_request: an engine group runs the base model only "
                             "(LoRA groups are not built: docs/parallel.md)")

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
               request_id: str | None = None, prompt: str | None = None,
               lora_request: Any = None) -> str:
        self._alive()
        self.check_lora(lora_request)
        params = params or SamplingParams()
        rid = request_id if request_id is not None else f"group-{next(self._ids)}"
        if rid in self.where:
            raise ValueError(f"request_id={rid!r} is already in this group")
        rank = 0 if self.width > 1 else min(
            range(self.size), key=lambda r: (sum(1 for w in self.where.values() if w == r), r))
        if rank == 0:
            self.engine.submit(prompt_token_ids, params, request_id=rid, prompt=prompt)
        else:  # the same model and limits: checked here, sent with the next step
            self.engine.check_request(prompt_token_ids, params)
            self._work.setdefault(rank, {}).setdefault("submit", []).append(dict(
                prompt_token_ids=list(prompt_token_ids), params=params, request_id=rid,
                prompt=prompt))
        self.where[rid] = rank
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.where)

    def step(self) -> list[RequestOutput]:
        """One step of every engine (or of the TP engine), then the policy's switch, if any."""
        self._alive()
        if self.width == 1:
            work, self._work = self._work, {}
            self._call(messages.send, self.ranks.control, {"kind": "step", "work": work})
            outs = self.engine.step()  # while the others step theirs
            replies = self._call(messages.gather, self.ranks.control, {})[1:]
            for rank, reply in enumerate(replies, start=1):
                outs.extend(reply["outputs"])
                self.loads[rank] = reply["load"]
        else:
            outs = self._call(self.engine.step)  # (TPRunner: EngineDeadError if a rank is gone)
        self.loads[0] = self.engine.load(0)
        for out in outs:
            self.where.pop(out.request_id, None)
        if self.policy is not None:
            if self.width == 1 and self.policy.should_join(self.loads):
                self.repartition()
            elif self.width > 1 and self.policy.should_split(self.loads[0]):
                self.split()
        return outs

    # ---- the switches ---------------------------------------------------------------------
    def repartition(self) -> SwitchReport:
        """The `size` engines become one TP engine, every live request kept."""
        self._alive()
        if self.width > 1:
            raise RuntimeError("the group is already one tensor-parallel engine")
        t_start = time.perf_counter()
        self._phase("export")
        pending, self._work = self._work, {}  # not sent yet: submit them to the TP engine
        ids = {r: [rid for rid, w in self.where.items() if w == r and not _queued(pending, rid)]
               for r in range(self.size)}
        self._call(messages.send, self.ranks.control, {"kind": "export", "ids": ids})
        states = [self.engine.export(rid, include_kv=True) for rid in ids[0]]
        for reply in self._call(messages.gather, self.ranks.control, {})[1:]:
            states.extend(reply["states"])
        export_s = time.perf_counter() - t_start
        self._phase("group")
        tag = f"join{next(self._tags)}"
        self._call(messages.send, self.ranks.control, {"kind": "join", "tag": tag})
        group_s = self._call(self.member.join_group, tag)
        t0 = time.perf_counter()
        self._phase("reshard")
        pieces = ModelPieces.of(self.engine)
        del self.engine  # its KV cache goes first (Member.narrow collects it)
        parts, mine = self._call(self.member.narrow, pieces, tag)
        theirs = [{"reshard_s": mine}] + self._call(messages.gather, self.ranks.control,
                                                    {})[1:]
        reshard_s = time.perf_counter() - t0  # until the slowest rank is done
        t0 = time.perf_counter()
        self._phase("import")
        self.engine = Engine(self.wide_config, parts)
        for state in states:
            self.engine.import_(state)
        for rank_work in pending.values():
            for kw in rank_work.get("submit", ()):
                self.engine.submit(**kw)
        self.where = dict.fromkeys(self.where, 0)
        self.width = self.size
        report = SwitchReport("join", len(states), _kv_bytes(states), export_s, group_s,
                              reshard_s, time.perf_counter() - t0,
                              time.perf_counter() - t_start,
                              [t["reshard_s"] for t in theirs])
        self.switches.append(report)
        return report

    def split(self) -> SwitchReport:
        """The TP engine becomes `size` engines again, every live request kept."""
        self._alive()
        if self.width == 1:
            raise RuntimeError("the group is already separate engines")
        t_start = time.perf_counter()
        self._phase("export")
        states = [self._call(self.engine.export, rid, True) for rid in list(self.where)]
        export_s = time.perf_counter() - t_start
        t0 = time.perf_counter()
        self._phase("reshard")
        self._call(self.engine.runner.release)  # the other ranks leave `serve`
        pieces = ModelPieces.of(self.engine)
        del self.engine
        self.engine, mine = self._call(self.member.widen, pieces)
        theirs = [{"reshard_s": mine}] + self._call(messages.gather, self.ranks.control,
                                                    {})[1:]
        reshard_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._phase("import")
        share = _spread(states, self.size)
        for state in share[0]:
            self.engine.import_(state)
        self._call(messages.send, self.ranks.control, {
            "kind": "import", "states": {r: share[r] for r in range(1, self.size)}})
        for rank, reply in enumerate(self._call(messages.gather, self.ranks.control, {})[1:],
                                     start=1):
            self.loads[rank] = reply["load"]
        self.where = {st["request_id"]: r for r in range(self.size) for st in share[r]}
        self.width = 1
        report = SwitchReport("split", len(states), _kv_bytes(states), export_s, 0.0,
                              reshard_s, time.perf_counter() - t0,
                              time.perf_counter() - t_start,
                              [t["reshard_s"] for t in theirs])
        self.switches.append(report)
        return report

    def close(self) -> None:
        if self._dead is None:
            self._dead = "engine group was closed"
            try:
                if self.width > 1:
                    self.engine.runner.close()
                else:
                    messages.send(self.ranks.control, {"kind": "stop"})
            except Exception:  # noqa: BLE001 (closing: the processes are stopped below)
                pass
        self.ranks.close()

    # ---- failures -------------------------------------------------------------------------
    def _alive(self) -> None:
        if self._dead is not None:
            raise _dead_error(self._dead)

    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, any failure to reach another process making the group dead."""
        try:
            return fn(*args)
        except Exception as exc:
            if type(exc).__name__ == "EngineDeadError":  # the TP engine's own report
                self._dead = str(exc)
                self.ranks.close()
                raise
            deadline = time.monotonic() + 1.0  # a process that just died: let its exit show
            while self.ranks.dead() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            why = self.ranks.dead() or ("a rank stalled" if isinstance(exc, CollectiveError)
                                        else type(exc).__name__)
            self._dead = f"engine group is dead ({why}): {exc}"
            self.ranks.close()
            raise _dead_error(self._dead) from exc


def _check(config: EngineConfig, size: int) -> EngineConfig:
    """The TP engine's config; ValueError naming what a group cannot do, before anything
    starts or loads."""
    from batchgen_data.engine import tp_runner
    from batchgen_data.devices import pick_device, resolve_device
    from batchgen_data.models import loader

    if not isinstance(size, int) or size < 2:
        raise ValueError(f"size={size!r}: an engine group needs at least 2 engines")
    if config.tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}: the engines of "
                         "a group start with one device each (the group sets the TP size)")
    if config.parts_builder is not None:
        raise ValueError("parts_builder: an engine group re-shards real model weights")
    if config.distributed_executor_backend == "ray":
        raise ValueError("distributed_executor_backend='ray': an engine group runs its engines "
                         "as processes on this node ('mp')")
    if config.cache.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={config.cache.kv_cache_dtype!r}: an engine group "
                         "re-splits KV caches in the model's dtype only (docs/parallel.md)")
    wide = dataclasses.replace(config, tensor_parallel_size=size)  # checks the combination
    path = loader.resolve_model_path(config.model)
    hf_config = loader.load_config(path, config.trust_remote_code)
    if getattr(hf_config, "quantization_config", None):
        raise ValueError(f"tensor_parallel_size={size}: quantized checkpoints are not sharded "
                         "yet (docs/parallel.md)")
    device = resolve_device(pick_device(config.device))
    tp_runner.check_tp(wide, hf_config, False, device, size)
    return wide


def _queued(pending: dict[int, dict[str, list[Any]]], rid: str) -> bool:
    return any(kw["request_id"] == rid for w in pending.values() for kw in w.get("submit", ()))


def _kv_bytes(states: list[dict[str, Any]]) -> int:
    return sum(k.numel() * k.element_size() * 2 for st in states for seq in st["seqs"]
               for k, _ in seq.get("kv") or ())


def _spread(states: list[dict[str, Any]], size: int) -> list[list[dict[str, Any]]]:
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
