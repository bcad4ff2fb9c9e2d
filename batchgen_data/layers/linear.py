"""Linear layers whose weight is kept once, in the layout of the kernels that multiply it.

The layout is chosen when the model is built (`backend.current().linear`) and applied by
`process_weights_after_loading()`, which the loader calls once the checkpoint is in:
  * "plain": the [out, in] weight and `F.linear` (CUDA, and the CPU without its kernels);
  * "onednn": oneDNN's blocked layout for every row count (CPU, fp32/bf16, no AVX-512);
  * "panels": 48-column panels (CPU, fp32, AVX-512): the C panel kernel up to `PANEL_MAX_ROWS`
    rows (every decode step of a batch up to that size), torch's batched matmul on the same
    panels beyond (prefill chunks, bigger decode batches);
  * "rows": the plain [out, in] weight (CPU, fp32, AVX2 without AVX-512): the C row kernel up to
    `ROWS_GEMM_MAX_ROWS` rows (decode steps), `F.linear` beyond (prefill chunks);
  * "widen": the plain bf16 / fp16 weight (CPU, where neither oneDNN's packed weights nor
    torch's own half matmuls have a fast path for the dtype, e.g. bf16 without AVX-512
    BW/VL/DQ): `F.linear` in the dtype up to `WIDEN_MIN_ROWS` rows, the weight widened to fp32
    for MKL beyond (`widen_forward`).
Earlier versions kept the plain weight next to the packed copies (three copies of every weight
while they fit 2 GiB); one copy is what keeps an engine of the default model near its weights'
size in memory (`benchmarks/engine_memory.py`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen_data.layers import quant
from batchgen_data.layers.backend import current

# rows up to which a "widen" layer multiplies in its half dtype: on an AVX2 box ATen's
# reference bf16 GEMM and widening the weight to fp32 for MKL tie at about this many rows;
# beyond, widening wins by more the more rows there are (docs/cpu.md, "CPU kinds")
WIDEN_MIN_ROWS = 8


class Linear(nn.Module):
    """y = x W^T + b for x [..., in_features]; W dense in `layout`, or quantized (`scheme`:
    `qweight`, `weight_scale`, `weight_zero`, see layers/quant.py) when the loader says so."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | None = nn.Parameter(
            torch.empty(out_features, in_features, device=quant.weight_device()))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.layout = current().linear
        self.scheme: quant.QuantScheme | None = None
        self._c_quant, self._triton = current().c_quant, current().triton
        self._home, self._dtype = torch.empty(0).device, torch.get_default_dtype()
        # the weight in `layout` ("onednn", "panels") once loaded
        self.register_buffer("packed", None, persistent=False)
        # LoRA adapters' slots of this layer (layers/lora.py), attached by the LoRA manager
        self.lora: nn.Module | None = None

    def use_quant(self, scheme: quant.QuantScheme | None) -> None:
        """Allocates the weight deferred at build: stored as `scheme`, or dense (None)."""
        if scheme is None:
            self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features,
                                                   device=self._home, dtype=self._dtype))
            return
        self.weight, self.scheme = None, scheme
        # GPTQ act order: the input column of each stored column, shared by fused shards
        self.register_buffer("input_perm", None, persistent=False)
        self._perm_rows = 0  # rows loaded so far (the first shard sets `input_perm`)
        stored = scheme.empty((self.out_features,), self.in_features, self._home)
        for name, t in zip(("qweight", "weight_scale", "weight_zero"), stored):
            setattr(self, name, None if t is None else nn.Parameter(t, requires_grad=False))

    def load_quant_rows(self, start: int, src: quant.QuantWeight, name: str) -> None:
        """Copies a quantized checkpoint matrix into rows [start, start + src.rows)."""
        if self.scheme is None:
            raise ValueError(f"checkpoint weight {name!r} is quantized but its layer is not")
        src.check(name, self.scheme, self.in_features)
        if self._perm_rows == 0:  # the first shard sets the order, the others must share it
            self.input_perm = None if src.perm is None else src.perm.to(self._home)
        elif ((src.perm is None) != (self.input_perm is None) or src.perm is not None
              and not torch.equal(src.perm, self.input_perm.cpu())):
            raise ValueError(f"checkpoint weight {name!r}: its g_idx order differs from the "
                             "other projections fused into its layer")
        self._perm_rows += src.rows
        quant.fill_rows((self.qweight.data, self.weight_scale.data,
                         None if self.weight_zero is None else self.weight_zero.data), start, src)

    def process_weights_after_loading(self) -> None:
        """Moves the loaded weight into the layout's form and drops the plain copy."""
        if self.scheme is not None:
            return  # quantized: the stored form is the kernels' layout
        if self.layout in ("plain", "rows", "widen") or self.weight is None:
            if self.layout == "rows" and self.weight is not None \
                    and not self.weight.is_contiguous():  # the C kernel reads rows in place
                self.weight = nn.Parameter(self.weight.detach().contiguous(), requires_grad=False)
            return
        from batchgen_data.kernels.cpu import linear as cpu_linear

        weight = self.weight.detach()
        self.packed = (cpu_linear.pack_panels(weight) if self.layout == "panels"
                       else cpu_linear.pack_onednn(weight))
        self.weight = None
        if self.bias is not None and not self.bias.is_contiguous():
            self.bias = nn.Parameter(self.bias.detach().contiguous(), requires_grad=False)

    def plain_weight(self) -> torch.Tensor:
        """The dense weight as [out, in], whatever its layout (a re-partition reads it back)."""
        if self.packed is None:
            return self.weight.detach()
        return unpack_weight(self.packed, self.layout, self.out_features, self.in_features)

    def release_weight(self) -> None:
        """Drops the dense weight in every form (once a re-partition has copied it)."""
        self.weight, self.packed = None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the base product of the stored format, then the adapters' low-rank deltas (if any)
        y = self.base_forward(x)
        return y if self.lora is None else self.lora(x, y)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme is not None:
            if self.input_perm is not None:
                x = x.index_select(-1, self.input_perm)
            out = quant.quant_matmul(x, self.qweight, self.weight_scale, self.weight_zero,
                                     self.scheme, self._c_quant, self._triton)
            return out if self.bias is None else out.add_(self.bias)
        if self.layout == "rows":
            return rows_forward(x, self.weight, self.bias)
        if self.layout == "widen":
            return widen_forward(x, self.weight, self.bias)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return packed_forward(x, self.packed, self.bias, self.out_features, self.layout)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, layout={self.layout}"
                + (f", quant={self.scheme}" if self.scheme is not None else ""))


