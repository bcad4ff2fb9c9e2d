"""Model runner: turns a SchedulerOutput into one forward pass over the paged KV cache.

Holds the model weights and the per-layer KV caches, flattens the scheduled sequences into one
batch (decodes first, then prefill/extend chunks), and returns hidden states at the positions
whose next token must be sampled: through the first whole-model fast path that serves the step
(`fast_paths/`: CUDA graphs, the C decode stack), else through the model's own forward. Where
the step's KV is and whether it attends in micro-batches is decided here and written in its
`AttentionMetadata` (the model never learns it): with a KV host tier (`worker/kv_tier/`) a step
with host-tier sequences is laid out in micro-batches by tier, and an MoE model's step attends
in micro-batches of `micro_batch_seqs` sequences when set. It also moves KV between the cache and
host memory for hold/resume and export/import.
"""
from __future__ import annotations

from itertools import repeat
from operator import attrgetter, is_not
from typing import TYPE_CHECKING

import numpy as np
import torch

from batchgen_data.worker.devices import device_scope
from batchgen_data.worker.device_mark import DeviceMark, mark_now
from batchgen_data.sample import prompt_logprobs
from batchgen_data.worker.block_tables import BlockTables
from batchgen_data.worker.fast_paths import FastPath, build_fast_paths
from batchgen_data.worker.fast_paths.cpu_decode_stack import CpuDecodeStack
from batchgen_data.worker.fast_paths.cuda_graphs import DecodeGraphs
from batchgen_data.worker.fast_paths.piecewise_graphs import MixedGraphs
from batchgen_data.worker.model_input import ModelInput
from batchgen_data.worker import mm_step
from batchgen_data.core.encoder_cache import EncoderCache
from batchgen_data.sample.sampling_batch import to_device
from batchgen_data.core.scheduler import SchedulerOutput
from batchgen_data.core.sequence import Sequence, collecting
from batchgen_data.core.kv.held_kv import KVCopy
from batchgen_data.core.kv.planes import check_one_plane_scales, kv_planes, layer_caches
from batchgen_data.layers.attention import AttentionMetadata
from batchgen_data.layers.backend import LayerBackend
from batchgen_data.layers.micro_batch import split_by_sequences
from batchgen_data.worker.kv_tier.tier import HostKVTier
from batchgen_data.worker.offload.store import WeightStore

if TYPE_CHECKING:
    from batchgen_data.worker.lora_manager import LoRAManager

