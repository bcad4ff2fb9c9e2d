"""Start an engine's ranks on this node and join them in process groups.

Rank 0 is the process that built the engine (it keeps the scheduler, coroutines and sampler);
it opens a TCP store on 127.0.0.1 (an ephemeral port, so two engines never collide), then starts
ranks 1.. as fresh interpreters running `batchgen_data.engine.rank_worker` (a fresh interpreter,
not a fork: nothing of the user's process, its connectors or its CUDA state, comes along). The
engine config reaches them on stdin, and that pipe stays open: a worker whose stdin reaches EOF
knows rank 0 is gone and exits, so a dead rank 0 never leaves a worker behind.

Two groups join the ranks: `control` (gloo, CPU tensors) carries each step's plain data from
rank 0, and `model` (gloo on the CPU, NCCL on CUDA) the model's collectives. Rank 0 waits at most
`timeout` on every collective; a worker waits on `control` without end (rank 0 may idle between
jobs) because its stdin watchdog covers rank 0's death. Setup's handshakes (workers joined, the
KV block count every rank can hold) go through the store, polled while watching the workers'
processes, so a worker that fails while loading is reported with the tail of its log.
"""
from __future__ import annotations

import pickle
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from batchgen_data.layers.parallel import TensorParallel

_WORKER_MODULE = "batchgen_data.engine.rank_worker"
_FOREVER = timedelta(days=7)  # a worker's wait on rank 0 (its stdin watchdog bounds it)


@dataclass(eq=False)
class RankGroup:
    """This process's place among the engine's ranks."""

    tp: TensorParallel  # the model's collectives
    control: TensorParallel  # rank 0's step broadcasts (CPU tensors, gloo)
    store: Any
    timeout: timedelta
    procs: list[subprocess.Popen] = field(default_factory=list)  # rank 0: ranks 1..
    logs: list[Path] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.tp.rank

    @property
    def size(self) -> int:
        return self.tp.size

    def agree_min(self, key: str, value: int, limit_s: float | None = None) -> int:
        """The smallest `value` over the ranks (e.g. KV blocks each device can hold); rank 0
        waits at most `limit_s` (None: while the workers live)."""
        self.store.set(f"{key}/{self.rank}", str(value))
        if self.rank != 0:
            return int(self.store.get(f"{key}/final"))
        keys = [f"{key}/{r}" for r in range(1, self.size)]
        self._wait_for(keys, f"the ranks' {key}", limit_s)
        best = min([value] + [int(self.store.get(k)) for k in keys])
        self.store.set(f"{key}/final", str(best))
        return best

    def _wait_for(self, keys: list[str], what: str, limit_s: float | None = None) -> None:
        deadline = None if limit_s is None else time.monotonic() + limit_s
        while not self.store.check(keys):
            dead = self.dead()
            if dead is not None:
                raise RuntimeError(f"waiting for {what}: {dead}")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"waiting for {what}: no answer in {limit_s:.0f} s")
            time.sleep(0.02)

    def dead(self) -> str | None:
        """On rank 0: which worker has exited and the end of its log, or None."""
        for rank, (proc, log) in enumerate(zip(self.procs, self.logs), start=1):
            code = proc.poll()
            if code is not None:
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                return f"rank {rank} exited with code {code}" + (f"; its log ends:\n{tail}"
                                                                   if tail else "")
        return None

    def close(self) -> None:
        _stop(self.procs)


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None and proc.stdin is not None:
            proc.stdin.close()  # the worker's watchdog sees EOF and exits
    deadline = time.monotonic() + 5.0
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start(config: Any, size: int, device_type: str, timeout_s: float,
          expert_parallel: bool = False, role: str = "rank") -> RankGroup:
    """Rank 0: start ranks 1..size-1 with `config` and join the groups. `role`: "rank", a
    shard of one TP engine (both groups now); "engine", an engine of its own that may join a
    TP group later (engine/partition.py: the control group now, the model group at the join,
    `model_group`)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
    blob = pickle.dumps(config)
    procs, logs = [], []
    for rank in range(1, size):
        log = Path(tempfile.mkstemp(prefix=f"batchgen-rank{rank}-", suffix=".log")[1])
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", _WORKER_MODULE, str(rank), str(size), str(store.port),
                 device_type, str(timeout_s), str(int(expert_parallel)), role],
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
        assert proc.stdin is not None
        proc.stdin.write(struct.pack("<Q", len(blob)) + blob)
        proc.stdin.flush()
        procs.append(proc)
        logs.append(log)
    group = RankGroup(TensorParallel(0, size), TensorParallel(0, size), store, timeout, procs,
                      logs)
    weakref.finalize(group, _stop, procs)  # workers never outlive their engine
    try:
        group._wait_for([f"joined/{r}" for r in range(1, size)], "the ranks to start",
                        limit_s=max(timeout_s, 60.0))
        group.control = _control_group(store, 0, size, timeout)
        if role == "rank":
            group.tp = _model_group(store, "model", 0, size, device_type, timeout,
                                    expert_parallel)
    except BaseException:
        _stop(procs)
        raise
    return group


def join(rank: int, size: int, port: int, device_type: str, timeout_s: float,
         expert_parallel: bool = False, role: str = "rank") -> RankGroup:
    """Rank `rank` > 0: join rank 0's store and groups (`start`'s `role`)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=_FOREVER)
    store.set(f"joined/{rank}", "1")
    control = _control_group(store, rank, size, _FOREVER)
    model = (_model_group(store, "model", rank, size, device_type, timeout, expert_parallel)
             if role == "rank" else TensorParallel(rank, size))
    return RankGroup(model, control, store, timeout)


def model_group(ranks: RankGroup, tag: str, device_type: str) -> TensorParallel:
    """Every rank: a new model group over the ranks' store (keys under `tag`, fresh for each
    join), for ranks started with role "engine" when they join one TP engine."""
    return _model_group(ranks.store, f"model-{tag}", ranks.rank, ranks.size, device_type,
                        ranks.timeout)


def read_config(stream: Any) -> Any:
    """What `start` wrote on a worker's stdin."""
    (n,) = struct.unpack("<Q", stream.read(8))
    return pickle.loads(stream.read(n))


def _control_group(store: Any, rank: int, size: int, timeout: timedelta) -> TensorParallel:
    import torch.distributed as dist

    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size,
                                    _gloo_options(timeout))
    return TensorParallel(rank, size, control, timeout)


def _model_group(store: Any, prefix: str, rank: int, size: int, device_type: str,
                 timeout: timedelta, expert_parallel: bool = False) -> TensorParallel:
    import torch.distributed as dist

    if device_type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        model: Any = dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, opts)
    else:
        model = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size,
                                      _gloo_options(timeout))
    return TensorParallel(rank, size, model, timeout, expert_parallel)


def _gloo_options(timeout: timedelta) -> Any:
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return opts
