"""The LoRA deltas of one linear layer in one C call (fp32 CPU, AVX2 + FMA): `csrc/lora.c`.

`LoRASlots(a, bt, ...).add_(x, y, ...)` (or `lora_add_` for one call) adds
y[t] += (x[t] A^T) B^T for the rows of each adapter segment, reading the rows in place and each
slot's A once per block of a segment's rows. The layouts are those of
`batchgen_data.layers.lora.LoRADelta`: a [slots, nshards * R, K] (a fused layer's shards
stacked, one shrink for all), bt [slots, R, N] (B transposed, its rows padded; the columns of
shard i are multiplied by h's columns [i R, i R + R)). The slots are checked once, when a layer
builds its `LoRASlots`; each call checks only the step's rows (a decode step makes 120 calls on
SmolLM2-135M). A first-use self-check compares the kernel with the float64 reference; without
it (no compiler, no AVX2) `available()` is False and the layers keep their torch path.
"""
from __future__ import annotations

import functools
import logging

import torch

from batchgen_data.kernels.cpu import build as cpu_kernels

log = logging.getLogger(__name__)


def available() -> bool:
    """Whether `lora_add_` runs here: built with AVX2 + FMA and agreeing with `reference_add_`
    on a self-check (odd sizes, ranks and segments)."""
    return _checked()


class LoRASlots:
    """One layer's adapter slots for `csrc/lora.c`, checked once: a [L, nshards * rank, K]
    contiguous; bt [L, rank, N] with rows of any one stride >= N (a padded one avoids L1 set
    conflicts); `shard_ends` [nshards] (the last is N). `add_` then checks only a step's rows."""

    def __init__(self, a: torch.Tensor, bt: torch.Tensor, rank: int,
                 shard_ends: list[int]) -> None:
        for name, t in (("a", a), ("bt", bt)):
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise ValueError(f"lora_add_: {name} must be a float32 CPU tensor, got "
                                 f"{t.dtype} on {t.device}")
        n_sh, n_out = len(shard_ends), shard_ends[-1]
        if a.dim() != 3 or not a.is_contiguous() or a.shape[1] != n_sh * rank:
            raise ValueError(f"lora_add_: a {tuple(a.shape)} is not contiguous [slots, "
                             f"{n_sh} x {rank}, in]")
        if bt.dim() != 3 or bt.shape[1:] != (rank, n_out) or bt.shape[0] != a.shape[0]:
            raise ValueError(f"lora_add_: bt {tuple(bt.shape)} is not [{a.shape[0]}, {rank}, "
                             f"{n_out}]")
        if bt.stride(2) != 1 or bt.stride(1) < n_out or bt.stride(0) != rank * bt.stride(1):
            raise ValueError(f"lora_add_: bt's strides {bt.stride()}: want rows of one stride "
                             f">= {n_out} floats, slots {rank} rows apart")
        self.a, self.bt = a, bt  # the addresses below point into them
        self.in_features, self.out_features = a.shape[2], n_out
        self._ends = torch.tensor(shard_ends, dtype=torch.long)
        self._weights = (a.data_ptr(), bt.data_ptr(), bt.stride(1), rank, n_sh,
                         self._ends.data_ptr())
        lib = cpu_kernels.library()
        assert lib is not None
        self._lib = lib

    def add_(self, x: torch.Tensor, y: torch.Tensor, token_idx: torch.Tensor,
             seg_starts: torch.Tensor, seg_slots: torch.Tensor,
             num_threads: int | None = None) -> torch.Tensor:
        """In place: y[t] += (x[t] a[slot]^T) per shard bt[slot] for each row t of each
        segment; returns y. x [T, K], y [T, N] float32 CPU, rows contiguous; token_idx [rows]
        (each row once), seg_starts [S + 1], seg_slots [S]: int64 CPU, as in `LoRABatch`."""
        if x.dtype != torch.float32 or y.dtype != torch.float32 or not (x.is_cpu and y.is_cpu):
            raise ValueError(f"lora_add_: x and y must be float32 CPU tensors, got {x.dtype} "
                             f"on {x.device}, {y.dtype} on {y.device}")
        if x.dim() != 2 or y.dim() != 2 or x.stride(1) != 1 or y.stride(1) != 1 \
                or x.shape[1] != self.in_features or y.shape[1] != self.out_features \
                or x.shape[0] != y.shape[0]:
            raise ValueError(f"lora_add_: x {tuple(x.shape)} and y {tuple(y.shape)} must be "
                             f"[T, {self.in_features}] and [T, {self.out_features}] with "
                             "contiguous rows")
        for name, t in (("token_idx", token_idx), ("seg_starts", seg_starts),
                        ("seg_slots", seg_slots)):
            if t.dtype != torch.int64 or not t.is_cpu or not t.is_contiguous():
                raise ValueError(f"lora_add_: {name} must be a contiguous int64 CPU tensor")
        rc = self._lib.bg_lora_f32(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0),
                                   x.shape[1], *self._weights, token_idx.data_ptr(),
                                   seg_starts.data_ptr(), seg_slots.data_ptr(),
                                   seg_slots.shape[0],
                                   torch.get_num_threads() if num_threads is None
                                   else num_threads)
        if rc != 0:
            raise RuntimeError(f"bg_lora_f32 failed (code {rc})")
        return y


