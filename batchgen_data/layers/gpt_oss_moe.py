"""gpt-oss's mixture of experts (HF `GptOssMLP`): a biased router, top-k softmax, and experts whose
SwiGLU is clamped and scaled, with biases, their weights in MXFP4 as the checkpoint stores them.

Per token: logits = router(x) (with bias); the top-k logits' softmax weights the chosen experts
(the same weights as a full softmax renormalised over the top k). Per expert e:
  g, u = (x W13_e^T + b13_e) split into gate and up
  h = (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'),  g' = min(g, limit)
  y_e = h W2_e^T + b2_e
The checkpoint interleaves gate and up rows (gate the even ones); they are put in two halves
once, after loading (`process_weights_after_loading`), so the activation reads two slices.

The experts stay MXFP4 (`layers/mxfp4.py`); each step runs one pair of matmuls per expert that
received tokens, over all of that expert's tokens from every sequence of the step (the expert-level
batching of `models/moe.py`), decoded in the Triton kernel or, on the CPU, one expert at a time.
A CUDA graph cannot hold that (its shapes follow the routing), so a forward being captured runs
every expert over every token instead, weighted by zero where it was not chosen. Every call
counts the tokens each expert received (`expert_tokens`), as `FusedMoE` does.
"""
from __future__ import annotations

import torch
from torch import nn

from batchgen_data.layers import mxfp4
from batchgen_data.layers.backend import current
from batchgen_data.layers.linear import Linear
from batchgen_data.layers.moe import _COUNTED_ROWS


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[n, 2I] (gate | up halves) -> [n, I], gpt-oss's activation."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Mxfp4Experts(nn.Module):
    """`mlp.experts` of a gpt-oss layer: the checkpoint's tensors under their names
    (`gate_up_proj_blocks` / `_scales` / `_bias`, `down_proj_*`)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int) -> None:
        super().__init__()
        for k in (hidden, intermediate):
            if k % mxfp4.BLOCK:
                raise ValueError(f"gpt-oss MXFP4 experts: width {k} is not a multiple of "
                                 f"{mxfp4.BLOCK}")
        e, i, h = num_experts, intermediate, hidden
        self.hidden, self.intermediate, self.num_experts = h, i, e

        def codes(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)

        # [E, rows, K / 32, 16] and [E, rows, K / 32], as stored
        self.gate_up_proj_blocks = codes(e, 2 * i, h // mxfp4.BLOCK, mxfp4.BLOCK // 2)
        self.gate_up_proj_scales = codes(e, 2 * i, h // mxfp4.BLOCK)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
        self.down_proj_blocks = codes(e, h, i // mxfp4.BLOCK, mxfp4.BLOCK // 2)
        self.down_proj_scales = codes(e, h, i // mxfp4.BLOCK)
        self.down_proj_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Blocks flattened to [E, rows, K / 2]; gate|up rows from interleaved to two halves."""
        e, i = self.num_experts, self.intermediate
        halves = torch.cat([torch.arange(0, 2 * i, 2), torch.arange(1, 2 * i, 2)])
        blocks = self.gate_up_proj_blocks.data.reshape(e, 2 * i, -1)
        self.gate_up_proj_blocks = nn.Parameter(blocks[:, halves].contiguous(),
                                                requires_grad=False)
        self.gate_up_proj_scales = nn.Parameter(
            self.gate_up_proj_scales.data[:, halves].contiguous(), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(
            self.gate_up_proj_bias.data[:, halves].contiguous(), requires_grad=False)
        self.down_proj_blocks = nn.Parameter(
            self.down_proj_blocks.data.reshape(e, self.hidden, -1).contiguous(),
            requires_grad=False)


class GptOssMoE(nn.Module):
    """`mlp` of a gpt-oss layer: `router` (Linear with bias) and `experts`; x [T, H] -> [T, H]."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 alpha: float, limit: float) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k}: must be in [1, num_local_experts="
                             f"{num_experts}]")
        self.num_experts, self.top_k, self.alpha, self.limit = num_experts, top_k, alpha, limit
        self.router = Linear(hidden, num_experts, bias=True)
        self.experts = Mxfp4Experts(hidden, intermediate, num_experts)
        self.triton = current().triton
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.long),
                             persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, ids [T, k]): softmax over each token's top-k logits."""
        logits = self.router(x)  # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        self._count(ids)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.all_experts(x, weights, ids)  # a CUDA graph's capture
        return self.routed_experts(x, weights, ids)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e over the rows x [n, H] -> [n, H]."""
        ex = self.experts
        gate_up = mxfp4.linear(x, ex.gate_up_proj_blocks[e], ex.gate_up_proj_scales[e],
                               ex.gate_up_proj_bias[e], self.triton)  # [n, 2I]
        h = clamped_swiglu(gate_up, self.alpha, self.limit)  # [n, I]
        return mxfp4.linear(h, ex.down_proj_blocks[e], ex.down_proj_scales[e],
                            ex.down_proj_bias[e], self.triton)  # [n, H]

    def routed_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                       ) -> torch.Tensor:
        """Each expert that received tokens over those tokens alone (one host read of the
        counts per step)."""
        flat = ids.reshape(-1)  # pair p is token p // k's choice p % k
        counts = torch.bincount(flat, minlength=self.num_experts)
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        xs = x.index_select(0, token_of)  # [T*k, H] each expert's tokens contiguous
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue  # an expert without tokens is never decoded
            out[start:start + n] = self._expert(e, xs[start:start + n])
            start += n
        scaled = (out.float() * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, scaled)

    def all_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                    ) -> torch.Tensor:
        """Every expert over every token, weighted by its routing weight (0 where it was not
        chosen): no host read and no shape that depends on the routing, so a CUDA graph can
        hold it, at E / k times the routed path's products."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.num_experts):
            w = (weights * (ids == e)).sum(dim=-1)  # [T] float32
            out += w[:, None] * self._expert(e, x).float()
        return out.to(x.dtype)

    def _count(self, ids: torch.Tensor) -> None:
        """Add the step's tokens per expert to `expert_tokens` with a fixed-size scatter (no
        host read); a CUDA graph's padding rows (`moe.counted_rows`) do not count."""
        flat = ids.reshape(-1)
        t, k = ids.shape
        rows = _COUNTED_ROWS.get()
        weight = torch.ones_like(flat) if rows is None else \
            rows[:t].to(flat.dtype).unsqueeze(1).expand(t, k).reshape(-1)
        self.expert_tokens.index_add_(0, flat, weight)

    def take_expert_tokens(self) -> torch.Tensor:
        """Tokens each expert received since the last call ([E] int64), and a fresh count."""
        counts = self.expert_tokens.clone()
        self.expert_tokens.zero_()
        return counts
