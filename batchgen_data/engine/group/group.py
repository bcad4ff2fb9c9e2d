"""Re-partition as an engine primitive: engines on one node that turn into wider
tensor-parallel engines mid-job, and back, keeping every live sequence (docs/parallel.md).

`EngineGroup(config, size=2)` runs `size` one-device engines ("DP", data parallel): this
process's, which is rank 0, and `size - 1` engine processes it starts
(`python -m batchgen_data.engine.rank_worker ... engine`, `partition_worker.serve`), each with
the full weights on its own device. `submit` places a request on the engine with the fewest
live ones; `step` steps them all at once (rank 0 sends the step, with whatever each engine is
to submit, then steps its own while the others step theirs, then gathers their finished
outputs and loads). `repartition()` joins them into `size // width` engines of
`tensor_parallel_size=width` (`width`: a divisor of `size`, at least 2; by default `size`, ONE
TP engine): block b, ranks [b*width, (b+1)*width), becomes one TP engine led by its first rank:

  1. export: every live request leaves its engine as plain data with its KV (all heads);
  2. group: the processes of each block build its model group (gloo on the CPU, NCCL on
     CUDA) and its control group, the blocks' leaders a group of their own
     (`launch.block_groups`; one TP engine keeps the group's control group);
  3. reshard: each process cuts its full weights to its shard in memory (no reload from
     disk; `models/reshard.py`, the slices of `models/tp_shards.py`), after its old KV cache
     is freed, and lays out a KV cache of its heads (the ranks agree on the block count);
  4. import: the requests are spread over the TP engines by KV tokens, each importing its
     share on its leader; their KV is split by heads as it is written (`TPRunner.write_kv`:
     each rank keeps its heads) at their first step.
While joined, rank 0 steps the other TP engines through their leaders (`partition_worker.lead`,
over the leaders' group: the step, with what each is to submit, then its outputs and load)
while it steps its own, as it steps the separate engines; a block's other ranks serve their
leader's TP engine (`TPRunner.serve`). `self.where` maps each request to the rank whose engine
holds it (a leader, when joined).
The sequence coroutines restart from the exported state (`Engine.export` / `import_`), so
every generated token, seed and stop state carries over and greedy or seeded tokens are those
of a run without the switch. `split()` is the way back: export from each TP engine (its KV read
whole from its ranks), release the ranks, all-gather every weight whole again on every rank of
each block (the shards are the only copy: no host copy is kept), then the requests are spread
over the `size` engines by KV tokens.

A `PartitionPolicy` passed in decides when, each step, from the engines' `load()` reports: join
once the job's tail is short (at most `join_below_seqs` live sequences, none waiting) and the
modelled saving pays for the switch; split when new work queues up behind any wide engine.
The group's `width` (the constructor's) is the width every join makes.

Every wait of rank 0 on another process is bounded by `collective_timeout_s`: a process that
dies or stalls, between switches or during one, makes the group dead, `EngineDeadError`
naming the rank and the end of its log, now and on every later call (as a TP engine). Only
rank 0 holds the processes: a leader's TP engine that loses a rank fails its own bounded
collective and its process ends, which rank 0's bounded wait on the leaders then reports.
MoE models re-shard their experts as the wide engine runs them: a slice of every expert's
width, or whole experts per rank with `enable_expert_parallel=True` (the one-device engines
ignore the flag). Tested on the CPU: 2 engines -> one TP=2 engine and back
(tests/integration/test_partition.py), 4 engines -> 2 TP=2 engines and back, with new requests
while joined (tests/integration/test_partition_blocks.py). FP8 KV caches move as their e4m3
codes, the checkpoint's K/V scales going with the weights (`models/reshard.py`). Not built:
quantized checkpoints (refused by name when the group is built). Requests keep their LoRA
adapters through every switch (export / import carry them).
"""
from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from batchgen_data.config import EngineConfig, make_engine_config
from batchgen_data.worker.tp import launch, messages
from batchgen_data.engine.engine import Engine
from batchgen_data.engine.group.policy import (PartitionPolicy, SwitchReport, check_group,
                                                   kv_bytes, queued, spread)
from batchgen_data.engine.group.member import Member, ModelPieces, own_device
from batchgen_data.layers.parallel import CollectiveError
from batchgen_data.outputs import RequestOutput
from batchgen_data.placement import EngineLoad
from batchgen_data.sampling_params import SamplingParams