def packed_forward(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int, layout: str) -> torch.Tensor:
    """`F.linear` of x [..., in] with a weight packed for `layout` ("onednn" or "panels")."""
    from batchgen_data.kernels.cpu import linear as cpu_linear

    if layout == "onednn":
        return cpu_linear.onednn_linear(x, packed, bias)
    if x.numel() // x.shape[-1] <= cpu_linear.PANEL_MAX_ROWS:
        return cpu_linear.panel_linear(x, packed, bias, out_features)
    return cpu_linear.panel_matmul(x, packed, bias, out_features)


def unpack_weight(packed: torch.Tensor, layout: str, rows: int, cols: int) -> torch.Tensor:
    """The plain [rows, cols] weight behind `packed` (the inverse of the packing at load)."""
    if layout == "panels":  # [ceil(rows / 48), cols, 48]
        return packed.permute(0, 2, 1).reshape(-1, packed.shape[1])[:rows]
    from batchgen_data.kernels.cpu import linear as cpu_linear

    # oneDNN's blocked layout is opaque: multiply the identity (exact: one product per entry)
    eye = torch.eye(cols, dtype=packed.dtype)
    return cpu_linear.onednn_linear(eye, packed, None).t().contiguous()[:rows]


def rows_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
    """`F.linear` on the plain layout: the AVX2 row kernel for a decode step's few rows, where
    it streams each weight row once against all of them (on the MoE benchmark's model it cut
    the q|k|v and o matmuls below oneDNN's, `lab/scripts/moe_tile_ab.py`), `F.linear` for
    prefill chunks, where MKL's cache-blocked GEMM wins."""
    from batchgen_data.kernels.cpu import linear as cpu_linear

    if x.numel() > x.shape[-1] * cpu_linear.ROWS_GEMM_MAX_ROWS or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    out = cpu_linear.rows_linear(x, weight)
    return out if bias is None else out.add_(bias)


def widen_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """`F.linear` on a plain bf16 / fp16 weight where torch's GEMM in that dtype is its slow
    reference one: a decode step's few rows stay in the dtype (reading the weight once beats
    widening it), a prefill chunk widens the weight to fp32 for MKL and rounds the result back
    (one transient fp32 copy of one layer's weight)."""
    if x.numel() <= x.shape[-1] * WIDEN_MIN_ROWS:
        return F.linear(x, weight, bias)
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


class MergedLinear(Linear):
    """Several projections of the same input fused along the output (e.g. gate|up): the
    checkpoint's shard i fills rows [sum(shard_sizes[:i]), sum(shard_sizes[:i + 1]))."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_sizes = list(shard_sizes)


class QKVLinear(MergedLinear):
    """The fused q|k|v projection of attention with `num_heads` query and `num_kv_heads` key
    and value heads of `head_dim`."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden, [q, kv, kv], bias)
        self.q_size, self.kv_size = q, kv
