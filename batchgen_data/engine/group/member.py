"""One process of an engine group that re-partitions (engine/group/group.py), either side.

`Member` is what every process of the group does at a switch, rank 0 (the user's process) and
the others (`rank_worker` started with role "engine") alike:
  * `narrow`: from one engine of its own (full weights) to rank r of one TP engine: the
    engine's KV cache goes first (its live sequences were exported, with their KV, before),
    then the ranks build the model group, then the process's full weights are cut to its shard
    in memory (`models/reshard.narrow_into`: no reload from disk) and a KV cache of its heads
    is laid out, the block count agreed by the ranks;
  * `widen`: back, every rank all-gathering the others' shards into the full weights
    (`models/reshard.gather_into`), then a one-device engine of its own again.
`serve` is the loop of a process other than rank 0: while the group runs as separate engines
it does what rank 0's messages say (submit and import requests, step once, export requests,
join), and while it is a rank of a TP engine it serves that engine (`TPRunner.serve`) until
the engine's first rank releases it. When a group of N joins into N / k engines k wide, the
first rank of each block of k (other than rank 0) holds its block's TP engine and `lead`s it
on rank 0's messages over the leaders' group until the split.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from batchgen_data.config import EngineConfig
from batchgen_data.worker.tp import launch, messages
from batchgen_data.worker.tp.launch import RankGroup
from batchgen_data.engine import setup
from batchgen_data.engine.engine import Engine
from batchgen_data.engine.setup import EngineParts
from batchgen_data.layers import long_rope, parallel
from batchgen_data.models import loader, reshard


@dataclasses.dataclass
class ModelPieces:
    """What an engine's parts keep across a switch (the model changes shape, these do not)."""

    model: torch.nn.Module
    backend: Any
    device: torch.device
    tokenizer: Any
    stopper: Any
    scheduler_config: Any

    @classmethod
    def of(cls, engine: Engine) -> "ModelPieces":
        """`engine`'s pieces; its runner's KV cache and fast paths are freed (the engine is
        done: every live request has left it)."""
        engine.runner.free()
        return cls(engine.runner.model, engine.runner.backend, engine.device, engine.tokenizer,
                   engine.stopper, engine.scheduler.config)


class Member:
    def __init__(self, config: EngineConfig, ranks: RankGroup, device_type: str) -> None:
        self.config = config  # one device each
        self.wide_config = dataclasses.replace(config, tensor_parallel_size=ranks.size)
        self.ranks = ranks
        self.device_type = device_type
        self.block = ranks  # the ranks of this process's TP engine (all of them when N == k)
        self.leaders: parallel.TensorParallel | None = None  # a leader's, when N > k

    def join_group(self, tag: str, width: int | None = None) -> float:
        """Every rank: the model group of its TP engine (keys under `tag`), `width` ranks wide
        (None: all of them, one engine); its seconds. Narrower: the groups of this process's
        block of `width` consecutive ranks, and of the blocks' leaders
        (`launch.block_groups`)."""
        t0 = time.perf_counter()
        width = width or self.ranks.size
        self.wide_config = dataclasses.replace(self.config, tensor_parallel_size=width)
        if width == self.ranks.size:
            self.block, self.leaders = self.ranks, None
            self.ranks.tp = launch.model_group(self.ranks, tag, self.device_type,
                                               self.config.enable_expert_parallel)
        else:
            blocks = launch.block_groups(self.ranks, tag, width, self.device_type,
                                         self.config.enable_expert_parallel)
            self.block, self.leaders = blocks.ranks, blocks.leaders
        return time.perf_counter() - t0

    def narrow(self, pieces: ModelPieces, tag: str) -> tuple[EngineParts, float]:
        """This process's parts of the TP engine (after `join_group`), from `pieces` of an
        engine whose runner (and KV cache) the caller has dropped; the seconds it took."""
        t0 = time.perf_counter()
        tp = self.block.tp
        full, p = pieces.model, pieces
        pieces.model = None  # type: ignore[assignment]  (narrow_into frees it weight by weight)
        with parallel.sharding(tp), long_rope.context_length(self.wide_config.max_model_len):
            shard = loader.build_model(full.config, p.backend.dtype, p.device, p.backend)
        reshard.narrow_into(shard, full)
        del full
        loader.finalize(shard)  # the shard's weights into the kernels' layouts
        max_len, pool, held, runner = setup.runner_parts(
            self.wide_config, shard, p.backend, p.device, p.scheduler_config, self.block,
            blocks_key=f"{tag}/{self.ranks.rank // self.block.size}/num_kv_blocks",
            limit_s=self.ranks.timeout.total_seconds())
        parts = EngineParts(shard, p.tokenizer, p.device, max_len, pool, held, runner,
                            p.stopper, p.scheduler_config)
        return parts, time.perf_counter() - t0

    def widen(self, pieces: ModelPieces) -> tuple[Engine, float]:
        """An engine of this process's own again, from `pieces` of the TP engine (its runner
        dropped): every weight gathered whole from the ranks' shards."""
        t0 = time.perf_counter()
        shard, p = pieces.model, pieces
        pieces.model = None  # type: ignore[assignment]
        with long_rope.context_length(self.config.max_model_len):  # as setup builds it
            full = loader.build_model(shard.config, p.backend.dtype, p.device, p.backend)
        reshard.gather_into(full, shard, self.block.tp.all_gather)
        del shard
        loader.finalize(full)
        self.ranks.tp = parallel.TensorParallel(self.ranks.rank, self.ranks.size)  # unused now
        self.block, self.leaders = self.ranks, None
        max_len, pool, held, runner = setup.runner_parts(self.config, full, p.backend, p.device,
                                                         p.scheduler_config)
        engine = Engine(self.config, EngineParts(full, p.tokenizer, p.device, max_len, pool,
                                                 held, runner, p.stopper, p.scheduler_config))
        return engine, time.perf_counter() - t0


