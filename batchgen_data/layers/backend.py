"""Which implementation the layers use, chosen once when a model is built for a device and dtype.

`LayerBackend.choose(device, dtype, cpu_kernels)` decides: the Triton kernels on CUDA; on the CPU
the compiled C kernels (`batchgen_data.kernels.cpu`) where they run (fp32, a C compiler, the
self-checks pass) and torch elsewhere. What runs on this CPU kind is asked of
`kernels.cpu.capability` (the C library's ISA, oneDNN's answer per dtype, torch's own), so an
AVX2-only box, an AVX-512 one without bf16 and an emulation of either choose alike. The model loader builds a model inside `building(backend)`,
so every layer constructor reads the same choice (`current()`) and keeps its implementation for
the model's life; the model code itself never branches on the backend.

`choose(..., triton=True)` builds for the Triton kernels on any device: on CPU tensors they run
under ``TRITON_INTERPRET=1``, so the whole model's kernel path can be checked without a GPU (the
engine's `build_parts(config, triton=True)` passes it on).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch


log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _triton_ok() -> bool:
    try:
        from batchgen_data.kernels import triton_available
    except ImportError:
        return False
    return triton_available()


def use_triton(device: torch.device) -> bool:
    """Whether a model built for `device` runs the Triton kernels by default."""
    return device.type == "cuda" and _triton_ok()


@dataclass(frozen=True)
class LayerBackend:
    """The implementation family of every layer of one model.

    `triton`: the Triton kernels. `c_ops`: RMSNorm, the rotation and SiLU*up in C (fp32 CPU).
    `c_attention`: decode attention over the paged cache in C (fp32 CPU). `c_moe`: an MoE
    layer's routed experts in one C call for a few tokens (fp32 CPU). `c_rows`: a few rows times
    a plain-layout weight in C where no panel kernel runs (the tied output projection; fp32
    CPU with AVX2). `linear`: the weight layout of the linear layers, "plain" (torch), "rows",
    "onednn", "panels" or "widen" (see layers/linear.py). `c_quant`: quantized weights multiplied by the
    C kernel that widens them inside the product (fp32 CPU, AVX2; layers/quant.py).
    `kv_cache_dtype`: the paged KV cache's dtype when it is not the model's (float8_e4m3fn:
    `kv_cache_dtype="fp8"`, layers/kv_quant.py; every attention path above reads it).
    """

    device: torch.device
    dtype: torch.dtype
    triton: bool = False
    c_ops: bool = False
    c_attention: bool = False
    c_moe: bool = False
    c_rows: bool = False
    linear: str = "plain"
    c_quant: bool = False
    kv_cache_dtype: torch.dtype | None = None

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype the runner allocates the paged KV cache in."""
        return self.kv_cache_dtype or self.dtype

    @property
    def torch_decode_attention(self) -> bool:
        """Whether the attention layers decode on the torch path, which reads the gather index
        (`AttentionMetadata.decode_blocks` / `decode_mask`) the runner builds once per step."""
        return not (self.triton or self.c_attention)

    @classmethod
    def choose(cls, device: torch.device, dtype: torch.dtype, cpu_kernels: bool = True,
               head_dim: int | None = None, kv_cache_dtype: str | None = "auto",
               triton: bool | None = None) -> "LayerBackend":
        """The backend for a model on `device` in `dtype`; `cpu_kernels=False` keeps the CPU on
        torch; `kv_cache_dtype`: "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (ValueError
        naming any other value, before anything is allocated); `triton`: the Triton kernels
        on any device where Triton is installed (True), never (False), or on CUDA (None)."""
        from batchgen_data.layers import kv_quant

        if (kv_cache_dtype or "auto") not in kv_quant.NAMES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: use one of "
                             f"{tuple(kv_quant.NAMES)} (docs/quantization.md)")
        kv = kv_quant.NAMES[kv_cache_dtype or "auto"]
        if triton is None:
            triton = use_triton(device)
        if triton and _triton_ok():
            return cls(device, dtype, triton=True, kv_cache_dtype=kv)
        if device.type != "cpu" or not cpu_kernels:
            return cls(device, dtype, kv_cache_dtype=kv)
        from batchgen_data.kernels.cpu import attention, capability, linear, moe, ops, quant

        fp32 = dtype == torch.float32
        if fp32 and linear.panel_gemm_available():
            layout = "panels"
        elif fp32 and linear.rows_gemm_available():
            layout = "rows"  # AVX2 without AVX-512: decode rows in C on the plain weight
        elif dtype in (torch.float32, torch.bfloat16) and linear.onednn_available(dtype):
            layout = "onednn"
        elif dtype in capability.HALF and not capability.half_matmul_fast(dtype):
            layout = "widen"  # torch's half GEMM is its slow reference one here
            _say_widen(dtype)
        else:
            layout = "plain"
        c_attention = fp32 and head_dim is not None and attention.supports(head_dim)
        return cls(device, dtype, c_ops=fp32 and ops.available(), c_attention=c_attention,
                   c_moe=fp32 and moe.available(),
                   c_rows=fp32 and layout != "panels" and linear.rows_gemm_available(),
                   linear=layout, c_quant=fp32 and quant.available(), kv_cache_dtype=kv)


@functools.lru_cache(maxsize=None)
def _say_widen(dtype: torch.dtype) -> None:
    """Tells, once per dtype, why a half-precision model's matmuls run the "widen" layout."""
    from batchgen_data.kernels.cpu import capability

    why = capability.onednn(dtype).reason if dtype == torch.bfloat16 else \
        f"torch has no oneDNN {dtype} matmul on this CPU (ATen {capability.aten()})"
    log.warning("dtype=%s on this CPU: %s; the linear layers keep plain %s weights and "
                "widen them to float32 for prefill (docs/cpu.md, CPU kinds)",
                str(dtype).replace("torch.", ""), why, str(dtype).replace("torch.", ""))


_current: ContextVar[LayerBackend | None] = ContextVar("layer_backend", default=None)


@contextlib.contextmanager
def building(backend: LayerBackend) -> Iterator[LayerBackend]:
    """Layers constructed within the block take `backend` (the model loader wraps the model's
    constructor in it)."""
    token = _current.set(backend)
    try:
        yield backend
    finally:
        _current.reset(token)


def current() -> LayerBackend:
    """The backend of the model being built: the one set by `building`, else a torch-only
    backend for the default device and dtype (a model built outside the loader)."""
    chosen = _current.get()
    if chosen is not None:
        return chosen
    return LayerBackend(torch.empty(0).device, torch.get_default_dtype())
