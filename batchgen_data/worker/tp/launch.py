"""Start an engine's ranks and join them in process groups.

Rank 0 is the process that built the engine (it keeps the scheduler, coroutines and sampler);
it opens a TCP store (an ephemeral port, so two engines never collide), then starts ranks 1..
through a launcher (`distributed_executor_backend`, vLLM's name):
  * "mp" (the default): fresh interpreters on this node running `batchgen_data.engine.rank_worker`
    (a fresh interpreter, not a fork: nothing of the user's process, its connectors or its CUDA
    state, comes along), the store on 127.0.0.1. The engine config reaches them on stdin, and
    that pipe stays open: a worker whose stdin reaches EOF knows rank 0 is gone and exits, so a
    dead rank 0 never leaves a worker behind.
  * "ray": Ray actors in the bundles of the placement group rank 0 runs in, on whichever nodes
    Ray placed them (`connectors/ray/ranks.py`, imported by name: only connectors import Ray);
    the store and gloo on each node's own address.

Two groups join the ranks: `control` (gloo, CPU tensors) carries each step's plain data from
rank 0, and `model` (gloo on the CPU, NCCL on CUDA) the model's collectives. Rank 0 waits at most
`timeout` on every collective; a worker waits on `control` without end (rank 0 may idle between
jobs) because its stdin watchdog covers rank 0's death. Setup's handshakes (workers joined, the
KV block count every rank can hold) go through the store, polled while watching the workers'
processes, so a worker that fails while loading is reported with the tail of its log.
"""
from __future__ import annotations

import dataclasses
import importlib
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
from typing import Any, Protocol

from batchgen_data.layers.parallel import TensorParallel

_WORKER_MODULE = "batchgen_data.engine.rank_worker"
_FOREVER = timedelta(days=7)  # a worker's wait on rank 0 (its stdin watchdog bounds it)


BACKENDS = ("mp", "ray", "uni")  # distributed_executor_backend ("uni": one device, no ranks)
_RAY_LAUNCHER = "batchgen_data.connectors.ray.ranks"


@dataclass(frozen=True)
class RankArgs:
    """What a rank > 0 needs to join rank 0 (`rank_worker`)."""

    rank: int
    size: int
    host: str  # rank 0's address: its store
    port: int
    device_type: str
    timeout_s: float
    expert_parallel: bool = False
    role: str = "rank"  # "rank": a shard of one TP engine; "engine": see `start`
    device_index: int | None = None  # the rank's CUDA device (None: tp_runner.rank_device's)

    def argv(self) -> list[str]:
        return [str(self.rank), str(self.size), self.host, str(self.port), self.device_type,
                str(self.timeout_s), str(int(self.expert_parallel)), self.role]

    @classmethod
    def from_argv(cls, argv: list[str]) -> "RankArgs":
        return cls(int(argv[0]), int(argv[1]), argv[2], int(argv[3]), argv[4], float(argv[5]),
                   argv[6] == "1", argv[7])


class RankHandle(Protocol):
    """Rank 0's hold on one started rank."""

    def exit_status(self) -> str | None:
        """None while the rank runs; else why it ended ("exited with code -9; its log ends...")."""

    def stop(self, deadline: float) -> None:
        """End the rank, waiting until `deadline` (time.monotonic()) before forcing it."""


class RankLauncher(Protocol):
    """Starts ranks 1.. of an engine: `host` is the address of rank 0 they reach."""

    host: str

    def launch(self, args: RankArgs, blob: bytes) -> RankHandle: ...