__all__ = ["EngineGroup", "PartitionPolicy", "SwitchReport"]

def _dead_error(msg: str) -> Exception:
    from batchgen_data.core.errors import EngineDeadError

    return EngineDeadError(msg)


class EngineGroup:
    def __init__(self, config: EngineConfig, size: int = 2,
                 policy: PartitionPolicy | None = None,
                 on_phase: Callable[[str], None] | None = None,
                 width: int | None = None) -> None:
        """`width`: how many engines each TP engine of a join takes (a divisor of `size`, at
        least 2; None: `size`, one TP engine). `on_phase(name)`: called as each switch phase
        starts ("export", "group", "reshard", "import"), the seam benchmarks and failure tests
        use."""
        self.wide_config = check_group(config, size, width)
        self.join_width: int = self.wide_config.tensor_parallel_size
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
            # this process's engine (rank 0's block's TP engine when joined)
            self.engine: Engine = Engine(own_device(config, 0, device_type))
            self.ranks.agree_min("engine_ready", 1)  # the others loaded theirs
        except BaseException:
            self.ranks.close()
            raise
        # 1: `size` separate engines; joined: `size // width` TP engines, `width` ranks each
        self.width = 1
        self.where: dict[str, int] = {}  # live request -> the rank whose engine holds it
        self.loads: list[EngineLoad] = [self.engine.load(r) for r in range(size)]
        self.switches: list[SwitchReport] = []
        self._work: dict[int, dict[str, list[Any]]] = {}  # for the others' next step
        self._ids = itertools.count()
        self._tags = itertools.count()

    @classmethod
    def from_kwargs(cls, model: str | None = None, size: int = 2,
                    policy: PartitionPolicy | None = None, width: int | None = None,
                    **kwargs: Any) -> "EngineGroup":
        return cls(make_engine_config(model, **kwargs), size, policy, width=width)

    # ---- work -----------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def heads(self) -> list[int]:
        """The ranks that hold an engine now: every rank, or each TP engine's first."""
        return list(range(0, self.size, self.width))

    def check_request(self, prompt_token_ids: Any, params: Any) -> None:
        """`Engine.check_request` (every engine of a group has the same model and limits)."""
        self.engine.check_request(prompt_token_ids, params)

    def check_lora(self, lora_request: Any) -> None:
        """`Engine.check_lora` on rank 0's engine (every engine of a group reads the same
        adapters from the same paths)."""
        self.engine.check_lora(lora_request)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
               request_id: str | None = None, prompt: str | None = None,
               lora_request: Any = None) -> str:
        self._alive()
        self.check_lora(lora_request)
        params = params or SamplingParams()
        rid = request_id if request_id is not None else f"group-{next(self._ids)}"
        if rid in self.where:
            raise ValueError(f"request_id={rid!r} is already in this group")
        self.engine.check_request(prompt_token_ids, params)  # the same model and limits
        self._place(dict(prompt_token_ids=list(prompt_token_ids), params=params,
                         request_id=rid, prompt=prompt, lora_request=lora_request))
        return rid

    def _place(self, kw: dict[str, Any]) -> None:
        """A checked request onto the engine with the fewest live ones: rank 0's now, another's
        with its next step."""
        rank = min(self.heads(),
                   key=lambda r: (sum(1 for w in self.where.values() if w == r), r))
        if rank == 0:
            self.engine.submit(**kw)
        else:
            self._work.setdefault(rank, {}).setdefault("submit", []).append(kw)
        self.where[kw["request_id"]] = rank

    def has_unfinished(self) -> bool:
        return bool(self.where)

    def step(self) -> list[RequestOutput]:
        """One step of every engine (separate or TP), then the policy's switch, if any."""
        self._alive()
        others = self.ranks.control if self.width == 1 else self.member.leaders
        if others is None:  # one TP engine (TPRunner: EngineDeadError if a rank is gone)
            outs = self._call(self.engine.step)
        else:
            work, self._work = self._work, {}
            self._call(messages.send, others, {"kind": "step", "work": work})
            outs = self._call(self.engine.step)  # while the others step theirs
            replies = self._call(messages.gather, others, {})[1:]
            for rank, reply in zip(self.heads()[1:], replies):
                outs.extend(reply["outputs"])
                self.loads[rank] = reply["load"]
        self.loads[0] = self.engine.load(0)
        for out in outs:
            self.where.pop(out.request_id, None)
        if self.policy is not None:
            if self.width == 1 and self.policy.should_join(self.loads):
                self.repartition()
            elif self.width > 1 and any(self.policy.should_split(self.loads[r])
                                        for r in self.heads()):
                self.split()
        return outs

    # ---- the switches ---------------------------------------------------------------------
    def repartition(self) -> SwitchReport:
        """The `size` engines become `size // join_width` TP engines, every live request
        kept."""
        self._alive()
        if self.width > 1:
            raise RuntimeError("the group is already joined into tensor-parallel engines")
        t_start = time.perf_counter()
        self._phase("export")
        pending, self._work = self._work, {}  # not sent yet: placed on the TP engines
        ids = {r: [rid for rid, w in self.where.items() if w == r and not queued(pending, rid)]
               for r in range(self.size)}
        self._call(messages.send, self.ranks.control, {"kind": "export", "ids": ids})
        states = [self.engine.export(rid, include_kv=True) for rid in ids[0]]
        for reply in self._call(messages.gather, self.ranks.control, {})[1:]:
            states.extend(reply["states"])
        export_s = time.perf_counter() - t_start
        self._phase("group")
        tag, width = f"join{next(self._tags)}", self.join_width
        self._call(messages.send, self.ranks.control, {"kind": "join", "tag": tag,
                                                       "width": width})
        group_s = self._call(self.member.join_group, tag, width)
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
        self.width = width
        heads = self.heads()
        share = [states] if len(heads) == 1 else spread(states, len(heads))
        for state in share[0]:
            self.engine.import_(state)
        tp_sizes = [self.engine.runner.model.shape.tp.size]
        if self.member.leaders is not None:  # the other TP engines import theirs
            self._call(messages.send, self.member.leaders, {
                "kind": "import", "states": dict(zip(heads[1:], share[1:]))})
            for rank, reply in zip(heads[1:], self._call(messages.gather, self.member.leaders,
                                                         {})[1:]):
                self.loads[rank] = reply["load"]
                tp_sizes.append(reply["tp_size"])
        self.where = {st["request_id"]: heads[b] for b, part in enumerate(share) for st in part}
        for rank_work in pending.values():
            for kw in rank_work.get("submit", ()):
                self._place(kw)
        report = SwitchReport("join", len(states), kv_bytes(states), export_s, group_s,
                              reshard_s, time.perf_counter() - t0,
                              time.perf_counter() - t_start,
                              [t["reshard_s"] for t in theirs], width, len(heads), tp_sizes)
        self.switches.append(report)
        return report

    def split(self) -> SwitchReport:
        """The TP engines become `size` engines again, every live request kept."""
        self._alive()
        if self.width == 1:
            raise RuntimeError("the group is already separate engines")
        t_start = time.perf_counter()
        self._phase("export")
        heads, leaders = self.heads(), self.member.leaders
        pending, self._work = self._work, {}  # not sent to a leader yet: placed after
        held = {r: [rid for rid, w in self.where.items() if w == r and not queued(pending, rid)]
                for r in heads}
        if leaders is not None:  # each exports its own while rank 0 exports its
            self._call(messages.send, leaders, {"kind": "split", "ids": held})
        states = [self._call(self.engine.export, rid, True) for rid in held[0]]
        if leaders is not None:
            for reply in self._call(messages.gather, leaders, {})[1:]:
                states.extend(reply["states"])
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
        share = spread(states, self.size)
        for state in share[0]:
            self.engine.import_(state)
        self._call(messages.send, self.ranks.control, {
            "kind": "import", "states": {r: share[r] for r in range(1, self.size)}})
        for rank, reply in enumerate(self._call(messages.gather, self.ranks.control, {})[1:],
                                     start=1):
            self.loads[rank] = reply["load"]
        self.where = {st["request_id"]: r for r in range(self.size) for st in share[r]}
        width, self.width = self.width, 1
        for rank_work in pending.values():
            for kw in rank_work.get("submit", ()):
                self._place(kw)
        report = SwitchReport("split", len(states), kv_bytes(states), export_s, 0.0,
                              reshard_s, time.perf_counter() - t0,
                              time.perf_counter() - t_start,
                              [t["reshard_s"] for t in theirs], width, len(heads))
        self.switches.append(report)
        return report

    def close(self) -> None:
        if self._dead is None:
            self._dead = "engine group was closed"
            try:
                if self.width > 1:
                    if self.member.leaders is not None:
                        messages.send(self.member.leaders, {"kind": "stop"})
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