def own_device(config: EngineConfig, rank: int, device_type: str) -> EngineConfig:
    """The config of process `rank`'s one-device engine: on CUDA its own GPU, cuda:(the index
    of `device`) + rank, the device it keeps as a rank of a TP engine; the CPU is shared."""
    if device_type != "cuda":
        return config
    from batchgen_data.worker.tp.runner import device_of_rank

    return dataclasses.replace(config, device=str(device_of_rank(config, rank)))


def serve(config: EngineConfig, ranks: RankGroup, device_type: str) -> None:
    """A process of the group other than rank 0: its engine, then whatever rank 0 says. Any
    error ends the process, and rank 0 reports the group dead with the end of its log."""
    member = Member(config, ranks, device_type)
    engine: Engine | None = Engine(own_device(config, ranks.rank, device_type))
    control = ranks.control
    ranks.agree_min("engine_ready", 1)  # rank 0 waits for every engine to load
    while True:
        msg = messages.receive(control)
        kind = msg["kind"]
        if kind == "stop":
            return
        assert engine is not None
        if kind == "step":
            mine = msg["work"].get(ranks.rank, {})
            for kw in mine.get("submit", ()):
                engine.submit(**kw)
            for state in mine.get("import", ()):
                engine.import_(state)
            for rid in mine.get("abort", ()):
                engine.abort(rid)
            outs = engine.step()
            messages.gather(control, {"outputs": outs, "load": engine.load(ranks.rank)})
        elif kind == "export":
            ids = msg["ids"].get(ranks.rank, [])
            messages.gather(control, {"states": [engine.export(r, include_kv=True)
                                                 for r in ids]})
        elif kind == "import":
            for state in msg["states"].get(ranks.rank, ()):
                engine.import_(state)
            messages.gather(control, {"load": engine.load(ranks.rank)})
        elif kind == "join":
            pieces = ModelPieces.of(engine)
            engine = None  # its runner and KV cache go before the shard is built
            group_s = member.join_group(msg["tag"], msg.get("width"))
            parts, reshard_s = member.narrow(pieces, msg["tag"])
            messages.gather(control, {"group_s": group_s, "reshard_s": reshard_s})
            if member.leaders is not None:  # it leads a block: its TP engine runs here
                wide = Engine(member.wide_config, parts)
                del parts
                if not lead(wide, member.leaders, ranks.rank):
                    return  # rank 0 closed the group
                wide.runner.release()  # the block's other ranks leave `serve`
                pieces = ModelPieces.of(wide)
                del wide
            else:  # a rank of the TP engine until its leader releases it
                parts.runner.serve(member.wide_config)
                parts.runner.free()
                pieces = ModelPieces(parts.model, parts.runner.backend, parts.device,
                                     parts.tokenizer, parts.stopper, parts.scheduler_config)
                del parts
            engine, reshard_s = member.widen(pieces)
            messages.gather(control, {"reshard_s": reshard_s})
        else:
            raise RuntimeError(f"unknown message {kind!r} from rank 0")


def lead(engine: Engine, leaders: parallel.TensorParallel, rank: int) -> bool:
    """A block's leader other than rank 0 (a group joined into N / k TP engines): its block's
    TP engine does what rank 0 says over the leaders' group (submit and import requests, step
    once, alongside rank 0's own TP engine) until the split, when it sends rank 0 its requests
    (their KV read whole from the block) and returns True; False when rank 0 closes the
    group."""
    while True:
        msg = messages.receive(leaders)
        kind = msg["kind"]
        if kind == "stop":
            engine.runner.close()  # the block's other ranks leave `serve` (and then exit)
            return False
        if kind == "step":
            mine = msg["work"].get(rank, {})
            for kw in mine.get("submit", ()):
                engine.submit(**kw)
            for rid in mine.get("abort", ()):
                engine.abort(rid)
            outs = engine.step()
            messages.gather(leaders, {"outputs": outs, "load": engine.load(rank)})
        elif kind == "import":
            for state in msg["states"].get(rank, ()):
                engine.import_(state)
            messages.gather(leaders, {"load": engine.load(rank),
                                      "tp_size": engine.runner.model.shape.tp.size})
        elif kind == "split":
            messages.gather(leaders, {"states": [engine.export(r, include_kv=True)
                                                 for r in msg["ids"].get(rank, ())]})
            return True
        else:
            raise RuntimeError(f"unknown message {kind!r} from rank 0")
