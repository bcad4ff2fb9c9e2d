"""A tensor-parallel engine's rank > 0: `python -m batchgen_data.engine.rank_worker RANK SIZE
PORT DEVICE_TYPE TIMEOUT_S EXPERT_PARALLEL [ROLE]`, the engine config on stdin
(`distributed/launch.py` starts it).

Role "rank" (the default): it builds the same engine parts as rank 0, for its rank (its shard of
the weights and the KV cache), then serves rank 0's broadcasts (`TPRunner.serve`). Role
"engine": a whole engine of its own, one of a group that re-partitions (engine/partition.py),
served until rank 0 says stop (`partition_worker.serve`). It never imports the connectors:
only what an engine or a model shard needs.
"""
from __future__ import annotations

import os
import sys
import threading


def _exit_when_rank0_goes(stdin: object) -> None:
    # rank 0 holds our stdin open for its whole life: EOF means it is gone
    while stdin.read(1 << 16):  # type: ignore[attr-defined]
        pass
    os._exit(3)


def main(argv: list[str]) -> int:
    import torch

    from batchgen_data.distributed import launch
    from batchgen_data.engine.setup import build_parts

    rank, size, port = (int(a) for a in argv[:3])
    device_type, timeout_s, expert_parallel = argv[3], float(argv[4]), argv[5] == "1"
    role = argv[6] if len(argv) > 6 else "rank"
    config = launch.read_config(sys.stdin.buffer)
    threading.Thread(target=_exit_when_rank0_goes, args=(sys.stdin.buffer,), daemon=True).start()
    # one process per device: share the CPU's cores between the ranks unless told
    torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // size))
    if device_type == "cuda":
        torch.cuda.set_device(rank)  # NCCL's collectives run on this rank's device
    ranks = launch.join(rank, size, port, device_type, timeout_s, expert_parallel, role)
    if role == "engine":
        from batchgen_data.engine import partition_worker

        partition_worker.serve(config, ranks, device_type)
        return 0
    parts = build_parts(config, ranks)
    parts.runner.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
