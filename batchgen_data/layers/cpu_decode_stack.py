"""A pure-decode step of a Llama-family model as one C call (fp32, CPU).

Driven layer by layer from Python, a decode step over a few sequences spends much of its time on
module calls, views and small allocations around the C kernels. `CpuDecodeStack` hands the whole layer stack to `csrc/decode_stack.c`, which calls the
same kernels (small-row or panel matmuls, RMSNorm, rotation, SiLU, paged decode attention) in
the same order, so its hidden states and KV writes are bit for bit those of the per-layer path.
At 1-5 sequences of SmolLM2-135M shape this took a decode step's forward from 28-46 ms to
17-27 ms here (`benchmarks/step_trace.py` shows the engine's step times).

It serves steps where every scheduled sequence decodes one token and there are at most
`max_rows` of them (`SMALL_GEMM_MAX_ROWS`, or `PANEL_MAX_ROWS` when every weight has its panel
copy). Other steps, models it cannot take (not fp32, weights not packed, no kernels, a model
class other than the Llama family), or ``BATCHGEN_CPU_DECODE_STACK=0`` keep the per-layer path.
The model runner asks it first, as it asks CUDA graphs on a GPU.
"""
from __future__ import annotations

import logging

import torch

from batchgen_data import env
from batchgen_data.layers import cpu_attention, cpu_kernels, cpu_ops
from batchgen_data.layers.attention import AttentionMetadata
from batchgen_data.layers.cpu_linear import PANEL_MAX_ROWS, SMALL_GEMM_MAX_ROWS, PackedLinear

log = logging.getLogger(__name__)


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class CpuDecodeStack:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_rows: int) -> None:
        lib = cpu_kernels.library()
        assert lib is not None
        self.lib = lib
        self.model = model
        self.shape = s = model.shape
        self.max_rows = max_rows
        k0 = kv_caches[0][0]
        self.block_size = k0.shape[1]
        self.num_slots = k0.shape[0] * k0.shape[1]
        self.cos_sin = model.rotary.cos_sin_cache
        rows = []
        for layer, (kc, vc) in zip(model.layers, kv_caches):
            at, mlp = layer.self_attn, layer.mlp
            row = [_addr(layer.input_layernorm.weight)]
            row += self._linear(at.qkv_proj)
            row += [_addr(at.q_norm.weight) if at.q_norm is not None else 0,
                    _addr(at.k_norm.weight) if at.k_norm is not None else 0]
            row += self._linear(at.o_proj)
            row += [_addr(layer.post_attention_layernorm.weight)]
            row += self._linear(mlp.gate_up_proj) + self._linear(mlp.down_proj)
            row += [kc.data_ptr(), vc.data_ptr()]
            rows.append(row)
        self.scale = float(model.layers[0].self_attn.scale)
        self.table = torch.tensor(rows, dtype=torch.int64)
        assert self.table.shape[1] == lib.bg_decode_stack_layer_slots()
        self._kv_caches = kv_caches  # the table points into them (and into self.model)
        self.steps = 0  # decode steps this stack served

    @staticmethod
    def _linear(lin: PackedLinear) -> list[int]:
        return [_addr(lin.weight), _addr(lin.panel_weight), _addr(lin.bias)]

    @classmethod
    def build(cls, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> "CpuDecodeStack | None":
        """The stack for this model and cache, or None when it cannot run them (see module doc)."""
        from batchgen_data.models.llama import LlamaForCausalLM

        if not env.cpu_decode_stack() or not isinstance(model, LlamaForCausalLM):
            return None
        k0 = kv_caches[0][0] if kv_caches else None
        if k0 is None or not cpu_attention.available(k0) or not cpu_ops.usable(k0):
            return None
        if not all(k.is_contiguous() and v.is_contiguous() for k, v in kv_caches):
            return None
        cos_sin = model.rotary.cos_sin_cache
        if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous():
            return None
        linears = [m for layer in model.layers
                   for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                             layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if not all(isinstance(m, PackedLinear) and m.small_gemm for m in linears):
            return None  # weights not packed, not fp32, or no small-row kernel here
        norms = [w for layer in model.layers for w in (
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            *((layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)
              if layer.self_attn.q_norm is not None else ()))] + [model.norm.weight]
        if not all(w.dtype == torch.float32 and w.is_contiguous() for w in norms):
            return None
        if not all((m.bias is None or (m.bias.dtype == torch.float32 and m.bias.is_contiguous()))
                   for m in linears):
            return None
        panels = all(m.panel_weight is not None for m in linears)
        return cls(model, kv_caches, PANEL_MAX_ROWS if panels else SMALL_GEMM_MAX_ROWS)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
            ) -> torch.Tensor | None:
        """Final-normed hidden states [T, hidden], or None when this step is not one it serves."""
        rows = input_ids.shape[0]
        if (meta.num_decodes != rows or rows == 0 or rows > self.max_rows
                or not meta.cpu_decode_kernel or input_ids.device.type != "cpu"):
            return None
        s = self.shape
        x = self.model.embed_tokens(input_ids)
        if not x.is_contiguous():
            x = x.contiguous()
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        lens = meta.seq_lens.to(torch.int32).contiguous()
        work = torch.empty(self.lib.bg_decode_stack_workspace(
            rows, s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate),
            dtype=torch.float32)
        rc = self.lib.bg_decode_stack_f32(
            self.table.data_ptr(), s.num_layers, self.model.norm.weight.data_ptr(), x.data_ptr(),
            rows, pos.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            tables.shape[1], self.cos_sin.data_ptr(), self.cos_sin.shape[0], self.num_slots,
            work.data_ptr(), s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate,
            self.block_size, float(s.eps), self.scale,
            int(rows > SMALL_GEMM_MAX_ROWS),  # the per-layer path's routing, by rows
            torch.get_num_threads())
        if rc == -3:
            raise ValueError("decode step with a position, cache slot or sequence length out of "
                             "range for the CPU decode stack")
        if rc != 0:
            raise RuntimeError(f"CPU decode stack failed (code {rc})")
        self.steps += 1
        return x