class _LocalRank:
    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc, self.log = proc, log

    def exit_status(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
        return f"exited with code {code}" + (f"; its log ends:\n{tail}" if tail else "")

    def stop(self, deadline: float) -> None:
        proc = self.proc
        if proc.poll() is None and proc.stdin is not None:
            proc.stdin.close()  # the worker's watchdog sees EOF and exits
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class LocalRanks:
    """Ranks as fresh interpreters on this node (backend "mp")."""

    host = "127.0.0.1"

    def launch(self, args: RankArgs, blob: bytes) -> _LocalRank:
        log = Path(tempfile.mkstemp(prefix=f"batchgen-rank{args.rank}-", suffix=".log")[1])
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", _WORKER_MODULE, *args.argv()],
                                    stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
        assert proc.stdin is not None
        proc.stdin.write(struct.pack("<Q", len(blob)) + blob)
        proc.stdin.flush()
        return _LocalRank(proc, log)


def launcher_for(backend: str | None, size: int) -> RankLauncher:
    """The launcher of `distributed_executor_backend` (None: "mp")."""
    if backend in (None, "mp", "uni"):
        return LocalRanks()
    if backend == "ray":  # a connector's: imported by name (the worker never imports connectors)
        return importlib.import_module(_RAY_LAUNCHER).RayRanks(size)
    raise ValueError(f"distributed_executor_backend={backend!r}: use one of {BACKENDS}")


@dataclass(eq=False)
class RankGroup:
    """This process's place among the engine's ranks."""

    tp: TensorParallel  # the model's collectives
    control: TensorParallel  # rank 0's step broadcasts (CPU tensors, gloo)
    store: Any
    timeout: timedelta
    handles: list[RankHandle] = field(default_factory=list)  # rank 0: ranks 1..
    device_index: int | None = None  # this rank's CUDA device (None: tp_runner.rank_device's)

    @property
    def procs(self) -> list[subprocess.Popen]:
        """The local processes of ranks 1.. (backend "mp")."""
        return [h.proc for h in self.handles if isinstance(h, _LocalRank)]

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
        """On rank 0: which worker has ended and why (the end of its log), or None."""
        for rank, handle in enumerate(self.handles, start=1):
            why = handle.exit_status()
            if why is not None:
                return f"rank {rank} {why}"
        return None

    def close(self) -> None:
        _stop(self.handles)


def _stop(handles: list[RankHandle]) -> None:
    deadline = time.monotonic() + 5.0
    for handle in handles:
        handle.stop(deadline)


def start(config: Any, size: int, device_type: str, timeout_s: float,
          expert_parallel: bool = False, role: str = "rank") -> RankGroup:
    """Rank 0: start ranks 1..size-1 with `config` (through its
    `distributed_executor_backend`) and join the groups. `role`: "rank", a shard of one TP
    engine (both groups now); "engine", an engine of its own that may join a TP group later
    (engine/group/group.py: the control group now, the model group at the join, `model_group`)."""
    import torch.distributed as dist

    launcher = launcher_for(getattr(config, "distributed_executor_backend", None), size)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(launcher.host, 0, size, True, timeout=timeout, wait_for_workers=False)
    blob = pickle.dumps(config)
    args = RankArgs(0, size, launcher.host, store.port, device_type, timeout_s, expert_parallel,
                    role)
    handles: list[RankHandle] = []
    group = RankGroup(TensorParallel(0, size), TensorParallel(0, size), store, timeout, handles)
    weakref.finalize(group, _stop, handles)  # workers never outlive their engine
    try:
        for rank in range(1, size):
            handles.append(launcher.launch(dataclasses.replace(args, rank=rank), blob))
        group._wait_for([f"joined/{r}" for r in range(1, size)], "the ranks to start",
                        limit_s=max(timeout_s, 60.0))
        group.control = _control_group(store, 0, size, timeout, launcher.host)
        if role == "rank":
            group.tp = _model_group(store, "model", 0, size, device_type, timeout,
                                    expert_parallel, launcher.host)
    except BaseException:
        _stop(handles)
        raise
    return group


def join(args: RankArgs, own_host: str = "127.0.0.1") -> RankGroup:
    """Rank `args.rank` > 0: join rank 0's store and groups (`start`'s `role`); `own_host`: this
    rank's address, which the others reach (gloo)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=args.timeout_s)
    rank, size = args.rank, args.size
    store = dist.TCPStore(args.host, args.port, size, False, timeout=_FOREVER)
    store.set(f"joined/{rank}", "1")
    control = _control_group(store, rank, size, _FOREVER, own_host)
    model = (_model_group(store, "model", rank, size, args.device_type, timeout,
                          args.expert_parallel, own_host)
             if args.role == "rank" else TensorParallel(rank, size))
    return RankGroup(model, control, store, timeout, device_index=args.device_index)


def model_group(ranks: RankGroup, tag: str, device_type: str,
                expert_parallel: bool = False) -> TensorParallel:
    """Every rank: a new model group over the ranks' store (keys under `tag`, fresh for each
    join), for ranks started with role "engine" when they join one TP engine (on this node:
    engine groups start their ranks with the "mp" backend only)."""
    return _model_group(ranks.store, f"model-{tag}", ranks.rank, ranks.size, device_type,
                        ranks.timeout, expert_parallel)


@dataclass(eq=False)
class Blocks:
    """One process's place when an engine group joins its N ranks into N / k TP engines, each
    k wide (engine/group/group.py): block b is ranks [b*k, (b+1)*k), led by its first rank."""

    ranks: RankGroup  # this block's view: model and control groups, block-local rank and size
    leaders: TensorParallel | None  # ranks 0, k, 2k, ... (a leader's only; None when N == k)
    block: int
    width: int


def block_groups(ranks: RankGroup, tag: str, width: int, device_type: str,
                 expert_parallel: bool = False) -> Blocks:
    """Every rank of a group started with role "engine": the groups of its block of `width`
    consecutive ranks (keys under `tag` and the block: fresh for each join), and, for a
    block's first rank, the group of the leaders. Rank 0 waits at most the group's timeout on
    each; a worker waits on its control groups without end, as on the group's own (its stdin
    watchdog covers rank 0's death), and a leader's waits on its block's ranks are bounded.
    Rank 0's view keeps the process handles (its `dead()` and `close()` see every rank); a
    leader's has none: only rank 0 can tell a process's exit."""
    rank, size = ranks.rank, ranks.size
    block, local = divmod(rank, width)
    model = _model_group(ranks.store, f"model-{tag}-b{block}", local, width, device_type,
                         ranks.timeout, expert_parallel)
    control = _control_group(ranks.store, local, width,
                             ranks.timeout if local == 0 else _FOREVER,
                             prefix=f"control-{tag}-b{block}")
    view = RankGroup(model, control, ranks.store, ranks.timeout,
                     ranks.handles if rank == 0 else [], ranks.device_index)
    leaders = None
    if local == 0 and size > width:
        leaders = _control_group(ranks.store, block, size // width,
                                 ranks.timeout if rank == 0 else _FOREVER,
                                 prefix=f"leaders-{tag}")
    return Blocks(view, leaders, block, width)


def read_config(stream: Any) -> Any:
    """What `start` wrote on a worker's stdin."""
    (n,) = struct.unpack("<Q", stream.read(8))
    return pickle.loads(stream.read(n))


def _control_group(store: Any, rank: int, size: int, timeout: timedelta,
                   host: str = "127.0.0.1", prefix: str = "control") -> TensorParallel:
    import torch.distributed as dist

    control = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size,
                                    _gloo_options(timeout, host))
    return TensorParallel(rank, size, control, timeout)


def _model_group(store: Any, prefix: str, rank: int, size: int, device_type: str,
                 timeout: timedelta, expert_parallel: bool = False,
                 host: str = "127.0.0.1") -> TensorParallel:
    import torch.distributed as dist

    if device_type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        model: Any = dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, opts)
    else:
        model = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size,
                                      _gloo_options(timeout, host))
    return TensorParallel(rank, size, model, timeout, expert_parallel)


def _gloo_options(timeout: timedelta, host: str) -> Any:
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # gloo listens on this address and tells the other ranks (through the store) to dial it
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return opts
