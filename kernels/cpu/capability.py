"""What this CPU, and the libraries running on it, can do: asked once, in one place.

Every CPU-dependent choice of the engine asks here rather than guessing from the CPU's name,
because the project meets different kinds of CPU (an AVX-512 Xeon with bf16 and AMX, AMD EPYCs
with AVX2 only, AVX-512 boxes without bf16) and the answer belongs to the library that runs the
op. Three layers decide, each with its own answer and its own variable to emulate a lesser CPU
on any box (docs/cpu.md, "CPU kinds"):

* the project's C kernels (`csrc/`) are compiled for an ISA level (`isa.kernel_isa()`: the
  CPU's level from its flags, capped by ``BATCHGEN_CPU_ISA``); the built library then says
  which kernels it holds (`bg_*_supported`, `built_isa()`).
* oneDNN's packed weights (``torch.ops.mkldnn``): `onednn(dtype)` packs and multiplies a tiny
  weight of that dtype and reports oneDNN's own refusal when it fails (on a CPU without
  AVX-512 BW/VL/DQ or AVX-NE-CONVERT it has no bf16 path). ``ONEDNN_MAX_CPU_ISA`` caps it.
* ATen's kernels: `aten()` is ``torch.backends.cpu.get_cpu_capability()`` (capped by
  ``ATEN_CPU_CAPABILITY``) and `half_matmul_fast(dtype)` is torch's own answer whether its
  bf16 / fp16 matmuls reach oneDNN's fast path; without it they run ATen's reference GEMM,
  far slower than fp32 MKL at prefill sizes (docs/cpu.md).

`python -m batchgen_data.kernels.cpu.capability` prints the answers (the CI's CPU-kind passes
print them before their tests).
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from batchgen_data import env
from batchgen_data.kernels.cpu import build, isa

log = logging.getLogger(__name__)

HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Support:
    """Whether one path runs here; `reason` says why not, naming the CPU feature it misses."""

    ok: bool
    reason: str = ""


def built_isa() -> str:
    """The level of the kernels the built library holds (its own answer): "avx512" with the
    panel kernel, "avx2" with the row kernel, "baseline" with neither, "none" without one."""
    lib = build.library()
    if lib is None:
        return "none"
    if lib.bg_panel_gemm_supported():
        return "avx512"
    return "avx2" if lib.bg_rows_gemm_supported() else "baseline"


def needs(level: str) -> str:
    """Why a kernel of `level` is not built here, naming what is missing (a refusal's text)."""
    lacks = isa.missing(level)
    if lacks:
        return f"it needs {', '.join(lacks)}, which this CPU lacks"
    return (f"it needs {level.upper()}; the C kernels here are built for {isa.kernel_isa()} "
            f"(BATCHGEN_CPU_ISA={env.cpu_isa()}, or no C compiler)")


def aten() -> str:
    """ATen's dispatch level (``AVX512``, ``AVX2``, ``DEFAULT``...; ATEN_CPU_CAPABILITY caps it)."""
    return torch.backends.cpu.get_cpu_capability()


def half_matmul_fast(dtype: torch.dtype) -> bool:
    """Whether torch's own matmuls in `dtype` (bf16 / fp16) take oneDNN's fast path here
    (torch's answer). Without it `F.linear` in that dtype runs ATen's reference GEMM."""
    ops = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(ops._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(ops._is_mkldnn_fp16_supported())
    return True


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def onednn(dtype: torch.dtype) -> Support:
    """Whether oneDNN's packed linear runs in `dtype` here: a tiny weight packed and multiplied
    against F.linear in fp32 (oneDNN's own refusal, which names the CPU features, when not)."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return Support(False, "this torch build has no oneDNN linear ops")
    if dtype not in (torch.float32, torch.bfloat16):
        return Support(False, f"the engine packs float32 and bfloat16 weights, not {dtype}")
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(37, 53, generator=gen), torch.randn(5, 53, generator=gen)
    try:
        packed = ops._reorder_linear_weight(weight.to(dtype), None)
        got = ops._linear_pointwise(x.to(dtype), packed, None, "none", [], "").float()
    except (RuntimeError, NotImplementedError) as exc:
        return Support(False, f"oneDNN: {str(exc).splitlines()[0]}")
    want = torch.nn.functional.linear(x.to(dtype).float(), weight.to(dtype).float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # bf16 output rounding (8 bits of mantissa)
    if not torch.allclose(got, want, rtol=tol, atol=tol * 10):
        return Support(False, "oneDNN's packed linear disagrees with F.linear on this CPU")
    return Support(True)


def report() -> dict[str, str]:
    """Every answer above as text: what a CPU kind runs (printed by the CI's CPU-kind passes)."""
    out = {"cpu": isa.native_isa(), "aten": aten(), "c_kernels": isa.kernel_isa(),
           "c_kernels_built": built_isa()}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        s = onednn(dtype)
        out[f"onednn_{name}"] = "yes" if s.ok else f"no ({s.reason})"
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        out[f"torch_{name}_matmul"] = "oneDNN" if half_matmul_fast(dtype) else "reference"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m batchgen_data.kernels.cpu.capability",
                                description="What this CPU kind runs (docs/cpu.md)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the answers here")
    args = p.parse_args(argv)
    answers = report()
    print("  ".join(f"{k}={v}" for k, v in answers.items()), flush=True)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(answers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
