"""Comparison helpers for the kernel tests (a plain module: conftest is not importable by name
once several test folders have one)."""

from __future__ import annotations

import torch

# (atol, rtol) per dtype: tight enough that an off-by-one mask or a wrong scale fails.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)




def reduction_tolerance(expected: torch.Tensor, k: int, scale: float | None = None
                        ) -> tuple[float, float]:
    """(atol, rtol) for comparing two implementations of sums of ``k`` products in
    ``expected``'s dtype that may add in different orders (another vector width, another
    blocking: AVX2 against AVX-512, a C kernel against torch's GEMM). A reordered sum of ``k``
    terms differs by about ``eps * sqrt(k)`` times the terms' size, and ``4 * eps * k`` bounds it
    in practice (the worst case is ``eps * k``, reached only by adversarial inputs); ``scale``
    is the terms' size, the largest ``|expected|`` by default. rtol is torch.testing's default
    for the dtype. Never tighter than what the arithmetic can promise: an order that differs on
    one CPU kind fails no test there."""
    eps = torch.finfo(expected.dtype).eps
    size = float(expected.abs().max()) if scale is None and expected.numel() else (scale or 1.0)
    rtol = {torch.float32: 1.3e-6, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}[expected.dtype]
    return 4 * eps * max(k, 1) * max(size, 1.0), rtol


def assert_close_sum(actual: torch.Tensor, expected: torch.Tensor, k: int,
                     scale: float | None = None) -> None:
    """``assert_close`` with `reduction_tolerance`: for results that are sums of ``k`` terms."""
    atol, rtol = reduction_tolerance(expected, k, scale)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def shuffled_block_tables(seq_lens: list[int], block_size: int, spare: int
                          ) -> tuple[torch.Tensor, int]:
    """Block tables [seqs, max blocks + 1] int32 for sequences of `seq_lens` tokens, each block
    a random one of `num_blocks` (the blocks they need plus `spare`), and `num_blocks`."""
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + spare
    owners = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(seq_lens), max(per_seq) + 1, dtype=torch.int32)
    for i, count in enumerate(per_seq):
        tables[i, :count] = torch.tensor([owners.pop() for _ in range(count)])
    return tables, num_blocks
