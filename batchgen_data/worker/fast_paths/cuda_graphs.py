"""CUDA graphs for pure-decode steps (a runner fast path): one captured forward per padded batch
size.

A decode step of a small model is launch bound: hundreds of tiny kernels whose Python and
driver overhead outlasts their GPU time. So the forward is captured once per batch size in
`BATCH_SIZES` (up to `max_num_seqs`) and replayed whenever a step is all decodes and fits.

A graph replays the exact kernels, pointers and launch parameters it captured, so every input
lives in a static buffer that each step overwrites, and nothing in the captured forward may
depend on a per-step host value:
  * the block table has a fixed width, `ceil(max_model_len / block_size)` columns, so the
    decode launcher (which picks its split-K factor from shapes) sees the same shape each step;
  * padded rows get `seq_len = 0` (the kernel writes zeros for them) and `slot = -1` (the KV
    write skips them), so padding never reads or writes real KV;
  * the host-side lists of `AttentionMetadata` (used by the torch path only) are left empty;
  * an MoE layer routes the padded rows too, but counts only the real ones towards
    `tokens_per_expert` (`layers.moe.counted_rows`, a static 0/1 buffer the graph reads).
This needs the Triton path: the torch reference path builds per-step index tensors on the host.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchgen_data.worker.devices import device_scope
from batchgen_data.layers.attention import AttentionMetadata
from batchgen_data.layers.moe import counted_rows

if TYPE_CHECKING:
    from batchgen_data.worker.model_input import ModelInput

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

Forward = Callable[[], torch.Tensor]
# capture(forward, pool) -> (replay, static output): replay() refreshes the output in place
Capture = Callable[[Forward, object], tuple[Callable[[], None], torch.Tensor]]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: those of `BATCH_SIZES` below `max_num_seqs`, then
    `max_num_seqs` itself (capped at the largest size; bigger decode batches run eagerly)."""
    assert max_num_seqs >= 1
    top = min(max_num_seqs, BATCH_SIZES[-1])
    return [b for b in BATCH_SIZES if b < top] + [top]


def padded_size(n: int, sizes: list[int]) -> int | None:
    """Smallest captured size that holds `n` decodes, or None when none does."""
    return next((b for b in sizes if b >= n), None)


@dataclass
class GraphBuffers:
    """Static inputs shared by every captured size (a size-b graph reads the first b rows)."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64, -1 = padding
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, 0 = padding
    cu_seqlens_q: torch.Tensor  # [1] int32: no prefill rows
    real: torch.Tensor  # [B] int64: 1 for a step's rows, 0 for padding (MoE token counts)

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device) -> "GraphBuffers":
        def z(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(z(max_batch), z(max_batch), z(max_batch).fill_(-1),
                   z(max_batch, max_blocks, dtype=torch.int32), z(max_batch, dtype=torch.int32),
                   z(1, dtype=torch.int32), z(max_batch))

    def metadata(self, batch: int) -> AttentionMetadata:
        """Metadata of a size-`batch` graph: views of the buffers, no per-step host values."""
        width = self.block_tables.shape[1]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], num_decodes=batch,
            block_tables=self.block_tables[:batch], seq_lens=self.seq_lens[:batch],
            cu_seqlens_q=self.cu_seqlens_q, seq_lens_host=[], query_lens_host=[],
            max_decode_len=width, max_prefill_len=0)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             batch: int) -> None:
        """Copy one step's `n` decodes into rows [0, n) and mark rows [n, batch) as padding."""
        n, width = input_ids.shape[0], meta.block_tables.shape[1]
        assert meta.num_decodes == n <= batch and width <= self.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # Columns past `width` keep stale ids: the kernel reads a block id only for positions
        # below seq_len, which all lie in the first `width` columns written here.
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.input_ids[n:batch].zero_()
        self.positions[n:batch].zero_()
        self.slot_mapping[n:batch].fill_(-1)
        self.seq_lens[n:batch].zero_()
        self.real[:n].fill_(1)
        self.real[n:batch].zero_()


def cuda_capture(forward: Forward, pool: object) -> tuple[Callable[[], None], torch.Tensor]:
    """Run `forward` once eagerly (compiles this size's Triton kernels, sets up cuBLAS),
    then capture it into a CUDA graph that allocates from `pool`."""
    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph.replay, out


def eager_capture(forward: Forward, pool: object) -> tuple[Callable[[], None], torch.Tensor]:
    """Stand-in for `cuda_capture` on the CPU: replay re-runs the forward on the static
    buffers and copies into a static output, which exercises everything but the graph."""
    out = forward()
    return (lambda: out.copy_(forward())), out


class DecodeGraphs:
    """Captured pure-decode forwards of `model` over `kv_caches`, one per padded batch size."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device,
                 capture: Capture = cuda_capture) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        self.buffers = GraphBuffers.allocate(self.sizes[-1], self.max_blocks, device)
        self._replay: dict[int, Callable[[], None]] = {}
        self._out: dict[int, torch.Tensor] = {}  # [b, hidden] static outputs
        buf = self.buffers
        # capture, its pool and its synchronize all act on the current device: make it ours
        with device_scope(device), torch.inference_mode():
            pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
            self.pool = pool  # MixedGraphs captures into it too
            for b in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
                meta = buf.metadata(b)

                def forward(b: int = b, meta: AttentionMetadata = meta) -> torch.Tensor:
                    return model(buf.input_ids[:b], buf.positions[:b], kv_caches, meta)

                with counted_rows(buf.real[:b]):
                    self._replay[b], self._out[b] = capture(forward, pool)

    def applies(self, inp: ModelInput) -> bool:
        """A pure-decode step that one of the captured sizes holds, without LoRA adapters (the
        graphs hold no deltas)."""
        n, meta = inp.input_ids.shape[0], inp.meta
        return (inp.lora is None and meta.num_decodes == n
                and meta.block_tables.shape[1] <= self.max_blocks
                and padded_size(n, self.sizes) is not None)

    def run(self, inp: ModelInput) -> torch.Tensor:
        """Hidden states [n, hidden] of a pure-decode step that `applies`."""
        n = inp.input_ids.shape[0]
        b = padded_size(n, self.sizes)
        assert b is not None
        self.buffers.load(inp.input_ids, inp.positions, inp.meta, b)
        with counted_rows(self.buffers.real[:b]):  # an eager replay runs the Python forward
            self._replay[b]()
        return self._out[b][:n]
