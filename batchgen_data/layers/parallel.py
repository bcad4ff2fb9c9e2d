"""Tensor parallelism inside the model: who this rank is, how a shape is split, the collectives.

A model built for rank r of a tensor-parallel group of `size` ranks is the same model with a
narrower shape (Megatron's split, as vLLM does it):
  * column-parallel q|k|v and gate|up: each rank holds its slice of the output rows (its query
    heads, its KV heads, its part of the intermediate width);
  * row-parallel o and down: each rank holds the matching slice of the input columns, and the
    partial outputs are summed by ONE all-reduce;
  * vocab-parallel embedding and head: each rank holds `padded_vocab / size` rows; a lookup
    outside its rows gives zeros (summed by an all-reduce), the head's logits are gathered on
    rank 0, which alone samples.
KV heads are split like query heads; when there are fewer KV heads than ranks each KV head is
replicated on `size / num_kv_heads` ranks (rank r keeps KV head `r * num_kv_heads // size`,
the one its query heads read). The layers themselves (`linear.py`, `embedding.py`) never learn
about ranks: they are built narrower, and the weight loader fills them with their slice
(`models/tp_shards.py`).

The process group is made elsewhere (`batchgen_data/worker/tp/`) and handed in as a
`TensorParallel`; every collective waits at most `timeout`, so a dead peer is an error, never a
hang. A size-1 group does nothing.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from batchgen_data.layers.embedding import VocabEmbedding
from batchgen_data.layers.linear import Linear
from batchgen_data.layers.moe import FusedMoE, cpu_fused_experts, route


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer rank is gone or stuck."""


@dataclass
class CollectiveStats:
    """What the model's collectives cost on this rank (the benchmark reads it)."""

    calls: int = 0
    bytes: int = 0  # bytes this rank contributed to the collectives
    seconds: float = 0.0  # wall time inside the collectives, waits for slower peers included

    def add(self, nbytes: int, seconds: float) -> None:
        self.calls += 1
        self.bytes += nbytes
        self.seconds += seconds


@dataclass(eq=False)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (gloo or NCCL) over the ranks
    timeout: timedelta = timedelta(seconds=120)
    # MoE layers: each rank keeps whole experts (expert parallel) instead of a slice of each
    expert_parallel: bool = False
    stats: CollectiveStats = field(default_factory=CollectiveStats)

    def _wait(self, work: Any, what: str, nbytes: int, t0: float) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise CollectiveError(f"tensor-parallel {what} on rank {self.rank} of {self.size} "
                                  f"failed (a peer rank died or stalled past "
                                  f"{self.timeout.total_seconds():.0f} s): {exc}") from exc
        self.stats.add(nbytes, time.perf_counter() - t0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place."""
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        x = x.contiguous()
        self._wait(self.group.allreduce([x]), "all-reduce", x.numel() * x.element_size(), t0)
        return x

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        """`x` from rank `root` on every rank, in place."""
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        self._wait(self.group.broadcast(x, root), "broadcast", x.numel() * x.element_size(), t0)
        return x

    def gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `local` (same shape everywhere) on rank 0, in rank order; [] elsewhere."""
        if self.size == 1:
            return [local]
        import torch.distributed as dist

        t0 = time.perf_counter()
        local = local.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        out = [[torch.empty_like(local) for _ in range(self.size)]] if self.rank == 0 else []
        self._wait(self.group.gather(out, [local], opts), "gather",
                   local.numel() * local.element_size(), t0)
        return out[0] if out else []

    def all_gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `local` (same shape everywhere) on every rank, in rank order."""
        if self.size == 1:
            return [local]
        t0 = time.perf_counter()
        local = local.contiguous()
        out = [[torch.empty_like(local) for _ in range(self.size)]]
        self._wait(self.group.allgather(out, [local]), "all-gather",
                   local.numel() * local.element_size(), t0)
        return out[0]

    def gather_vocab(self, local: torch.Tensor, vocab: int) -> torch.Tensor:
        """Logits [N, padded_vocab / size] of this rank's vocabulary rows -> on rank 0 the whole
        [N, vocab]; other ranks get their own slice back (nobody reads it)."""
        if self.size == 1:
            return local
        parts = self.gather(local)
        return torch.cat(parts, dim=-1)[..., :vocab] if parts else local


SINGLE = TensorParallel()  # one rank: every collective is a no-op
_current: ContextVar[TensorParallel | None] = ContextVar("tensor_parallel", default=None)


@contextlib.contextmanager
def sharding(tp: TensorParallel) -> Iterator[TensorParallel]:
    """Models constructed within the block are built as rank `tp.rank`'s shard."""
    token = _current.set(tp)
    try:
        yield tp
    finally:
        _current.reset(token)


def current() -> TensorParallel:
    """The group of the model being built (`sharding`), else a single rank."""
    return _current.get() or SINGLE


# ---- how shapes split ---------------------------------------------------------------------
def local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads one rank keeps: its share, or one replicated head when there are fewer."""
    return max(1, num_kv_heads // size)


def kv_heads_of_rank(num_kv_heads: int, size: int, rank: int) -> range:
    """The checkpoint's KV heads rank `rank` keeps (see the module docstring)."""
    if num_kv_heads >= size:
        n = num_kv_heads // size
        return range(rank * n, (rank + 1) * n)
    first = rank * num_kv_heads // size
    return range(first, first + 1)


def padded_vocab(vocab: int, size: int) -> int:
    """The vocabulary rounded up to a multiple of `size` (the padding rows are zeros)."""
    return -(-vocab // size) * size


def check_shape(config: Any, size: int, expert_parallel: bool = False) -> None:
    """ValueError naming `tensor_parallel_size` and the number it does not divide, from the HF
    config alone (before anything is loaded)."""
    if size == 1:
        return
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if expert_parallel and experts and experts % size:
        raise ValueError(f"tensor_parallel_size={size} with enable_expert_parallel=True does "
                         f"not divide the model's {experts} experts")
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's "
                         f"num_attention_heads={heads}")
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size}: num_key_value_heads={kv} is neither a "
                         f"multiple of it (to split) nor a divisor of it (to replicate)")
    widths = ("intermediate_size", "shared_expert_intermediate_size") + (
        () if expert_parallel and experts else ("moe_intermediate_size",))
    for name in widths:
        width = getattr(config, name, None)
        if width and width % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's "
                             f"{name}={width}")


