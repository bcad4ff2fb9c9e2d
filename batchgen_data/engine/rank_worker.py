"""A tensor-parallel engine's rank > 0: `python -m batchgen_data.engine.rank_worker RANK SIZE
HOST PORT DEVICE_TYPE TIMEOUT_S EXPERT_PARALLEL ROLE`, the engine config on stdin
(`worker/tp/launch.py` starts it), or `serve` called in a Ray actor
(`connectors/ray/ranks.py`).

Role "rank" (the default): it builds the same engine parts as rank 0, for its rank (its shard of
the weights and the KV cache), then serves rank 0's broadcasts (`TPRunner.serve`). Role
"engine": a whole engine of its own, one of a group that re-partitions (engine/group/group.py),
served until rank 0 says stop (`group/member.serve`). It never imports the connectors:
only what an engine or a model shard needs.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen_data.worker.tp.launch import RankArgs


def _exit_when_rank0_goes(stdin: object) -> None:
    # rank 0 holds our stdin open for its whole life: EOF means it is gone
    while stdin.read(1 << 16):  # type: ignore[attr-defined]
        pass
    os._exit(3)


def main(argv: list[str]) -> int:
    from batchgen_data.worker.tp import launch

    config = launch.read_config(sys.stdin.buffer)
    threading.Thread(target=_exit_when_rank0_goes, args=(sys.stdin.buffer,), daemon=True).start()
    return serve(config, launch.RankArgs.from_argv(argv))


def serve(config: object, args: "RankArgs", own_host: str = "127.0.0.1",
          num_threads: int | None = None) -> int:
    """Join rank 0 and serve it until it says stop (or the process ends). `own_host`: the
    address the other ranks reach this one at; `num_threads`: the CPU threads this rank may use
    (None: the cores shared between the ranks of this node)."""
    import torch

    from batchgen_data.worker.tp import launch
    from batchgen_data.engine.setup import build_parts

    threads = config.num_threads or num_threads  # type: ignore[attr-defined]
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // args.size))
    if args.device_type == "cuda":  # NCCL's collectives run on this rank's device
        from batchgen_data.worker.tp.runner import device_of_rank

        torch.cuda.set_device(device_of_rank(config, args.rank, args.device_index))
    ranks = launch.join(args, own_host)
    if args.role == "engine":
        from batchgen_data.engine.group import member as partition_worker

        partition_worker.serve(config, ranks, args.device_type)
        return 0
    parts = build_parts(config, ranks)
    parts.runner.serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
