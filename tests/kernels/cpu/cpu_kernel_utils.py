"""Shared skips and references for the CPU C-kernel tests."""
from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchgen_data import env
from batchgen_data.kernels.cpu import build, lora, moe, ops, quant
from batchgen_data.kernels.cpu import linear as cpu_linear

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                              reason="no C compiler")
needs_onednn = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="no oneDNN linear ops")
needs_small_gemm = pytest.mark.skipif(not cpu_linear.small_gemm_available(),
                                      reason="no C compiler or no AVX-512 here")
needs_panels = pytest.mark.skipif(not cpu_linear.panel_gemm_available(),
                                  reason="no C compiler or no AVX-512 here")
needs_fused_ops = pytest.mark.skipif(not ops.available(), reason="no C compiler")
on_x86 = pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="x86-64 ISAs")


_SELF_CHECKS = (cpu_linear._small_gemm_checked, cpu_linear._panel_gemm_checked,
                cpu_linear._rows_gemm_checked, ops._checked, moe._checked, quant._checked,
                lora._checked)


@contextlib.contextmanager
def kernels_built_for(isa: str, cache: Path) -> Iterator[None]:
    """Inside the block the C kernels are the ones ``BATCHGEN_CPU_ISA=isa`` builds (into
    `cache`), every self-check redone; afterwards the process's own build and self-checks are
    back, already run (a later test that counts kernel calls must not see a self-check's)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(env.CACHE_DIR_VAR, str(cache))
        patch.setenv("BATCHGEN_CPU_ISA", isa)
        build.library.cache_clear()
        for checked in _SELF_CHECKS:
            checked.cache_clear()
        try:
            yield
        finally:
            build.library.cache_clear()
            for checked in _SELF_CHECKS:
                checked.cache_clear()
    for checked in _SELF_CHECKS:
        checked()


def reference_decode(q, k_cache, v_cache, tables, lens, scale):  # type: ignore[no-untyped-def]
    """Dense attention of each decode query over its sequence's blocks."""
    outs = []
    bs = k_cache.shape[1]
    for i, n in enumerate(lens.tolist()):
        blocks = tables[i, :-(-n // bs)].long()
        k = k_cache[blocks].flatten(0, 1)[:n]  # [n, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:n]
        o = F.scaled_dot_product_attention(q[i][:, None], k.transpose(0, 1), v.transpose(0, 1),
                                           scale=scale, enable_gqa=True)
        outs.append(o[:, 0])
    return torch.stack(outs)


def torch_panels(weight: torch.Tensor) -> torch.Tensor:
    """The panel layout built with torch ([ceil(N / 48), K, 48], zero-padded)."""
    out_f, in_f = weight.shape
    p = -(-out_f // 48)
    padded = torch.zeros(p * 48, in_f)
    padded[:out_f] = weight
    return padded.view(p, 48, in_f).transpose(1, 2).contiguous()