class VocabParallelEmbedding(VocabEmbedding):
    """Rank r's rows [r * per_rank, (r + 1) * per_rank) of the padded vocabulary; a tied head
    gives this rank's slice of the logits (`TensorParallel.gather_vocab` joins them)."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel,
                 tied_head: bool = False) -> None:
        per_rank = padded_vocab(vocab, tp.size) // tp.size
        super().__init__(per_rank, hidden, tied_head)
        self.tp, self.start = tp, tp.rank * per_rank

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.vocab)
        x = super().forward(torch.where(mine, local, 0))  # [T, hidden]
        return self.tp.all_reduce(x.masked_fill_(~mine.unsqueeze(-1), 0))


class TensorParallelMoE(FusedMoE):
    """A `FusedMoE` whose experts are each split like a dense MLP (rank r keeps its slice of
    every expert's intermediate width; the router and its choices are the same on every rank):
    the routed experts' output, plus the shared expert's partial one (built narrow and not
    reduced itself), is summed over the ranks by ONE all-reduce."""

    width_split = True  # (models/tp_shards.py: slice each expert's width)

    def __init__(self, tp: TensorParallel, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class ExpertParallelMoE(FusedMoE):
    """Expert parallel (`enable_expert_parallel`): rank r keeps whole experts [r * E / size,
    (r + 1) * E / size). The hidden states entering the block are the same on every rank (the
    attention before it is tensor-parallel), and so is the router's choice; each rank runs only
    the (token, expert) pairs of its own experts, scatters their weighted outputs into a zero
    [T, H], and ONE all-reduce sums the ranks' parts (with the split shared expert's). That sum
    is the all-gather + reduce-scatter exchange of tokens, done in one collective; an all-to-all
    would move only the routed rows. `take_expert_tokens` counts every expert (the routing is
    known everywhere), so the engine's `tokens_per_expert` is the whole layer's; rank r's share
    is its slice of it."""

    width_split = False

    def __init__(self, tp: TensorParallel, hidden: int, intermediate: int, num_experts: int,
                 top_k: int, norm_topk_prob: bool, shared_expert: Any = None) -> None:
        local = num_experts // tp.size
        super().__init__(hidden, intermediate, local, min(top_k, local), norm_topk_prob,
                         shared_expert=shared_expert)
        self.tp, self.first, self.total_experts, self.route_k = tp, tp.rank * local, \
            num_experts, top_k
        self.gate = Linear(hidden, num_experts)  # the router sees every expert
        self.register_buffer("routed_tokens", torch.zeros(num_experts, dtype=torch.long),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.route_k, self.norm_topk_prob)  # [T, k]
        self.routed_tokens += torch.bincount(ids.reshape(-1), minlength=self.total_experts)
        local = ids - self.first
        token, slot = ((local >= 0) & (local < self.num_experts)).nonzero(as_tuple=True)
        out = torch.zeros_like(x)
        if token.numel():
            ids_here = local[token, slot].unsqueeze(1)  # [P, 1] this rank's pairs
            w_here = weights[token, slot].unsqueeze(1)
            counts = torch.bincount(ids_here.reshape(-1), minlength=self.num_experts)
            out.index_add_(0, token, cpu_fused_experts(x[token], self.w13, self.w2, w_here,
                                                       ids_here, self.act, counts))
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return self.tp.all_reduce(out)

    def take_expert_tokens(self) -> torch.Tensor:
        counts = self.routed_tokens.clone()
        self.routed_tokens.zero_()
        return counts