def lora_add_(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, rank: int,
              shard_ends: torch.Tensor, token_idx: torch.Tensor, seg_starts: torch.Tensor,
              seg_slots: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """`LoRASlots(a, bt, rank, shard_ends).add_(x, y, ...)`, for one call."""
    return LoRASlots(a, bt, rank, shard_ends.tolist()).add_(x, y, token_idx, seg_starts,
                                                            seg_slots, num_threads)


def reference_add_(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                   rank: int, shard_ends: torch.Tensor, token_idx: torch.Tensor,
                   seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> torch.Tensor:
    """What `lora_add_` computes, unfused, one segment and one shard at a time (float64)."""
    starts, ends = seg_starts.tolist(), [0] + shard_ends.tolist()
    for s, slot in enumerate(seg_slots.tolist()):
        rows = token_idx[starts[s]:starts[s + 1]]
        xs = x[rows].double()
        for i in range(len(ends) - 1):
            h = xs @ a[slot, i * rank:(i + 1) * rank].double().T
            delta = h @ bt[slot, :, ends[i]:ends[i + 1]].double()
            y[rows, ends[i]:ends[i + 1]] = (y[rows, ends[i]:ends[i + 1]].double() + delta).float()
    return y


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def _checked() -> bool:
    lib = cpu_kernels.library()
    if lib is None or not lib.bg_lora_supported():
        return False
    gen = torch.Generator().manual_seed(0)
    # (tokens, K, rank, shard sizes, segments as (slot, rows)): a fused q|k|v of odd sizes with
    # segments over one block of rows, and a single-shard layer with rows left out
    for t, k, r, sizes, segs in ((75, 37, 5, [19, 7, 7], [(2, 40), (0, 1), (1, 20)]),
                                 (9, 64, 16, [48], [(1, 4), (0, 3)])):
        x = torch.randn(t, k, generator=gen)
        a = torch.randn(3, len(sizes) * r, k, generator=gen)
        n = sum(sizes)
        bt = torch.randn(3, r, n, generator=gen)
        ends = torch.tensor(sizes).cumsum(0)
        tok = torch.randperm(t, generator=gen)[:sum(c for _, c in segs)]
        starts = torch.tensor([0] + [c for _, c in segs]).cumsum(0)
        slots = torch.tensor([s for s, _ in segs])
        y = torch.randn(t, n, generator=gen)
        want = reference_add_(x, y.clone(), a, bt, r, ends, tok, starts, slots)
        for threads in (1, 2):
            got = lora_add_(x, y.clone(), a, bt, r, ends, tok, starts, slots, threads)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                log.warning("the CPU LoRA kernel disagrees with the reference; using the torch "
                            "path")
                return False
    return True
