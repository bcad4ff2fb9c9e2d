"""Engine parts around a stub model: the real engine (scheduler, coroutines, `ModelRunner.prepare`,
sampler) with a forward that returns logits at once, or after sleeping a fixed device time.

An engine runs them as ``Engine(config, build_parts(config))`` with a model string
``"stub?vocab=1024&device_ms=2"`` (benchmarks/ on `sys.path`). What is left of a step is what
the host does around the model: benchmarks/host_overhead.py times it.

``device_ms`` stands for a GPU step of fixed length, whatever the batch. The stub's device is
an in-order queue, as a CUDA stream is: a forward queues its ``device_ms`` and returns at once,
the device runs queued work back to back, and the host waits for it only at the
runner's `mark` (`StubRunner`: sleeping, so the GIL is free, as a device wait leaves it). A tree
whose runner has no `mark` (an older baseline) gets a forward that sleeps instead, as that
tree's engine assumed.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import torch

from batchgen_data.worker.model_runner import ModelRunner
from batchgen_data.engine.setup import EngineParts
from batchgen_data.core.stop import StopChecker
from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.core.kv.held_kv import HeldKVStore
from batchgen_data.layers.backend import LayerBackend

PREFIX = "stub"
EOS = 0  # never the argmax of the stub's logits (column 0 is pushed down)


@dataclass(frozen=True, slots=True)
class StubShape:
    vocab: int
    max_positions: int
    num_layers: int = 1  # the runner's KV cache: one layer of one 1-wide head (no memory)
    num_kv_heads: int = 1
    head_dim: int = 1


class StubModel(torch.nn.Module):
    """The model's surface as the runner calls it: `forward` gives one hidden value per token
    and `compute_logits` a slice of fixed random logits, after `device_s` of sleep."""

    def __init__(self, vocab: int, max_positions: int, max_rows: int, device_s: float,
                 queued: bool = True) -> None:
        super().__init__()
        self.queued = queued  # False: each forward waits for its own device time
        self.shape = StubShape(vocab, max_positions)
        self.device_s = device_s
        gen = torch.Generator().manual_seed(0)
        self.logits = torch.randn(max_rows, vocab, generator=gen) * 5  # [max_rows, vocab]
        self.logits[:, EOS] = -1e4
        self.device_time_s = 0.0  # summed over forwards: the harness subtracts it from the wall
        self.free_at = 0.0  # when the device is done with everything queued so far

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
                meta: Any) -> torch.Tensor:
        """Queue `device_s` of work on the stub's device and return at once, as a launch on a
        GPU stream does: the device starts it when it is done with what was queued before."""
        if self.device_s > 0:
            self.free_at = max(time.perf_counter(), self.free_at) + self.device_s
            self.device_time_s += self.device_s
            if not self.queued:
                _Deadline(self.free_at).wait()
        return torch.zeros(input_ids.shape[0], 1)  # [T, 1]

    def device_mark(self) -> "_Deadline":
        """A mark after everything queued so far: waits until the device has done it (a
        baseline tree's `ModelRunner.mark` asks the model for it)."""
        return _Deadline(self.free_at)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[:hidden.shape[0]]  # [S, vocab]


def _exact_sleeps() -> None:
    """Linux lets a sleeping thread wake up to 50 us late (its timer slack), which would make
    the wait for a 2 ms device step 2.08 ms; 1 ns of slack brings it to about 2.03 ms on this
    box. Per thread, so set by the thread that waits."""
    global _prctl
    if _prctl is None:
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):  # not Linux: its timer, as it is
            _prctl = False
    if _prctl:
        _prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)


@dataclass(frozen=True)
class _Deadline:
    at: float  # perf_counter seconds

    def wait(self) -> None:
        left = self.at - time.perf_counter()
        if left > 0:
            _exact_sleeps()
            time.sleep(left)


PR_SET_TIMERSLACK = 29
_prctl: Any = None


class StubTokenizer:
    """Enough for `StopChecker.final_text`: one letter per token."""

    eos_token_id = EOS

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + t % 26) for t in ids)


def parse(model: str) -> dict[str, float]:
    parts = urlsplit(model)
    if parts.path != PREFIX:
        raise ValueError(f"model={model!r}: a stub model string starts with {PREFIX!r}")
    query = {k: float(v[-1]) for k, v in parse_qs(parts.query).items()}
    unknown = sorted(set(query) - {"vocab", "device_ms"})
    if unknown:
        raise ValueError(f"model={model!r}: unknown option(s) {unknown}; valid: vocab, device_ms")
    return {"vocab": query.get("vocab", 1024), "device_ms": query.get("device_ms", 0.0)}


class StubRunner(ModelRunner):
    """The real `ModelRunner` over a `StubModel`, whose device is the stub's queue: a mark
    waits for it."""

    def mark(self) -> "_Deadline":  # type: ignore[override]
        return self.model.device_mark()


def build_parts(config: Any) -> EngineParts:
    """`EngineParts` around a real `ModelRunner` (no fast paths) over a `StubModel`."""
    opts = parse(config.model or "")
    cc, sc = config.cache, config.scheduler
    max_len = config.max_model_len or 4096
    device = torch.device("cpu")
    model = StubModel(int(opts["vocab"]), max_len, sc.max_num_seqs, opts["device_ms"] / 1e3,
                      queued=hasattr(ModelRunner, "mark"))
    num_blocks = cc.num_kv_blocks or sc.max_num_seqs * -(-max_len // cc.block_size) + 1
    # the GPU's backend family: no torch decode-attention gather index to build per step
    backend = LayerBackend(device, torch.float32, triton=True)
    # a baseline tree without the runner Protocol overlaps steps of its own ModelRunner only,
    # whose `mark` asks the model
    own = hasattr(ModelRunner, "can_overlap")
    runner = (StubRunner if own else ModelRunner)(model, num_blocks, cc.block_size, backend)
    tokenizer = StubTokenizer()
    return EngineParts(model, tokenizer, device, max_len,
                       BlockPool(num_blocks, cc.block_size, cc.enable_prefix_caching),
                       HeldKVStore(cc.held_kv_bytes, ModelRunner.kv_bytes_per_token(
                           model, torch.float32)),
                       runner, StopChecker(tokenizer, {EOS}), sc)
