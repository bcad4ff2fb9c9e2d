"""Re-partition as an engine primitive: engines on one node that turn into wider
tensor-parallel engines mid-job, and back, keeping every live sequence (docs/parallel.md, which
has the design, the tests and the measured cost).

`EngineGroup(config, size=2)` runs `size` one-device engines: this process's, which is rank 0,
and `size - 1` engine processes it starts (`engine/rank_worker.py`, `member.serve`), each with
the full weights on its own device. `submit` places a request on the engine with the fewest
live ones; `step` steps them all at once (rank 0 sends the step, with what each engine is to
submit or abort, steps its own while the others step theirs, then gathers their outputs and
loads). `repartition()` joins them into `size // width` engines of
`tensor_parallel_size=width` (by default one TP engine of `size`), in four phases: every live
request exported with its KV; the model and control groups of each block of `width` ranks
built; each process's full weights cut to its shard in memory (`models/reshard.py`, no reload
from disk) with a KV cache of its heads; the requests imported, spread by KV tokens. While
joined, rank 0 steps the other TP engines through their leaders (`member.lead`); a block's
other ranks serve their leader's engine (`TPRunner.serve`). `split()` is the way back (the
weights all-gathered whole on every rank). The sequence coroutines restart from the exported
state, so greedy or seeded tokens are those of a run without the switch. A `PartitionPolicy`
decides when, each step, from the engines' `load()` reports. Rank 0's waits on the others are
bounded; a process that dies or stalls makes the group dead (engine/group/guard.py).
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
from batchgen_data.engine.group.guard import Guard
from batchgen_data.engine.group.member import Member, ModelPieces, own_device
from batchgen_data.outputs import RequestOutput
from batchgen_data.lora_request import AdapterNames
from batchgen_data.placement import EngineId, EngineLoad
from batchgen_data.sampling_params import SamplingParams

__all__ = ["EngineGroup", "PartitionPolicy", "SwitchReport"]

class EngineGroup:
    kind = "engine group"

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
        self.guard = Guard(self.ranks)
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

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len  # every engine of a group has the same model

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

    def lora_names(self) -> AdapterNames | None:
        """`Engine.lora_names` (every engine of a group has the same adapter settings)."""
        return self.engine.lora_names()

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
               request_id: str | None = None, prompt: str | None = None,
               lora_request: Any = None) -> str:
        self.guard.check()
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

    def num_unfinished(self) -> int:
        return len(self.where)

    def abort(self, request_id: str) -> bool:
        """End a request on the engine that holds it: rank 0's now, another's with its next
        step (after what it is to submit); its output comes with a later `step`."""
        self.guard.check()
        rank = self.where.get(request_id)
        if rank is None:
            return False
        if rank == 0:
            self.guard.call(self.engine.abort, request_id)
        else:
            self._work.setdefault(rank, {}).setdefault("abort", []).append(request_id)
        return True

    def export(self, request_id: str, include_kv: bool = False) -> dict[str, Any]:
        raise NotImplementedError("export: an engine group moves requests between its own "
                                  "engines; export from an Engine (one engine, no "
                                  "data_parallel_size)")

    def import_(self, state: dict[str, Any], front: bool = True) -> str:
        raise NotImplementedError("import_: an engine group places requests on its own "
                                  "engines; submit them, or import into an Engine")

    def load(self, engine_id: EngineId = None) -> EngineLoad:
        raise NotImplementedError("load: an engine group has one load per engine "
                                  "(EngineGroup.loads), not one for a placement policy")

    def reset_prefix_cache(self) -> bool:
        raise NotImplementedError("reset_prefix_cache: an engine group does not reset its "
                                  "engines' prefix caches; run one engine (no "
                                  "data_parallel_size) to reset its cache")

    def step(self) -> list[RequestOutput]:
        """One step of every engine (separate or TP), then the policy's switch, if any."""
        self.guard.check()
        others = self.ranks.control if self.width == 1 else self.member.leaders
        if others is None:  # one TP engine (TPRunner: EngineDeadError if a rank is gone)
            outs = self.guard.call(self.engine.step)
        else:
            work, self._work = self._work, {}
            self.guard.call(messages.send, others, {"kind": "step", "work": work})
            outs = self.guard.call(self.engine.step)  # while the others step theirs
            replies = self.guard.call(messages.gather, others, {})[1:]
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

    def _replace(self, pending: dict[int, dict[str, list[Any]]]) -> None:
        """Work not yet sent when a switch began, placed again on the engines it left."""
        for rank_work in pending.values():
            for kw in rank_work.get("submit", ()):
                self._place(kw)
        for rank_work in pending.values():
            for rid in rank_work.get("abort", ()):
                self.abort(rid)

    # ---- the switches ---------------------------------------------------------------------
    def repartition(self) -> SwitchReport:
        """The `size` engines become `size // join_width` TP engines, every live request
        kept."""
        self.guard.check()
        if self.width > 1:
            raise RuntimeError("the group is already joined into tensor-parallel engines")
        t_start = time.perf_counter()
        self._phase("export")
        pending, self._work = self._work, {}  # not sent yet: placed on the TP engines
        ids = {r: [rid for rid, w in self.where.items() if w == r and not queued(pending, rid)]
               for r in range(self.size)}
        self.guard.call(messages.send, self.ranks.control, {"kind": "export", "ids": ids})
        states = [self.engine.export(rid, include_kv=True) for rid in ids[0]]
        for reply in self.guard.call(messages.gather, self.ranks.control, {})[1:]:
            states.extend(reply["states"])
        export_s = time.perf_counter() - t_start
        self._phase("group")
        tag, width = f"join{next(self._tags)}", self.join_width
        self.guard.call(messages.send, self.ranks.control, {"kind": "join", "tag": tag,
                                                       "width": width})
        group_s = self.guard.call(self.member.join_group, tag, width)
        t0 = time.perf_counter()
        self._phase("reshard")
        pieces = ModelPieces.of(self.engine)
        del self.engine  # its KV cache goes first (Member.narrow collects it)
        parts, mine = self.guard.call(self.member.narrow, pieces, tag)
        theirs = [{"reshard_s": mine}] + self.guard.call(messages.gather, self.ranks.control,
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
            self.guard.call(messages.send, self.member.leaders, {
                "kind": "import", "states": dict(zip(heads[1:], share[1:]))})
            for rank, reply in zip(heads[1:], self.guard.call(messages.gather, self.member.leaders,
                                                         {})[1:]):
                self.loads[rank] = reply["load"]
                tp_sizes.append(reply["tp_size"])
        self.where = {st["request_id"]: heads[b] for b, part in enumerate(share) for st in part}
        self._replace(pending)
        report = SwitchReport("join", len(states), kv_bytes(states), export_s, group_s,
                              reshard_s, time.perf_counter() - t0,
                              time.perf_counter() - t_start,
                              [t["reshard_s"] for t in theirs], width, len(heads), tp_sizes)
        self.switches.append(report)
        return report

    def split(self) -> SwitchReport:
        """The TP engines become `size` engines again, every live request kept."""
        self.guard.check()
        if self.width == 1:
            raise RuntimeError("the group is already separate engines")
        t_start = time.perf_counter()
        self._phase("export")
        heads, leaders = self.heads(), self.member.leaders
        pending, self._work = self._work, {}  # not sent to a leader yet: placed after
        held = {r: [rid for rid, w in self.where.items() if w == r and not queued(pending, rid)]
                for r in heads}
        if leaders is not None:  # each exports its own while rank 0 exports its
            self.guard.call(messages.send, leaders, {"kind": "split", "ids": held})
        states = [self.guard.call(self.engine.export, rid, True) for rid in held[0]]
        if leaders is not None:
            for reply in self.guard.call(messages.gather, leaders, {})[1:]:
                states.extend(reply["states"])
        export_s = time.perf_counter() - t_start
        t0 = time.perf_counter()
        self._phase("reshard")
        self.guard.call(self.engine.runner.release)  # the other ranks leave `serve`
        pieces = ModelPieces.of(self.engine)
        del self.engine
        self.engine, mine = self.guard.call(self.member.widen, pieces)
        theirs = [{"reshard_s": mine}] + self.guard.call(messages.gather, self.ranks.control,
                                                    {})[1:]
        reshard_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._phase("import")
        share = spread(states, self.size)
        for state in share[0]:
            self.engine.import_(state)
        self.guard.call(messages.send, self.ranks.control, {
            "kind": "import", "states": {r: share[r] for r in range(1, self.size)}})
        for rank, reply in enumerate(self.guard.call(messages.gather, self.ranks.control, {})[1:],
                                     start=1):
            self.loads[rank] = reply["load"]
        self.where = {st["request_id"]: r for r in range(self.size) for st in share[r]}
        width, self.width = self.width, 1
        self._replace(pending)
        report = SwitchReport("split", len(states), kv_bytes(states), export_s, 0.0,
                              reshard_s, time.perf_counter() - t0,
                              time.perf_counter() - t_start,
                              [t["reshard_s"] for t in theirs], width, len(heads))
        self.switches.append(report)
        return report

    def close(self) -> None:
        if self.guard.dead is None:
            self.guard.dead = "engine group was closed"
            try:
                if self.width > 1:
                    if self.member.leaders is not None:
                        messages.send(self.member.leaders, {"kind": "stop"})
                    self.engine.close()
                else:
                    messages.send(self.ranks.control, {"kind": "stop"})
            except Exception:  # noqa: BLE001 (closing: the processes are stopped below)
                pass
        self.ranks.close()

    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)
