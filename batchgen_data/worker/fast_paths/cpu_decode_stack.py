"""A pure-decode step of a Llama-family model as one C call (fp32, CPU): a runner fast path.

Driven layer by layer from Python, a decode step over a few sequences spends much of its time on
module calls, views and small allocations around the C kernels. `CpuDecodeStack` hands the whole
layer stack to `csrc/decode_stack.c` beside this file (built over the kernel library by
`kernels/cpu/build.extension`), which calls the same kernels (panel matmuls, RMSNorm, rotation,
SiLU, paged decode attention) in the same order, so its hidden states and KV writes are bit for
bit those of the per-layer path (`lab/scripts/step_trace.py` shows the engine's step times).

It serves steps where every scheduled sequence decodes one token and there are at most
`PANEL_MAX_ROWS` of them, with the linear layers in the panel layout or all quantized
(`layers/quant.py`; the stack calls the same quantized-weight kernel). Steps whose rows run
under LoRA adapters too, when every adapted layer adds its deltas with the C kernel
(`layers/lora.py`, kernel "c"): the stack calls that kernel after each linear, on the same
rows, so those steps too are bit for bit the per-layer path's. Other steps, models it
cannot take (a backend without the C kernels or the panel layout, a model class other than the
Llama family, a layer with a sliding window or attention sinks) keep the per-layer path.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from batchgen_data.kernels.cpu import build as cpu_kernels
from batchgen_data.kernels.cpu.linear import PANEL_MAX_ROWS
from batchgen_data.layers.backend import LayerBackend
from batchgen_data.layers.linear import Linear

if TYPE_CHECKING:
    from batchgen_data.worker.model_input import ModelInput

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).with_name("csrc") / "decode_stack.c",)


def library() -> ctypes.CDLL | None:
    """The decode stack's C library over the kernels, declared; None where it cannot be built."""
    lib = cpu_kernels.extension(SOURCES)
    if lib is None:
        return None
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.bg_decode_stack_layer_slots.argtypes = []
    lib.bg_decode_stack_layer_slots.restype = i64
    lib.bg_decode_stack_workspace.argtypes = [i64] * 6
    lib.bg_decode_stack_workspace.restype = i64
    lib.bg_decode_stack_f32.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr,
                                        i64, i64, ptr, i64, i64, i64, i64, i64, i64,
                                        ctypes.c_float, ctypes.c_float, c_int, ptr, c_int]
    lib.bg_decode_stack_f32.restype = c_int
    lib.bg_decode_stack_lora_slots.argtypes = []
    lib.bg_decode_stack_lora_slots.restype = i64
    return lib


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class CpuDecodeStack:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_rows: int = PANEL_MAX_ROWS) -> None:
        lib = library()
        assert lib is not None
        self.lib = lib
        self.model = model
        self.shape = s = model.shape
        self.max_rows = max_rows
        # quantized linears: the table points at one descriptor per layer (see _linear)
        self.quant = _quantized(model)
        self._descriptors: list[torch.Tensor] = []
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
        self.scale = float(model.layers[0].self_attn.attn.scale)
        self.table = torch.tensor(rows, dtype=torch.int64)
        assert self.table.shape[1] == lib.bg_decode_stack_layer_slots()
        self._kv_caches = kv_caches  # the table points into them (and into self.model)
        self._lora_table: torch.Tensor | None | bool = False  # False: not looked at yet
        self._lora_rank = 0
        self.steps = 0  # decode steps this stack served
        self.lora_steps = 0  # of which with LoRA adapters

    def _linear(self, lin: Linear) -> list[int]:
        # [plain weight, panels, bias]: the stack runs the panel kernel (use_panels = 1), or
        # quantized weights (use_panels = 2), where the first slot is a descriptor's address
        if not self.quant:
            return [0, _addr(lin.packed), _addr(lin.bias)]
        from batchgen_data.kernels import reference
        from batchgen_data.kernels.cpu.quant import KINDS

        scheme = lin.scheme
        zdef = torch.tensor([reference.DEFAULT_ZERO[scheme.kind]], dtype=torch.float32)
        desc = torch.tensor([lin.qweight.data_ptr(), lin.weight_scale.data_ptr(),
                             _addr(lin.weight_zero), scheme.group(lin.in_features),
                             KINDS[scheme.kind], int(zdef.view(torch.int32).item()) & 0xFFFFFFFF],
                            dtype=torch.int64)
        self._descriptors.append(desc)
        return [desc.data_ptr(), 0, _addr(lin.bias)]

    @classmethod
    def build(cls, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              backend: LayerBackend) -> "CpuDecodeStack | None":
        """The stack for this model and cache, or None when it cannot run them (see module doc)."""
        from batchgen_data.models.llama import LlamaForCausalLM

        if not isinstance(model, LlamaForCausalLM):
            return None
        if any(layer.self_attn.attn.sliding_window or layer.self_attn.attn.sinks is not None
               for layer in model.layers):
            return None  # the stack's attention has no window or sinks: the per-layer path
        quant = _quantized(model)
        if not (backend.device.type == "cpu" and backend.dtype == torch.float32
                and backend.c_ops and backend.c_attention
                and (backend.c_quant if quant else backend.linear == "panels")):
            return None
        k0 = kv_caches[0][0] if kv_caches else None
        if k0 is None or k0.dtype != torch.float32 or k0.device.type != "cpu":
            return None
        if library() is None:
            return None
        if not all(k.is_contiguous() and v.is_contiguous() for k, v in kv_caches):
            return None
        cos_sin = model.rotary.cos_sin_cache
        if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous():
            return None
        if cos_sin.shape[1] != model.shape.head_dim:
            return None  # a partial rotation (Phi-4-mini): the C stack rotates whole heads
        linears = [m for layer in model.layers
                   for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                             layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if quant:
            if not all(isinstance(m, Linear) and m.scheme is not None
                       and m.input_perm is None for m in linears):
                return None  # some layers quantized, some not, or inputs permuted (GPTQ)
        elif not all(isinstance(m, Linear) and m.layout == "panels" and m.packed is not None
                     for m in linears):
            return None  # weights not in the panel layout
        norms = [w for layer in model.layers for w in (
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            *((layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)
              if layer.self_attn.q_norm is not None else ()))] + [model.norm.weight]
        if not all(w.dtype == torch.float32 and w.is_contiguous() for w in norms):
            return None
        if not all((m.bias is None or (m.bias.dtype == torch.float32 and m.bias.is_contiguous()))
                   for m in linears):
            return None
        return cls(model, kv_caches)

    def applies(self, inp: ModelInput) -> bool:
        """A pure-decode step of at most `max_rows` sequences (with adapters: when every
        adapted layer has the C kernel's slots)."""
        rows = inp.input_ids.shape[0]
        return (inp.meta.num_decodes == rows and 0 < rows <= self.max_rows
                and (inp.lora is None or self.lora_table() is not None))

    def lora_table(self) -> torch.Tensor | None:
        """[layers, LORA_SLOTS]: the adapters' slots of q|k|v, o, gate|up and down (A's address,
        B^T's address and row stride), or None when some layer's deltas are not the C kernel's (no LoRA: never
        asked). The slots are filled in place, so the addresses hold for the engine's life."""
        if self._lora_table is False:
            deltas = [[lin.lora for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                            layer.mlp.gate_up_proj, layer.mlp.down_proj)]
                      for layer in self.model.layers]
            flat = [d for row in deltas for d in row]
            self._lora_table = None
            if all(d is not None and d.kernel == "c" for d in flat) \
                    and len({d.max_rank for d in flat}) == 1:
                self._lora_rank = flat[0].max_rank
                self._lora_table = torch.tensor(
                    [[p for d in row for p in (d.a.data_ptr(), d.bt.data_ptr(), d.bt.stride(1))]
                     for row in deltas], dtype=torch.int64)
                assert self._lora_table.shape[1] == self.lib.bg_decode_stack_lora_slots()
        return self._lora_table  # type: ignore[return-value]

    @torch.inference_mode()
    def run(self, inp: ModelInput) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of a step that `applies`."""
        input_ids, positions, meta = inp.input_ids, inp.positions, inp.meta
        rows = input_ids.shape[0]
        s = self.shape
        x = self.model.embed_tokens(input_ids)
        if not x.is_contiguous():
            x = x.contiguous()
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        lens = meta.seq_lens.to(torch.int32).contiguous()
        lora = None
        if inp.lora is not None:  # {table, R, tok, seg_starts, seg_slots, S}
            table, b = self.lora_table(), inp.lora
            assert table is not None
            lora = torch.tensor([table.data_ptr(), self._lora_rank, b.token_idx.data_ptr(),
                                 b.seg_starts.data_ptr(), b.seg_slots.data_ptr(),
                                 b.seg_slots.shape[0]], dtype=torch.int64)
        work = torch.empty(self.lib.bg_decode_stack_workspace(
            rows, s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate),
            dtype=torch.float32)
        rc = self.lib.bg_decode_stack_f32(
            self.table.data_ptr(), s.num_layers, self.model.norm.weight.data_ptr(), x.data_ptr(),
            rows, pos.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            tables.shape[1], self.cos_sin.data_ptr(), self.cos_sin.shape[0], self.num_slots,
            work.data_ptr(), s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate,
            self.block_size, float(s.eps), self.scale,
            2 if self.quant else 1,  # quantized weights, else the panel layout
            None if lora is None else lora.data_ptr(), torch.get_num_threads())
        if rc == -3:
            raise ValueError("decode step with a position, cache slot or sequence length out of "
                             "range for the CPU decode stack")
        if rc != 0:
            raise RuntimeError(f"CPU decode stack failed (code {rc})")
        self.steps += 1
        self.lora_steps += lora is not None
        return x


def _quantized(model: torch.nn.Module) -> bool:
    """Whether the model's first decoder layer stores its q|k|v weight quantized."""
    layers = getattr(model, "layers", None)
    return bool(layers) and getattr(layers[0].self_attn.qkv_proj, "scheme", None) is not None
