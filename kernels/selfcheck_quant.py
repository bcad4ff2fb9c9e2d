"""The quantized matmuls' cases of the kernel self-check (`selfcheck.py --quant`): each builds
its inputs on the device and returns (the kernel's output, the torch reference's), which
selfcheck.py scores by its relative error."""
from __future__ import annotations

import torch

Pair = tuple[torch.Tensor, torch.Tensor]


def case_quant(dtype: torch.dtype, kind: str, rows: int, dev: torch.device) -> Pair:
    """The weight-only quantized matmul (groups of 128) on a 4096 x 4096 weight."""
    from batchgen_data.kernels import quant_linear, reference
    from batchgen_data.kernels.cpu.quant import random_codes

    gen = torch.Generator().manual_seed(rows)
    n = k = 4096
    codes = random_codes(kind, n, k, gen).to(dev)
    scales = ((torch.rand(n, k // 128, generator=gen) + 0.5) / 64).to(dev)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(dev)
    return (quant_linear(x, codes, scales, None, kind, 128),
            reference.quant_linear(x, codes, scales, None, kind, 128))


def case_mxfp4(dtype: torch.dtype, rows: int, dev: torch.device) -> Pair:
    """The MXFP4 matmul on gpt-oss's gate|up shape (5760 x 2880, biased), decoded in its K loop."""
    from batchgen_data.kernels import mxfp4_linear, reference

    gen = torch.Generator().manual_seed(rows)
    n, k = 5760, 2880
    blocks = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8).to(dev)
    scales = torch.randint(118, 126, (n, k // 32), generator=gen, dtype=torch.uint8).to(dev)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(dev)
    bias = torch.randn(n, generator=gen).to(dev)
    return (mxfp4_linear(x, blocks, scales, bias),
            reference.mxfp4_linear(x, blocks, scales, bias))


def case_fp8_block(dtype: torch.dtype, rows: int, dev: torch.device) -> Pair:
    """FP8 W8A8, 128 x 128 weight blocks, per-token-group activation scales (DeepSeek-V3)."""
    from batchgen_data.kernels import fp8_block_matmul, reference

    gen = torch.Generator().manual_seed(rows)
    n, k = 2048, 7168
    w = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).to(dev)
    ws = (torch.rand(n // 128, k // 128, generator=gen) / 1000 + 1e-4).to(dev)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(dev)
    return (fp8_block_matmul(x, w, ws, (128, 128)),
            reference.fp8_block_matmul(x, w, ws, (128, 128)))
