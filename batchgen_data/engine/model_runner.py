"""Model runner: turns a SchedulerOutput into one forward pass over the paged KV cache.

Holds the model weights and the per-layer KV caches, flattens the scheduled sequences into one
batch (decodes first, then prefill/extend chunks), and returns hidden states at the positions
whose next token must be sampled: through the first whole-model fast path that serves the step
(`fast_paths/`: CUDA graphs, the C decode stack), else through the model's own forward. It also
moves KV between the cache and host memory for hold/resume and export/import.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen_data.devices import device_scope
from batchgen_data.engine import prompt_logprobs
from batchgen_data.engine.fast_paths import FastPath, build_fast_paths
from batchgen_data.engine.fast_paths.cpu_decode_stack import CpuDecodeStack
from batchgen_data.engine.fast_paths.cuda_graphs import DecodeGraphs
from batchgen_data.engine.scheduler import SchedulerOutput
from batchgen_data.engine.sequence import Sequence
from batchgen_data.kvcache.host_tier import HostKV
from batchgen_data.layers.attention import AttentionMetadata
from batchgen_data.layers.backend import LayerBackend
from batchgen_data.offload.store import WeightStore


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_index: torch.Tensor  # [S] rows of the hidden states to sample from
    sample_seqs: list[Sequence]
    order: list[int]  # scheduled index of each flattened sequence
    # prompt_logprobs: rows whose logits are wanted (None: no sequence asks), and the result
    prompt_rows: prompt_logprobs.PromptRows | None = None
    prompt_logprobs: list[tuple[Sequence, prompt_logprobs.Entries]] | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 backend: LayerBackend, weight_store: WeightStore | None = None) -> None:
        self.model = model
        self.weight_store = weight_store  # streams offloaded layers in (cpu_offload_gb > 0)
        self.backend = backend  # the one the model's layers were built for
        self.device = device = backend.device
        self.dtype = dtype = backend.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        s = model.shape
        # [layers, 2, num_blocks, block_size, Hkv, D]
        self.kv = torch.zeros(s.num_layers, 2, num_blocks, block_size, s.num_kv_heads, s.head_dim,
                              dtype=dtype, device=device)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(s.num_layers)]
        self.fast_paths: list[FastPath] = []

    def build_fast_paths(self, max_num_seqs: int, max_model_len: int,
                         cuda_graphs: bool = True) -> None:
        """Set up the fast paths this model and cache allow (captures CUDA graphs on a GPU)."""
        self.fast_paths = build_fast_paths(self.model, self.kv_caches, self.backend, max_num_seqs,
                                           max_model_len, self.block_size, cuda_graphs)
        self.take_expert_tokens()  # graph captures ran the MoE layers: not a step's tokens

    def fast_path(self, kind: type) -> FastPath | None:
        """The fast path of this class in use, or None (for tests and benchmarks)."""
        return next((p for p in self.fast_paths if isinstance(p, kind)), None)

    @property
    def cpu_stack(self) -> CpuDecodeStack | None:
        return self.fast_path(CpuDecodeStack)  # type: ignore[return-value]

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.fast_path(DecodeGraphs)  # type: ignore[return-value]

    def offload_counters(self) -> tuple[int, int]:
        """(bytes of weights streamed to the device so far, peak weight bytes resident)."""
        store = self.weight_store
        return (0, 0) if store is None else (store.bytes_moved, store.peak_resident_bytes)

    @staticmethod
    def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
        s = model.shape
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * torch.finfo(dtype).bits // 8

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        bs = self.block_size
        order = sorted(range(len(out.seqs)), key=lambda i: out.num_new_tokens[i] != 1)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        q_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        num_decodes = 0
        prompt_rows = None
        for i in order:
            seq, n = out.seqs[i], out.num_new_tokens[i]
            start = seq.num_computed_tokens
            end = start + n
            if seq.prompt_logprobs is not None and prompt_logprobs.collecting(seq):
                prompt_rows = prompt_rows or prompt_logprobs.PromptRows()
                prompt_rows.add(seq, len(ids), start, end)
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            blocks = seq.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            q_lens.append(n)
            tables.append(blocks)
            num_decodes += n == 1
            if end == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        prefill_q = q_lens[num_decodes:]
        cu = torch.tensor([0] + list(_cumsum(prefill_q)), dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
            num_decodes=num_decodes,
            block_tables=table.to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            cu_seqlens_q=cu.to(dev, non_blocking=True),
            seq_lens_host=seq_lens,
            query_lens_host=q_lens,
            max_decode_len=max(seq_lens[:num_decodes], default=0),
            max_prefill_len=max(prefill_q, default=0),
        )
        if num_decodes and self.backend.torch_decode_attention:
            self._decode_gather_index(meta, table[:num_decodes], seq_lens[:num_decodes])
        return ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True),
            positions=torch.tensor(pos, dtype=torch.long).to(dev, non_blocking=True),
            meta=meta,
            sample_index=torch.tensor(sample_rows, dtype=torch.long).to(dev, non_blocking=True),
            sample_seqs=sample_seqs,
            order=order,
            prompt_rows=prompt_rows if prompt_rows is not None and prompt_rows.rows else None,
        )

    def _decode_gather_index(self, meta: AttentionMetadata, tables: torch.Tensor,
                             lens: list[int]) -> None:
        # whole blocks are gathered (one row = block_size tokens): 2.5x faster than gathering
        # token rows, for a few padded slots that the mask hides
        bs = self.block_size
        nblk = -(-meta.max_decode_len // bs)
        width = nblk * bs
        mask = torch.arange(width).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
        meta.decode_blocks = tables[:, :nblk].reshape(-1).long().to(self.device)  # [B * nblk]
        meta.decode_mask = mask[:, None, None, :].to(self.device)

    @torch.inference_mode()
    def run(self, inp: ModelInput) -> torch.Tensor:
        """Logits [S, vocab] float32 for the sequences in `inp.sample_seqs`."""
        with device_scope(self.device):  # Triton launches on the current device, not ours
            return self._run(inp)

    def _run(self, inp: ModelInput) -> torch.Tensor:
        path = next((p for p in self.fast_paths if p.applies(inp)), None)
        if path is not None:
            hidden = path.run(inp)
        else:
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
        if inp.prompt_rows is not None:
            inp.prompt_logprobs = prompt_logprobs.compute(hidden, self.model.compute_logits,
                                                          inp.prompt_rows)
        if not inp.sample_seqs:
            return hidden.new_empty(0, self.model.shape.vocab, dtype=torch.float32)
        return self.model.compute_logits(hidden[inp.sample_index])

    def take_expert_tokens(self) -> torch.Tensor:
        """Tokens per expert of each MoE layer since the last call, [moe_layers, experts]
        (empty for a dense model)."""
        take = getattr(self.model, "take_expert_tokens", None)
        return take() if take is not None else torch.zeros(0, 0, dtype=torch.long)

    # ---- KV movement for hold / resume / export / import ---------------------------------
    def read_kv(self, block_ids: list[int], num_tokens: int) -> HostKV:
        """Copy the first `num_tokens` tokens' KV of these blocks to host memory."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        s = self.model.shape
        data = self.kv[:, :, idx].reshape(s.num_layers, 2, -1, s.num_kv_heads, s.head_dim)
        data = data[:, :, :num_tokens].to("cpu", copy=True)
        return [(data[i, 0], data[i, 1]) for i in range(s.num_layers)]

    def write_kv(self, block_ids: list[int], kv: HostKV) -> None:
        n = kv[0][0].shape[0]
        bs = self.block_size
        slots = torch.tensor([block_ids[p // bs] * bs + p % bs for p in range(n)],
                             dtype=torch.long, device=self.device)
        for (kc, vc), (k, v) in zip(self.kv_caches, kv):
            kc.view(-1, *kc.shape[2:])[slots] = k.to(self.device, self.dtype)
            vc.view(-1, *vc.shape[2:])[slots] = v.to(self.device, self.dtype)


def _cumsum(xs: list[int]) -> list[int]:
    total, out = 0, []
    for x in xs:
        total += x
        out.append(total)
    return out
