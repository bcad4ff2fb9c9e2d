"""The model runner of a tensor-parallel engine (`tensor_parallel_size > 1`, docs/parallel.md).

Every rank holds a `TPRunner` over its shard of the model and of the KV cache (its KV heads).
On rank 0 it is the engine's runner: each forward, KV read and KV write is first broadcast as
plain data (`worker/tp/step_io.py`), then done locally, the model's collectives joining the
ranks' partial results; logits arrive whole on rank 0, which alone samples. On the other ranks
`serve()` loops: receive, do the same, until rank 0 says stop or goes away.

KV leaves and enters the group with every KV head (`read_kv` gathers the ranks' heads, a
replicated head taken once; `write_kv` hands each rank its heads), so what hold, export and
import see is the same at any `tensor_parallel_size`: a sequence exported from a one-device
engine continues in a TP group, and back. An FP8 cache's codes cross as bytes; every rank
loads the same per-layer scales, so its heads' codes mean the same everywhere.

A failed collective (a rank died or stalled past `collective_timeout_s`) makes the engine dead:
`EngineDeadError` naming the rank and the end of its log, now and on every later call.
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch

from batchgen_data.worker.devices import device_scope
from batchgen_data.worker.tp import step_io
from batchgen_data.worker.tp.launch import RankGroup
from batchgen_data.sample import prompt_logprobs
from batchgen_data.worker.model_input import ModelInput
from batchgen_data.worker.model_runner import ModelRunner
from batchgen_data.core.kv.held_kv import KVCopy
from batchgen_data.layers.backend import LayerBackend
from batchgen_data.layers.parallel import CollectiveError, kv_heads_of_rank


def _dead_error(msg: str) -> Exception:
    from batchgen_data.core.errors import EngineDeadError

    return EngineDeadError(msg)


class TPRunner(ModelRunner):
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 backend: LayerBackend, ranks: RankGroup, micro_batch_seqs: int | None = None
                 ) -> None:
        super().__init__(model, num_blocks, block_size, backend,
                         micro_batch_seqs=micro_batch_seqs)
        self.ranks = ranks
        self._dead: str | None = None
        self._lora_fills: list[tuple[int, Any]] = []  # rank 0: slots to fill on the others

    @property
    def can_overlap(self) -> bool:
        """No: every step is first broadcast to the ranks on the engine's thread."""
        return False

    def lora_filled(self, slot: int, request: Any) -> None:
        """Rank 0's LoRA manager filled `slot` with `request`'s adapter: the other ranks fill
        theirs before the next step (`_run_all`, on the thread that sends steps)."""
        self._lora_fills.append((slot, request))

    # ---- rank 0 ---------------------------------------------------------------------------
    def _send(self, head: torch.Tensor, payload: torch.Tensor) -> None:
        self.ranks.control.broadcast(head)
        self.ranks.control.broadcast(payload)

    def _guarded(self, fn: Any, *args: Any) -> Any:
        if self._dead is not None:
            raise _dead_error(self._dead)
        try:
            return fn(*args)
        except CollectiveError as exc:
            deadline = time.monotonic() + 1.0  # a rank that just died: let its exit show
            while self.ranks.dead() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            why = self.ranks.dead() or "a rank stalled"
            self._dead = f"tensor-parallel engine is dead ({why}): {exc}"
            self.ranks.close()
            raise _dead_error(self._dead) from exc

    def run(self, inp: ModelInput) -> torch.Tensor:
        return self._guarded(self._run_all, inp)

    def _run_all(self, inp: ModelInput) -> torch.Tensor:
        m = inp.meta
        while self._lora_fills:
            slot, request = self._lora_fills.pop(0)
            blob = step_io.pack_object(request)
            self._send(step_io.header(step_io.LORA, blob.numel(), blob.numel() * 8, slot), blob)
        prompt = torch.tensor(inp.prompt_rows.rows if inp.prompt_rows is not None else [],
                              dtype=torch.int64)
        data = step_io.StepData(inp.input_ids.cpu(), inp.positions.cpu(), m.slot_mapping.cpu(),
                                torch.tensor(m.seq_lens_host), torch.tensor(m.query_lens_host),
                                m.block_tables.cpu(), inp.sample_index.cpu(), m.num_decodes,
                                prompt, _token_slots(inp))
        self._send(*data.pack())
        return super().run(inp)

    def read_kv(self, block_ids: list[int], num_tokens: int) -> KVCopy:
        return self._guarded(self._read_all, block_ids, num_tokens)

    def _read_all(self, block_ids: list[int], num_tokens: int) -> KVCopy:
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        self._send(step_io.header(step_io.READ_KV, blocks.numel(), num_tokens), blocks)
        parts = self.ranks.control.gather(_wire(self._read_local(block_ids, num_tokens)))
        parts = [p.view(self.kv.dtype) for p in parts]
        s = self.model.shape
        if s.total_kv_heads < self.ranks.size:  # replicated: one copy of each head
            parts = [parts[j * self.ranks.size // s.total_kv_heads]
                     for j in range(s.total_kv_heads)]
        full = torch.cat(parts, dim=3)  # [layers, 2, n, Hkv_total, D]
        return [(full[i, 0], full[i, 1]) for i in range(s.num_layers)]

    def write_kv(self, block_ids: list[int], kv: KVCopy) -> None:
        self._guarded(self._write_all, block_ids, kv)

    def _write_all(self, block_ids: list[int], kv: KVCopy) -> None:
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        full = torch.stack([torch.stack(layer) for layer in kv]).to(self.kv.dtype).contiguous()
        self._send(step_io.header(step_io.WRITE_KV, blocks.numel(), full.shape[2]), blocks)
        self.ranks.control.broadcast(_wire(full))
        self._write_local(block_ids, full)

    def release(self) -> None:
        """Rank 0: end this TP engine but keep the other ranks' processes, which return from
        `serve` (a re-partition back into separate engines, engine/group/group.py)."""
        self._guarded(self.ranks.control.broadcast, step_io.header(step_io.STOP, 0))
        self._dead = "tensor-parallel engine was re-partitioned into separate engines"

    def close(self) -> None:
        """Rank 0: stop the other ranks (they also stop when this process ends)."""
        if self._dead is None:
            self._dead = "tensor-parallel engine was closed"
            try:
                self.ranks.control.broadcast(step_io.header(step_io.STOP, 0))
            except CollectiveError:
                pass
        self.ranks.close()

    # ---- every rank -----------------------------------------------------------------------
    def _read_local(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        kv = ModelRunner.read_kv(self, block_ids, num_tokens)  # this rank's heads
        return torch.stack([torch.stack(layer) for layer in kv])  # [layers, 2, n, Hkv, D]

    def _write_local(self, block_ids: list[int], full: torch.Tensor) -> None:
        s = self.model.shape
        heads = kv_heads_of_rank(s.total_kv_heads, self.ranks.size, self.ranks.rank)
        mine = full[:, :, :, heads.start:heads.stop]
        ModelRunner.write_kv(self, block_ids, [(mine[i, 0], mine[i, 1])
                                                for i in range(s.num_layers)])

    # ---- ranks > 0 ------------------------------------------------------------------------
    def serve(self, config: Any = None) -> None:
        """Do what rank 0 broadcasts until it says stop (or its collectives fail). With
        `config` enabling LoRA, the adapters' slots are laid out first (rank 0's LORA commands
        fill them)."""
        if config is not None and config.lora.enable_lora and self.lora is None:
            from batchgen_data.worker.lora_manager import attach

            self.lora = attach(self.model, self, config)
        control = self.ranks.control
        while True:
            head = control.broadcast(torch.empty(step_io.HEADER, dtype=torch.int64))
            command, length = head[:2].tolist()
            if command == step_io.STOP:
                return
            payload = control.broadcast(torch.empty(length, dtype=torch.int64))
            if command == step_io.RUN:
                self._follow(step_io.StepData.unpack(head, payload))
            elif command == step_io.READ_KV:
                control.gather(_wire(self._read_local(payload.tolist(), int(head[2]))))
            elif command == step_io.LORA:  # a slot rank 0 filled: this rank's part of it
                self.lora.fill_slot(int(head[3]), step_io.unpack_object(payload, int(head[2])))
            elif command == step_io.WRITE_KV:
                s = self.model.shape
                full = torch.empty(s.num_layers, 2, int(head[2]), s.total_kv_heads, s.head_dim,
                                   dtype=self.kv.dtype)
                control.broadcast(_wire(full))  # in place
                self._write_local(payload.tolist(), full)
            else:
                raise RuntimeError(f"unknown command {command} from rank 0")

    @torch.inference_mode()
    def _follow(self, d: step_io.StepData) -> None:
        """Rank 0's `ModelRunner.run` from this rank's side: the forward, then the same logits
        computations (prompt-logprob rows in the slices `prompt_logprobs.compute` takes, then
        the sampled rows), whose gathers deliver to rank 0."""
        with device_scope(self.device):
            inp = self._input(d)
            if d.lora_slots.numel():  # the adapted layers read the step's rows from the context
                self.lora.ctx.batch = self.lora.batch(d.lora_slots.tolist())
            try:
                hidden = self.model_forward(inp)
            finally:
                if self.lora is not None:
                    self.lora.ctx.batch = None
            rows = d.prompt_rows.to(self.device)
            step = prompt_logprobs._ROWS_PER_SLICE  # (the slices rank 0 computes in)
            for a in range(0, rows.numel(), step):
                self.model.compute_logits(hidden[rows[a:a + step]])
            if inp.sample_seqs:
                self.model.compute_logits(hidden[inp.sample_index])

    def _input(self, d: step_io.StepData) -> ModelInput:
        dev = self.device
        meta = self._metadata(d.block_tables.numpy(), d.slot_mapping.numpy(),
                              d.seq_lens.numpy(), d.query_lens.numpy(), d.num_decodes)
        return ModelInput(input_ids=d.input_ids.to(dev), positions=d.positions.to(dev),
                          meta=meta, sample_index=d.sample_index.to(dev),
                          sample_seqs=[None] * d.sample_index.numel(),  # type: ignore[list-item]
                          order=[])


def _token_slots(inp: ModelInput) -> torch.Tensor:
    """Each token row's LoRA slot (-1: none) of the step's `LoRABatch`; [0] without one."""
    slots = inp.lora.token_slots if inp.lora is not None else None
    return torch.tensor(slots or [], dtype=torch.int64)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """`t` as the collectives carry it: an FP8 cache's codes as their bytes (gloo has no
    float8 type), the same memory."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def start_ranks(config: Any, hf_config: Any, quantized: bool, device: torch.device
                ) -> RankGroup:
    """Rank 0: check that this model and config can run at `config.tensor_parallel_size`
    (ValueError naming the value, before anything loads), then start the other ranks."""
    from batchgen_data.worker.tp import launch

    size = config.tensor_parallel_size
    check_tp(config, hf_config, quantized, device, size)
    if device.type == "cpu" and config.num_threads is None:
        # the ranks share the host's cores: this one takes its share, as the others do
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    return launch.start(config, size, device.type, config.collective_timeout_s,
                        config.enable_expert_parallel)


def check_tp(config: Any, hf_config: Any, quantized: bool, device: torch.device,
             size: int) -> None:
    """ValueError naming `tensor_parallel_size` when this model and config cannot run as
    `size` ranks (from the HF config alone: before anything starts or loads)."""
    from batchgen_data.layers.parallel import check_shape
    from batchgen_data.models.deepseek_v3 import DeepseekV3ForCausalLM
    from batchgen_data.models.gemma import Gemma2ForCausalLM
    from batchgen_data.models.llama import DecoderForCausalLM
    from batchgen_data.models.registry import resolve_architecture

    cls = resolve_architecture(hf_config)
    sharded = issubclass(cls, (DecoderForCausalLM, Gemma2ForCausalLM))
    if not sharded or issubclass(cls, DeepseekV3ForCausalLM):
        raise ValueError(f"tensor_parallel_size={size}: the Llama-family decoders (Llama, "
                         f"Mistral, Qwen2, Qwen3), Gemma 2/3 and the MoE models (Qwen2/Qwen3-MoE, "
                         f"Mixtral) are sharded; {cls.__name__} is not yet (docs/parallel.md)")
    check_shape(hf_config, size, config.enable_expert_parallel)
    moe = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if quantized and moe and config.enable_expert_parallel:
        raise ValueError(f"tensor_parallel_size={size} with enable_expert_parallel=True: "
                         "quantized experts are split in width only (the expert-parallel block "
                         "runs dense experts; docs/parallel.md)")
    listed = getattr(config, "rank_devices", None)
    last = max(listed) if listed else (device.index or 0) + size - 1
    if device.type == "cuda" and torch.cuda.device_count() <= last and \
            getattr(config, "distributed_executor_backend", None) != "ray":  # a GPU per actor
        where = f"rank_devices={listed}" if listed else f"cuda:{device.index or 0} on"
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs (one per rank, "
                         f"{where}); {torch.cuda.device_count()} visible")


def device_of_rank(config: Any, rank: int, index: int | None = None) -> torch.device:
    """The device process `rank` of an engine of `config` runs on (`rank_device` from the
    engine's own `device`)."""
    from batchgen_data.worker.devices import pick_device, resolve_device

    return rank_device(resolve_device(pick_device(config.device)), rank, index,
                       getattr(config, "rank_devices", None))


def rank_device(device: torch.device, rank: int, index: int | None = None,
                listed: tuple[int, ...] | None = None) -> torch.device:
    """One device per rank: on cuda:`index` where its launcher says (a Ray rank sees only its
    own GPU), else the rank's entry of `listed` (`rank_devices`), else the index of `device`
    (rank 0's: cuda:0 unless named) plus the rank; on the CPU they share the host."""
    if device.type != "cuda":
        return device
    if index is not None:
        return torch.device("cuda", index)
    if listed is not None:
        return torch.device("cuda", listed[rank])
    return torch.device("cuda", (device.index or 0) + rank)