_COMPUTED = attrgetter("num_computed_tokens")
_TOKEN_IDS = attrgetter("token_ids")
_PROMPT_LOGPROBS = attrgetter("prompt_logprobs")
_NO_EXPERTS = torch.zeros(0, 0, dtype=torch.long)  # a dense model's (read-only)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 backend: LayerBackend, weight_store: WeightStore | None = None,
                 kv_tier: HostKVTier | None = None, micro_batch_seqs: int | None = None
                 ) -> None:
        """`micro_batch_seqs`: an MoE model's steps attend in micro-batches of at most that many
        sequences (`attention_micro_batch_seqs`), its experts still once over the whole step."""
        self.model = model
        # looked up once: a missing attribute of a torch Module costs an exception each time
        self._take_expert_tokens = getattr(model, "take_expert_tokens", None)
        self.weight_store = weight_store  # streams offloaded layers in (cpu_offload_gb > 0)
        self.kv_tier = kv_tier  # the KV host tier's caches (host_kv_tier_bytes > 0)
        if micro_batch_seqs is not None and self._take_expert_tokens is None:
            raise ValueError("attention_micro_batch_seqs applies to MoE models only")
        self.micro_batch_seqs = micro_batch_seqs
        self.backend = backend  # the one the model's layers were built for
        self.device = device = backend.device
        self.dtype = dtype = backend.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        s = model.shape
        planes = kv_planes(s)
        check_one_plane_scales(model, planes)
        # [layers, planes, num_blocks, block_size, Hkv, D]: K and V, or one plane that is both
        self.kv = torch.zeros(s.num_layers, planes, num_blocks, block_size, s.num_kv_heads,
                              s.head_dim, dtype=backend.kv_dtype, device=device)  # fp8: kv_quant
        self.kv_caches = layer_caches(self.kv)
        self.fast_paths: list[FastPath] = []
        self.lora: "LoRAManager | None" = None  # enable_lora: adapters' slots and rows
        self.block_tables = BlockTables()  # the running sequences' rows, kept across steps
        # a vision-language model: M-RoPE positions, and images encoded into the engine's
        # encoder cache (given by the engine) before the forward that reads them
        self.takes_images = bool(getattr(model, "takes_images", False))
        self.encoder_cache: EncoderCache | None = None

    def build_fast_paths(self, max_num_seqs: int, max_model_len: int,
                         cuda_graphs: bool = True,
                         max_num_batched_tokens: int | None = None) -> None:
        """Set up the fast paths this model and cache allow (captures CUDA graphs on a GPU)."""
        self.fast_paths = build_fast_paths(self.model, self.kv_caches, self.backend, max_num_seqs,
                                           max_model_len, self.block_size, cuda_graphs,
                                           max_num_batched_tokens)
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

    @property
    def mixed_graphs(self) -> MixedGraphs | None:
        return self.fast_path(MixedGraphs)  # type: ignore[return-value]

    def offload_counters(self) -> tuple[int, int]:
        """(bytes of weights streamed to the device so far, peak weight bytes resident)."""
        store = self.weight_store
        return (0, 0) if store is None else (store.bytes_moved, store.peak_resident_bytes)

    def kv_tier_counters(self) -> tuple[int, int]:
        """(KV bytes moved between host tier and device so far, most host-tier sequences in
        one step)."""
        tier = self.kv_tier
        return (0, 0) if tier is None else (tier.bytes_moved, tier.host_seqs_peak)

    @property
    def can_overlap(self) -> bool:
        """Whether the engine may overlap steps (`worker/runner.py`): not while adapters or a
        KV host tier take part in a step, whose host work reads the step's sequences."""
        return self.lora is None and self.kv_tier is None

    def mark(self) -> DeviceMark:
        """A point in the device's queue of work, here and now: `wait()` returns once the
        device has done everything queued before it (a CUDA event; on the CPU the work is done
        when it is queued)."""
        return mark_now(self.device)

    def device_step_s(self) -> float | None:
        """Seconds the device spent on the last `run`, where the runner knows them apart from
        the host loop's; None here: the engine times the step by the wall clock (a real
        device's step time is its wall time, the host's work overlapping or small)."""
        return None

    @staticmethod
    def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
        s = model.shape
        return (kv_planes(s) * s.num_layers * s.num_kv_heads * s.head_dim
                * torch.finfo(dtype).bits // 8)

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        """Flatten the step into one batch, decodes first. Per-token work is numpy over the
        step's arrays; the block tables are kept across steps (`BlockTables`)."""
        bs = self.block_size
        q_all = np.array(out.num_new_tokens, dtype=np.int64)  # [N] new tokens, scheduled order
        decode = q_all == 1
        all_decode = bool(decode.all())
        # decodes first, otherwise as scheduled
        order = np.arange(len(q_all)) if all_decode else np.argsort(~decode, kind="stable")
        computed_all, lengths_all = _scheduled_arrays(out)  # [N] each, scheduled order
        groups = None
        if self.kv_tier is not None:  # micro-batches by tier when some KV is in host memory
            groups = self.kv_tier.groups([s.block_ids for s in out.seqs],
                                         [s.num_computed_tokens + n
                                          for s, n in zip(out.seqs, out.num_new_tokens)],
                                         out.num_new_tokens)
            order = order if groups is None else np.array([i for g in groups for i in g])
        ordered = all_decode and groups is None  # scheduled order is already decodes first
        seqs = out.seqs if ordered else [out.seqs[i] for i in order.tolist()]
        q = q_all if ordered else q_all[order]  # [N]
        n_seqs = len(seqs)
        num_decodes = n_seqs if all_decode else int(decode.sum())
        starts = computed_all if ordered else computed_all[order]  # [N] computed before
        seq_lens = starts + q  # [N] KV length after the step
        cu = np.zeros(n_seqs + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])  # [N + 1] first token row of each sequence
        starts_l = starts.tolist()
        if num_decodes == n_seqs:  # one token each: the token at its first uncomputed position
            ids = [s.token_ids[a] for s, a in zip(seqs, starts_l)]
            pos = starts
        else:
            ids = []
            for s, a, n in zip(seqs, starts_l, q.tolist()):
                if n == 1:
                    ids.append(s.token_ids[a])
                else:
                    ids.extend(s.token_ids[a:a + n])
            pos = np.arange(cu[-1], dtype=np.int64) + np.repeat(starts - cu[:-1], q)  # [T]
        prompt_rows = None
        asking = any(map(is_not, map(_PROMPT_LOGPROBS, seqs), repeat(None)))
        for i, seq in enumerate(seqs) if asking else ():
            if seq.prompt_logprobs is not None and collecting(seq):
                prompt_rows = prompt_rows or prompt_logprobs.PromptRows()
                prompt_rows.add(seq, int(cu[i]), starts_l[i], starts_l[i] + int(q[i]))
        token_slots: list[int] | None = None
        if self.lora is not None:  # the step's adapters into device slots first
            self.lora.ensure_resident({s.lora.lora_int_id for s in seqs if s.lora})
            seq_slots = np.array([-1 if s.lora is None else self.lora.slot(s.lora.lora_int_id)
                                  for s in seqs], dtype=np.int64)
            token_slots = np.repeat(seq_slots, q).tolist()
        num_tokens = lengths_all if ordered else lengths_all[order]  # [N] before the step
        sampled = seq_lens == num_tokens  # [N] the step reaches the sequence's last token
        sample_rows = cu[1:][sampled] - 1  # [S]
        sample_seqs = seqs if sampled.all() else [seqs[i] for i in
                                                         np.flatnonzero(sampled).tolist()]
        if groups is not None:  # each group a micro-batch over the caches its KV is in
            assert self.kv_tier is not None
            sizes = [len(g) for g in groups]
            firsts = _cumsum([0] + sizes)
            rows = [list(range(a, a + n)) for a, n in zip(firsts, sizes)]
            meta = self.kv_tier.attention(rows, [s.block_ids for s in seqs], seq_lens.tolist(),
                                          q.tolist())
        else:
            table_rows = self.block_tables.rows(seqs)  # [N]
            tables = self.block_tables.gather(table_rows)  # [N, max blocks] int32
            # the cache slot of each new token: its block's id * block_size + offset
            blocks = tables[np.repeat(np.arange(n_seqs), q), pos // bs].astype(np.int64)
            slots = blocks * bs + pos % bs  # [T]
            meta = self._metadata(tables, slots, seq_lens, q, num_decodes)
        mm = None
        if self.takes_images:
            mm = mm_step.MultiModalStep(out.encode, mm_step.image_rows(seqs, starts_l, q, cu))
            pos = mm_step.mrope_positions(seqs, starts_l, q, cu, pos)  # [3, T]
        input_ids, positions, sample_index = to_device(
            [torch.from_numpy(np.array(ids, dtype=np.int64)), torch.from_numpy(pos),
             torch.from_numpy(sample_rows)], self.device)
        return ModelInput(
            input_ids=input_ids,
            positions=positions,
            meta=meta,
            sample_index=sample_index,
            sample_seqs=sample_seqs,
            order=order.tolist(),
            prompt_rows=prompt_rows if prompt_rows is not None and prompt_rows.rows else None,
            lora=None if token_slots is None else self.lora.batch(token_slots),
            flat=(seqs, seq_lens, num_tokens + sampled),
            mm=mm,
        )

    def _metadata(self, tables: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
                  q_lens: np.ndarray, num_decodes: int) -> AttentionMetadata:
        """The attention metadata of a step run as one batch over the device cache, from its
        host arrays: tables [N, blocks] int32, slots [T] int64, seq_lens and q_lens [N]."""
        prefill_q = q_lens[num_decodes:]
        cu = np.zeros(len(prefill_q) + 1, dtype=np.int32)
        np.cumsum(prefill_q, out=cu[1:])
        table = torch.from_numpy(np.ascontiguousarray(tables, dtype=np.int32))
        slot_d, table_d, lens_d, cu_d = to_device(
            [torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)), table,
             torch.from_numpy(seq_lens.astype(np.int32)), torch.from_numpy(cu)], self.device)
        meta = AttentionMetadata(
            slot_mapping=slot_d,
            num_decodes=num_decodes,
            block_tables=table_d,
            seq_lens=lens_d,
            cu_seqlens_q=cu_d,
            seq_lens_host=seq_lens.tolist(),
            query_lens_host=q_lens.tolist(),
            max_decode_len=int(seq_lens[:num_decodes].max(initial=0)),
            max_prefill_len=int(prefill_q.max(initial=0)),
        )
        if num_decodes and self.backend.torch_decode_attention:
            self._decode_gather_index(meta, table[:num_decodes], seq_lens[:num_decodes])
        return meta

    def _decode_gather_index(self, meta: AttentionMetadata, tables: torch.Tensor,
                             lens: np.ndarray) -> None:
        # whole blocks are gathered (one row = block_size tokens): one index per block instead
        # of one per token, for a few padded slots that the mask hides
        bs = self.block_size
        nblk = -(-meta.max_decode_len // bs)
        width = nblk * bs
        mask = torch.arange(width).unsqueeze(0) < torch.from_numpy(lens).unsqueeze(1)
        # [B * nblk]; an entry freed outside a sliding window (core/kv/room.trim, negative)
        # reads block 0 instead, under the mask
        meta.decode_blocks = tables[:, :nblk].reshape(-1).long().clamp(min=0).to(self.device)
        meta.decode_mask = mask[:, None, None, :].to(self.device)

    @torch.inference_mode()
    def run(self, inp: ModelInput) -> torch.Tensor:
        """Logits [S, vocab] float32 for the sequences in `inp.sample_seqs`."""
        with device_scope(self.device):  # Triton launches on the current device, not ours
            return self._run(inp)

    def _run(self, inp: ModelInput) -> torch.Tensor:
        if inp.lora is not None:  # the adapted layers read the step's rows from the context
            self.lora.ctx.batch = inp.lora
            try:
                return self._forward(inp)
            finally:
                self.lora.ctx.batch = None
        return self._forward(inp)

    def model_forward(self, inp: ModelInput) -> torch.Tensor:
        """Hidden states [T, hidden] of the step through the model's own forward. An MoE
        model's step of more than `micro_batch_seqs` sequences attends in micro-batches of that
        many (a step laid out by tier already has its own); a tiered step's last swapped rows
        go back to the host tier after it."""
        meta = inp.meta
        limit = self.micro_batch_seqs
        if limit is not None and meta.micro_batches is None and len(meta.query_lens_host) > limit:
            meta = AttentionMetadata.in_micro_batches(split_by_sequences(meta, limit))
        try:
            if inp.mm is not None:  # images: encoded first, their rows written in
                cache = self.encoder_cache
                assert cache is not None, "a model that takes images runs with an encoder cache"
                mm_step.encode(self.model, cache, inp.mm.encode, inp.mm.rows)
                embeds = mm_step.embeddings(self.model, cache, inp.input_ids, inp.mm.rows)
                return self.model(inp.input_ids, inp.positions, self.kv_caches, meta,
                                  inputs_embeds=embeds)
            return self.model(inp.input_ids, inp.positions, self.kv_caches, meta)
        finally:
            if self.kv_tier is not None and inp.meta.micro_batches is not None:
                self.kv_tier.end_step()

    def _forward(self, inp: ModelInput) -> torch.Tensor:
        # a step laid out by tier runs the model's own forward: no fast path takes micro-batches
        path = None if inp.meta.micro_batches is not None or inp.mm is not None else next(
            (p for p in self.fast_paths if p.applies(inp)), None)
        hidden = path.run(inp) if path is not None else self.model_forward(inp)
        if inp.prompt_rows is not None:
            inp.prompt_logprobs = prompt_logprobs.compute(hidden, self.model.compute_logits,
                                                          inp.prompt_rows)
        if not inp.sample_seqs:
            return hidden.new_empty(0, self.model.shape.vocab, dtype=torch.float32)
        return self.model.compute_logits(hidden[inp.sample_index])

    def close(self) -> None:
        """Nothing to stop: one device, in this process."""

    def free(self) -> None:
        """Drop the KV cache and the fast paths (which hold the weights' and the cache's
        addresses): the engine is rebuilt around a re-sharded model (engine/group/group.py)."""
        self.fast_paths = []
        self.kv = torch.empty(0, device=self.device)
        self.kv_caches = []

    def take_expert_tokens(self, on_device: bool = False) -> torch.Tensor:
        """Tokens per expert of each MoE layer since the last call, [moe_layers, experts]
        (empty for a dense model); `on_device`: left where the layers count them, for a
        caller that reads them only after waiting for the device."""
        take = self._take_expert_tokens
        if take is None:
            return _NO_EXPERTS
        return take(on_device=True) if on_device else take()

    # ---- KV movement for hold / resume / export / import ---------------------------------
    def _cache_of(self, block_ids: list[int]) -> tuple[torch.Tensor, list[int]]:
        """The cache [layers, planes, blocks, block_size, Hkv, D] these blocks (all of one tier)
        live in, and their rows there."""
        held = None if self.kv_tier is None else self.kv_tier.holding(block_ids)
        return (self.kv, block_ids) if held is None else held

    def read_kv(self, block_ids: list[int], num_tokens: int) -> KVCopy:
        """Copy the first `num_tokens` tokens' KV of these blocks to host memory."""
        cache, rows = self._cache_of(block_ids)
        idx = torch.tensor(rows, dtype=torch.long, device=cache.device)
        s = self.model.shape
        planes = cache.shape[1]
        data = cache[:, :, idx].reshape(s.num_layers, planes, -1, s.num_kv_heads, s.head_dim)
        data = data[:, :, :num_tokens].to("cpu", copy=True)
        # a one-plane cache's copy is (K, K): the same tensor, so export and hold keep the pair
        return [(data[i, 0], data[i, planes - 1]) for i in range(s.num_layers)]

    def write_kv(self, block_ids: list[int], kv: KVCopy) -> None:
        cache, rows = self._cache_of(block_ids)
        n = kv[0][0].shape[0]
        bs = self.block_size
        slots = torch.tensor([rows[p // bs] * bs + p % bs for p in range(n)],
                             dtype=torch.long, device=cache.device)
        for layer, (k, v) in zip(cache, kv):  # layer: [planes, blocks, block_size, Hkv, D]
            for c, new in zip(layer, (k, v)):  # one plane: K only (V is the same rows)
                c.view(-1, *c.shape[2:])[slots] = new.to(cache.device, cache.dtype)


def _scheduled_arrays(out: SchedulerOutput) -> tuple[np.ndarray, np.ndarray]:
    """Computed tokens and token counts of the step's sequences in scheduled order [N]: the
    scheduler's arrays where it has them (the running sequences), the admitted ones read."""
    known = out.arrays
    k = 0 if known is None else len(known[0])
    rest = out.seqs[k:]
    m = len(rest)
    computed = np.fromiter(map(_COMPUTED, rest), np.int64, m)
    lengths = np.fromiter(map(len, map(_TOKEN_IDS, rest)), np.int64, m)
    if known is None:
        return computed, lengths
    if not m:
        return known
    return np.concatenate([known[0], computed]), np.concatenate([known[1], lengths])


def _cumsum(xs: list[int]) -> list[int]:
    total, out = 0, []
    for x in xs:
        total += x
        out.append(total)
    return out
