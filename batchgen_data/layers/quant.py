"""Quantized weights as the layers store them, and the base matmul that multiplies them.

One stored form serves every checkpoint format (`models/quant_formats.py` converts each into it):
codes of `kind` "int8" (int8 [N, K]), "int4" (uint8 [N, ceil(K / 2)], two per byte, codes
0..15) or "fp8" (float8_e4m3fn bit patterns, uint8 [N, K]); fp32 `scale` [N, G] and, for an
asymmetric scheme, fp32 `zero` [N, G], one per `group` input columns (G = ceil(K / group)).
A weight is w = (code - zero) * scale; block-scaled FP8 (128 x 128 blocks) keeps its block
scales repeated per row, so fused projections can cut rows anywhere.

Which matmul multiplies the stored form is decided once when the layer is built: the Triton
kernel on the Triton backend (`kernels/quant_matmul.py: quant_linear`, weight-only), the C kernel
(`kernels/cpu/quant.py`, fp32 CPU, `LayerBackend.c_quant`), or the torch reference (dequantize,
then `F.linear`). Either way a layer's forward stays
``y = base(x)``, with only the base matmul replaced, so a LoRA delta can be added after it.

Models are built with their Linear and expert weights *deferred* (`deferring()`: on the meta
device), so a quantized layer never allocates its dense weight; the loader then gives each layer
its scheme (or none: a layer the checkpoint keeps in floating point) with `use_quant`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen_data.kernels import reference

KINDS = ("int8", "int4", "fp8")
_CODE_DTYPE = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.uint8}


@dataclass(frozen=True)
class QuantScheme:
    """How a layer stores its weight: `kind`, the group of input columns one scale covers
    (None: the whole row, per output channel) and whether zeros are stored (asymmetric)."""

    kind: str
    group_size: int | None = None
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"quantized weight kind={self.kind!r}: use one of {KINDS}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size={self.group_size!r}: must be >= 1")
        if self.kind == "fp8" and not self.symmetric:
            raise ValueError("fp8 weights have no zero point (symmetric only)")

    def group(self, k: int) -> int:
        return k if self.group_size is None else self.group_size

    def groups(self, k: int) -> int:
        return -(-k // self.group(k))

    def code_cols(self, k: int) -> int:
        return -(-k // 2) if self.kind == "int4" else k

    @property
    def code_dtype(self) -> torch.dtype:
        return _CODE_DTYPE[self.kind]

    def empty(self, rows: tuple[int, ...], k: int, device: torch.device | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Uninitialised (codes, scale, zero) for weights [*rows, k]."""
        codes = torch.empty(*rows, self.code_cols(k), dtype=self.code_dtype, device=device)
        scale = torch.empty(*rows, self.groups(k), dtype=torch.float32, device=device)
        zero = None if self.symmetric else torch.empty_like(scale)
        return codes, scale, zero


def pad_rows(t: torch.Tensor, rows: int | None) -> torch.Tensor:
    """`t` with zero rows appended up to `rows` (None: as it is)."""
    if rows is None or t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


@dataclass
class QuantWeight:
    """One checkpoint matrix [n, k] converted to the stored form of `scheme`."""

    scheme: QuantScheme
    k: int
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    # input column of each stored column (GPTQ act order), None: in order
    perm: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [n, k], columns in input order."""
        w = reference.dequantize(self.codes, self.scale, self.zero, self.scheme.kind,
                                 self.scheme.group(self.k), self.k)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w

    def take_rows(self, start: int, stop: int, pad_to: int | None = None) -> "QuantWeight":
        """Output rows [start, stop) (a column-parallel rank's slice), zero rows appended up to
        `pad_to` (a padded vocabulary: codes, scale and zero 0, so the row is 0)."""
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else pad_rows(t[start:stop], pad_to)

        return QuantWeight(self.scheme, self.k, cut(self.codes), cut(self.scale),  # type: ignore[arg-type]
                           cut(self.zero), self.perm)

    def take_cols(self, start: int, stop: int, name: str) -> "QuantWeight":
        """Input columns [start, stop) (a row-parallel rank's slice): whole scale groups, whole
        bytes of int4 codes; ValueError naming `name` when the cut falls inside either, or the
        columns are stored out of order (GPTQ act order)."""
        if self.perm is not None:
            raise ValueError(f"checkpoint weight {name!r}: GPTQ act order (g_idx) stores the "
                             "input columns out of order; it cannot be split over ranks "
                             "(tensor_parallel_size > 1)")
        g = self.scheme.group(self.k)
        grouped = self.scheme.group_size is not None
        if grouped and (start % g or ((stop - start) % g and stop != self.k)):
            raise ValueError(f"checkpoint weight {name!r}: group_size={g} does not divide the "
                             f"{stop - start} input columns each rank keeps (tensor_parallel_size "
                             "> 1)")
        if self.scheme.kind == "int4" and start % 2:
            raise ValueError(f"checkpoint weight {name!r}: an odd split of packed int4 codes")
        c0, c1 = (start // 2, -(-stop // 2)) if self.scheme.kind == "int4" else (start, stop)
        g0, g1 = (start // g, -(-stop // g)) if grouped else (0, 1)
        return QuantWeight(self.scheme, stop - start, self.codes[:, c0:c1],
                           self.scale[:, g0:g1],
                           None if self.zero is None else self.zero[:, g0:g1])

    def check(self, name: str, scheme: QuantScheme, k: int) -> None:
        """ValueError naming `name` unless this matrix fits a layer of `scheme` and `k` inputs."""
        if self.scheme != scheme or self.k != k:
            raise ValueError(f"checkpoint weight {name!r} is {self.scheme} over {self.k} inputs; "
                             f"the layer holds {scheme} over {k}")


_deferred: ContextVar[bool] = ContextVar("quant_deferred", default=False)


@contextlib.contextmanager
def deferring() -> Iterator[None]:
    """Layers built within the block put their weights on the meta device until `use_quant`."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def weight_device() -> torch.device | None:
    """Where a layer built now puts its (deferrable) weights: meta while `deferring`."""
    return torch.device("meta") if _deferred.get() else None


def fill_rows(dst: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], start: int,
              src: QuantWeight) -> None:
    """Copy `src` into rows [start, start + src.rows) of stored (codes, scale, zero)."""
    codes, scale, zero = dst
    rows = slice(start, start + src.rows)
    codes[rows].copy_(src.codes.view(codes.dtype))
    scale[rows].copy_(src.scale)
    if zero is not None:
        assert src.zero is not None
        zero[rows].copy_(src.zero)


def quant_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor | None, scheme: QuantScheme, c_kernel: bool,
                 triton: bool = False) -> torch.Tensor:
    """x [..., k] times the stored weight's transpose: [..., n] in x's dtype. `c_kernel` /
    `triton`: the layer's backend (fixed when it was built)."""
    k = x.shape[-1]
    if triton:  # the weight-only Triton kernel (W4A16 / W8A16 / FP8 weights)
        from batchgen_data.kernels import quant_linear
        return quant_linear(x.contiguous(), codes, scale, zero, scheme.kind, scheme.group(k))
    if c_kernel and x.dtype == torch.float32 and x.device.type == "cpu":
        from batchgen_data.kernels.cpu import quant as cpu_quant
        return cpu_quant.quant_linear(x, codes, scale, zero, scheme.kind, scheme.group(k))
    w = reference.dequantize(codes, scale, zero, scheme.kind, scheme.group(k), k)
    return F.linear(x, w.to(x.dtype))
