"""The routed experts of an MoE layer in one C call, for fp32 on the CPU (`csrc/moe_experts.c`).

A decode step sends a few tokens to each expert. On torch that is a sort, a gather, two grouped
matmuls, the activation and a scatter-add per layer, far under the machine's memory bandwidth
(`lab/scripts/moe_step_profile.py` profiles such a step). The kernel buckets the (token,
expert) pairs itself, streams each active expert's gate/up and down rows once with SiLU * up
fused in between, and adds the weighted results into the output: no per-expert dispatch, no
copies of the weights (it reads the layer's own `w13` [E, 2I, H] and `w2` [E, H, I]). Needs AVX2
and FMA.

It runs for up to `MAX_TOKENS` tokens; longer prefill chunks give each expert enough rows for a
library GEMM to win, and keep the torch path. A first-use self-check compares it with the
per-token formula.
"""
from __future__ import annotations

import functools
import logging

import torch

from batchgen_data.kernels.cpu import build as cpu_kernels

log = logging.getLogger(__name__)

MAX_TOKENS = 64  # the decode stack's row limit too: every decode step up to 64 sequences


def available() -> bool:
    """Whether `moe_experts` runs here: the kernel built with AVX2/FMA and passed its
    self-check."""
    return _checked()


def moe_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]:
    [T, H] for hidden [T, H], w13 [E, 2I, H], w2 [E, H, I] (fp32, contiguous), topk_ids [T, k]
    int64, topk_weights [T, k] fp32. Call only when `available()`."""
    lib = cpu_kernels.library()
    assert lib is not None
    num_experts, two_i, h = w13.shape
    inter = two_i // 2
    if (hidden.dim() != 2 or hidden.shape[1] != h or two_i % 2 or w2.shape != (num_experts, h, inter)
            or topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape
            or topk_ids.shape[0] != hidden.shape[0]):
        raise ValueError(f"moe_experts: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}, ids {tuple(topk_ids.shape)}, weights "
                         f"{tuple(topk_weights.shape)}")
    if not (hidden.dtype == w13.dtype == w2.dtype == topk_weights.dtype == torch.float32
            and topk_ids.dtype == torch.int64 and w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError(f"moe_experts: fp32 contiguous weights and int64 ids, got "
                         f"{hidden.dtype} / {w13.dtype} / {w2.dtype} / {topk_weights.dtype} / "
                         f"{topk_ids.dtype}")
    hidden, ids, weights = hidden.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
    tokens, top_k = ids.shape
    out = torch.empty_like(hidden)
    work = torch.empty(lib.bg_moe_experts_workspace(tokens, top_k, num_experts, inter),
                       dtype=torch.uint8)
    rc = lib.bg_moe_experts_f32(hidden.data_ptr(), w13.data_ptr(), w2.data_ptr(), ids.data_ptr(),
                                weights.data_ptr(), out.data_ptr(), work.data_ptr(), tokens, top_k,
                                num_experts, h, inter, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"moe_experts: expert id out of [0, {num_experts}) (code {rc})")
    return out


def reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The per-token formula `moe_experts` computes, one token and one choice at a time."""
    out = torch.zeros_like(hidden)
    inter = w13.shape[1] // 2
    for t in range(hidden.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w13[e] @ hidden[t]  # [2I]
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += topk_weights[t, j] * (w2[e] @ act)
    return out


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def _checked() -> bool:
    lib = cpu_kernels.library()
    if lib is None or not lib.bg_moe_experts_supported():
        return False
    gen = torch.Generator().manual_seed(0)
    # odd sizes on purpose: a K tail in both projections and a partial column block
    experts, h, inter, tokens, top_k = 5, 37, 21, 6, 2
    w13 = torch.randn(experts, 2 * inter, h, generator=gen) * h ** -0.5
    w2 = torch.randn(experts, h, inter, generator=gen) * inter ** -0.5
    x = torch.randn(tokens, h, generator=gen)
    ids = torch.randint(0, experts - 1, (tokens, top_k), generator=gen)  # the last one idle
    weights = torch.rand(tokens, top_k, generator=gen)
    ok = torch.allclose(moe_experts(x, w13, w2, weights, ids), reference(x, w13, w2, weights, ids),
                        rtol=1e-4, atol=1e-5)
    if not ok:
        log.warning("the C MoE experts kernel disagrees with the per-token formula; using torch")
    return ok
