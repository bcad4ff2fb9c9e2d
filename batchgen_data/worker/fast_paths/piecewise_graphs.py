"""CUDA graphs for mixed steps (a runner fast path): the forward captured in pieces between its
attention calls, each attention run eagerly in between (vLLM's piecewise graphs).

A batch job admits a new row on almost every step, so most of its steps mix prefill chunks with
decodes, which `DecodeGraphs` cannot take: a captured attention would replay the one layout of
sequences it was captured with. Everything else in a layer (norms, projections, the rotation,
the MLP or the experts) works row by row and depends on the step only through its number of
tokens. So for each padded token count in `TOKEN_SIZES` the forward is cut at every `Attention`
call (`layers.attention.split_at_attention`) into `layers + 1` pieces, each captured as its own
graph; a step replays piece 0, attends eagerly with its real metadata (the paged kernels:
K/V write, decode and varlen prefill), replays piece 1, and so on. A step then launches
`layers + 1` graphs and a few kernels per layer instead of hundreds of kernels.

What a replay relies on:
  * a piece's inputs and outputs are fixed tensors: the token ids and positions in static
    buffers; each attention's q/k/v are the tensors the piece before it wrote during capture,
    and its output goes into a static tensor the piece after it reads;
  * padded rows (ids and positions 0) only ever meet row-wise work: the attention sees the step's
    `n` real rows alone, and MoE layers count only real rows (`layers.moe.counted_rows`);
  * nothing inside a piece may read a per-step host value or wait for the device: the capture
    (a CUDA graph, or the recording seam the tests pass on the CPU) fails where one does.
A model whose attention calls do not all go through `Attention` (the encoders) gets no path.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from batchgen_data.worker.devices import device_scope
from batchgen_data.layers.attention import Attention, AttentionMetadata, split_at_attention
from batchgen_data.layers.moe import counted_rows

if TYPE_CHECKING:
    from batchgen_data.worker.model_input import ModelInput

TOKEN_SIZES = (8, 16, 32, 64, 128, 256, 512)


def token_sizes(max_num_batched_tokens: int) -> list[int]:
    """Padded token counts to capture: those of `TOKEN_SIZES` up to the step's token budget
    (a bigger step is compute bound: it runs eagerly)."""
    assert max_num_batched_tokens >= 1
    sizes = [t for t in TOKEN_SIZES if t <= max_num_batched_tokens]
    return sizes or [TOKEN_SIZES[0]]


class PieceCapture(Protocol):
    """How pieces are captured: `scope()` is entered around one size's capture; `begin()` starts
    a piece, `end()` stops it and returns what replays it."""

    def scope(self) -> contextlib.AbstractContextManager[None]: ...

    def begin(self) -> None: ...

    def end(self) -> Callable[[], None]: ...


class CudaPieces:
    """Pieces as CUDA graphs sharing one memory pool (one size replays at a time), captured on a
    side stream as `torch.cuda.graph` does."""

    def __init__(self, device: torch.device, pool: object | None = None) -> None:
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self._graph: torch.cuda.CUDAGraph | None = None

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        torch.cuda.synchronize()
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.synchronize()

    def begin(self) -> None:
        assert self._graph is None
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> Callable[[], None]:
        graph, self._graph = self._graph, None
        assert graph is not None
        graph.capture_end()
        return graph.replay


@dataclass
class _Hole:
    """One attention call between two pieces: the tensors its pieces share with it."""

    layer: Attention
    q: torch.Tensor  # [T, H, D], written by the piece before
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D] (MLA: the same tensor as k)
    kv_cache: tuple[torch.Tensor, torch.Tensor]
    out: torch.Tensor  # [T, H, D], read by the piece after


@dataclass
class _Size:
    pieces: list[Callable[[], None]] = field(default_factory=list)  # replays, layers + 1
    holes: list[_Hole] = field(default_factory=list)
    out: torch.Tensor | None = None  # [T, hidden] final-normed hidden states


class MixedGraphs:
    """Piecewise-captured forwards of `model` over `kv_caches`, one per padded token count."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_num_batched_tokens: int, device: torch.device,
                 capture: PieceCapture | None = None) -> None:
        self.sizes = token_sizes(max_num_batched_tokens)
        self.num_attention = sum(isinstance(m, Attention) for m in model.modules())
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.real = torch.zeros(top, dtype=torch.long, device=device)  # 1: a step's row
        self._sizes: dict[int, _Size] = {}
        self.steps_run = 0  # steps served so far (benchmarks report it)
        with device_scope(device), torch.inference_mode():
            cap = capture if capture is not None else CudaPieces(device)
            for t in reversed(self.sizes):  # largest first: smaller sizes reuse its memory
                self._sizes[t] = self._capture(model, kv_caches, t, cap)

    @staticmethod
    def usable(model: torch.nn.Module) -> bool:
        """Whether `model` attends through `Attention` layers (the decoders; a capture checks
        that it cut as many calls as there are layers)."""
        return any(isinstance(m, Attention) for m in model.modules())

    def _capture(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 t: int, cap: PieceCapture) -> _Size:
        meta = _capture_metadata(self.input_ids.device)

        def forward() -> torch.Tensor:
            # fresh views each run: a layer that memoises on its input tensor's identity (the
            # rotary cos/sin) must not carry a lookup from the warm-up into the capture
            return model(self.input_ids[:t], self.positions[:t], kv_caches, meta)

        def blank(layer: Attention, q: torch.Tensor, *_: object) -> torch.Tensor:
            return torch.zeros_like(q)

        # warm-up, eagerly: compiles this size's kernels and sets up the matmul libraries
        self.real[:t].fill_(1)
        with split_at_attention(blank), counted_rows(self.real[:t]):
            forward()
        size = _Size()

        def cut(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], _meta: AttentionMetadata
                ) -> torch.Tensor:
            size.pieces.append(cap.end())
            out = torch.zeros_like(q)  # outside any piece: a static tensor of its own
            size.holes.append(_Hole(layer, q, k, v, kv_cache, out))
            cap.begin()
            return out

        with cap.scope(), split_at_attention(cut), counted_rows(self.real[:t]):
            cap.begin()
            size.out = forward()
            size.pieces.append(cap.end())
        if len(size.holes) != self.num_attention:
            raise RuntimeError(f"piecewise capture at {t} tokens cut {len(size.holes)} "
                               f"attention calls of {self.num_attention} layers")
        return size

    def applies(self, inp: ModelInput) -> bool:
        """A step without LoRA adapters (the graphs hold no deltas) whose tokens fit a size."""
        n = inp.input_ids.shape[0]
        return inp.lora is None and 0 < n <= self.sizes[-1]

    def run(self, inp: ModelInput) -> torch.Tensor:
        """Hidden states [n, hidden] of a step that `applies`."""
        n = inp.input_ids.shape[0]
        t = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(inp.input_ids)
        self.positions[:n].copy_(inp.positions)
        self.input_ids[n:t].zero_()
        self.positions[n:t].zero_()
        self.real[:n].fill_(1)
        self.real[n:t].zero_()
        size = self._sizes[t]
        meta = inp.meta
        self.steps_run += 1
        for replay, hole in zip(size.pieces, size.holes):
            replay()
            hole.out[:n].copy_(hole.layer.attend(hole.q[:n], hole.k[:n], hole.v[:n],
                                                 hole.kv_cache, meta))
        size.pieces[-1]()
        assert size.out is not None
        return size.out[:n]


def _capture_metadata(device: torch.device) -> AttentionMetadata:
    """The metadata a captured forward sees: no attention reads it (the cuts take every call), and
    its host lists are empty, so nothing in a piece branches on a step's layout."""
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    return AttentionMetadata(slot_mapping=empty.long(), num_decodes=0,
                             block_tables=empty.view(0, 0), seq_lens=empty,
                             cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=device),
                             seq_lens_host=[], query_lens_host=[], max_decode_len=0,
                             max_prefill_len=0)
