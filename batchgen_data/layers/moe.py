"""Mixture-of-experts layer: a router and E SwiGLU experts run as one batched operation.

`FusedMoE` mirrors HF's sparse MoE blocks (Qwen2/Qwen3-MoE, Mixtral): softmax over the router
logits, the top-k experts of each token, their weights renormalised when `norm_topk_prob`, and
out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])) over the chosen experts e.
The experts' weights are kept stacked in the layout the GPU kernels take (see
docs/moe.md): `w13` [E, 2I, H] (rows 0..I-1 gate_proj, I..2I-1 up_proj) and `w2` [E, H, I].
Qwen2-MoE's shared expert (a dense MLP that every token passes, scaled by a sigmoid gate) is an
optional part of the layer, so the checkpoint's names (`mlp.shared_expert.*`) map one to one.

Which implementation runs is decided once, when the layer is built (`layers.backend`): the Triton
grouped GEMM (`batchgen_data.kernels.fused_moe.fused_experts`) on the Triton backend, else
`cpu_fused_experts`, which sorts the (token, expert) pairs by expert and runs one matmul per
expert that received tokens (`torch._grouped_mm` walks the groups in C++ where torch has it on
the CPU, else a Python loop), so each expert's weights are read once per step however many
sequences sent it tokens. A step of up to `kernels.cpu.moe.MAX_TOKENS` tokens (every decode
step) runs the whole thing in one C call instead where the backend allows it (`c_moe`: fp32,
AVX2). That is where expert-level batching pays: the step's tokens of every
sequence suspended at this layer arrive here as one batch (see `models/moe.py`).

Every call also counts the tokens each expert received (`expert_tokens`, summed until the engine
takes them with `take_expert_tokens`) for the engine's `tokens_per_expert` statistics.

The experts' weights are the layer's own unless they stream from host memory: an `ExpertSource`
given to the layer once, after the build, through `stream_experts_from` (the offload's weight
store, `worker/offload/experts.py`) then hands the layer the routed experts of each step.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch
from torch import nn

from batchgen_data.kernels.cpu import moe as cpu_moe
from batchgen_data.layers import quant
from batchgen_data.layers.activation import SiluAndMul
from batchgen_data.layers.backend import current
from batchgen_data.layers.linear import Linear

# [T] 0/1 per token row while a padded batch runs (CUDA graphs, worker/fast_paths/
# cuda_graphs.py): only rows of weight 1 count towards `expert_tokens`; None: every row counts
_COUNTED_ROWS: ContextVar[torch.Tensor | None] = ContextVar("moe_counted_rows", default=None)


@contextmanager
def counted_rows(rows: torch.Tensor) -> Iterator[None]:
    """While it lasts (a graph's capture and each replay), MoE layers count the tokens of the
    rows `rows` [T] marks 1, reading the tensor itself, so a captured graph reads the marks of
    the step it replays."""
    token = _COUNTED_ROWS.set(rows)
    try:
        yield
    finally:
        _COUNTED_ROWS.reset(token)


# (hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] f32, topk_ids [T, k] i64)
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     torch.Tensor]


class ExpertSource(Protocol):
    """Where a layer's expert weights come from when they are not kept in the layer."""

    def experts_for(self, layer: "FusedMoE", ids: torch.Tensor, counts: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(w13 [n, 2I, H], w2 [n, H, I], ids [T, k] and counts re-indexed to those n) for
        the n experts of `layer` that `ids` routes to, in ascending id order."""
        ...


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing as HF computes it: (weights [T, k] float32, ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _torch_at_least(major: int, minor: int) -> bool:
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    return version >= (major, minor)


# torch._grouped_mm has a CPU kernel from 2.9, which wants 16-byte aligned operands up to 2.10
# (mmap-loaded weights need not be; transformers gates its own use on the same versions)
GROUPED_MM = hasattr(torch, "_grouped_mm") and _torch_at_least(2, 11)


def cpu_fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      act: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      counts: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' output [T, H] for routed tokens: one gate/up and one down matmul per expert
    that received tokens (none per token). `act` maps [n, 2I] to [n, I] (default SiLU(gate) *
    up); `counts` [E], if given, are the tokens per expert (`bincount` of `topk_ids`)."""
    experts = _experts_grouped if GROUPED_MM else _experts_loop
    return experts(hidden, w13, w2, topk_weights, topk_ids, act, counts)


def _sort_pairs(topk_ids: torch.Tensor, num_experts: int, counts: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, token_of, counts): the T*k (token, choice) pairs sorted by expert, tokens in
    order within an expert; the token of each sorted pair; tokens per expert [E]."""
    flat = topk_ids.reshape(-1)  # [T*k]: pair p is token p // k's j-th choice
    order = torch.argsort(flat, stable=True)
    if counts is None:
        counts = torch.bincount(flat, minlength=num_experts)
    return order, order // topk_ids.shape[1], counts


def _combine(hidden: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor,
             order: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
    """sum over each token's pairs of weight * expert output, back in token order [T, H]."""
    weights = topk_weights.reshape(-1).index_select(0, order)  # [T*k] float32
    # HF scales each expert's output by its routing weight (in float32 for Mixtral) before the sum
    scaled = (out.float() * weights[:, None]).to(hidden.dtype)
    return torch.zeros_like(hidden).index_add_(0, token_of, scaled)


def _experts_grouped(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     act: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     counts: torch.Tensor | None = None) -> torch.Tensor:
    """`cpu_fused_experts` as two `torch._grouped_mm` calls: torch walks the experts' token
    groups in C++ (an empty group costs no weight read), so a step pays one dispatch per
    projection instead of two per active expert from Python. Same matmuls, same sums."""
    order, token_of, counts = _sort_pairs(topk_ids, w13.shape[0], counts)
    ends = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] end row of each expert's group
    x = hidden.index_select(0, token_of)  # [T*k, H] each expert's tokens contiguous
    gate_up = torch._grouped_mm(x, w13.transpose(1, 2), offs=ends)  # [T*k, 2I]
    inter = act(gate_up) if act is not None else _silu_mul(gate_up)  # [T*k, I]
    out = torch._grouped_mm(inter, w2.transpose(1, 2), offs=ends)  # [T*k, H]
    return _combine(hidden, out, topk_weights, order, token_of)


def _experts_loop(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  act: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  counts: torch.Tensor | None = None) -> torch.Tensor:
    """`cpu_fused_experts` with a Python loop over the active experts (torch without a CPU
    `_grouped_mm`)."""
    order, token_of, counts = _sort_pairs(topk_ids, w13.shape[0], counts)
    x = hidden.index_select(0, token_of)  # [T*k, H] each expert's tokens contiguous
    out = torch.empty_like(x)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue  # an expert without tokens costs nothing, not even a weight read
        rows = slice(start, start + n)
        gate_up = torch.mm(x[rows], w13[e].t())  # [n, 2I]
        inter = act(gate_up) if act is not None else _silu_mul(gate_up)  # [n, I]
        out[rows] = torch.mm(inter, w2[e].t())  # [n, H]
        start += n
    return _combine(hidden, out, topk_weights, order, token_of)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _triton_experts() -> ExpertsFn:
    try:
        from batchgen_data.kernels.fused_moe import fused_experts
    except ImportError as e:
        raise ImportError("the Triton backend needs batchgen_data.kernels.fused_moe.fused_experts "
                          f"for MoE layers, and it could not be imported ({e})") from e
    return fused_experts


class FusedMoE(nn.Module):
    """Router + `num_experts` SwiGLU experts of width `intermediate` (+ an optional shared
    expert, with a sigmoid gate unless `shared_expert_gated=False`); x [T, H] -> [T, H].
    `router`, when given, replaces softmax top-k routing (the routing hook)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, shared_expert: nn.Module | None = None,
                 router: nn.Module | None = None, shared_expert_gated: bool = True) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k}: must be in [1, num_experts="
                             f"{num_experts}]")
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        # the router (HF's `mlp.gate`): a plain linear map to logits for `route`, or a `router`
        # module that returns (weights [T, k] float32, ids [T, k]) itself (DeepSeek-V3's
        # grouped sigmoid routing, `models/deepseek_v3_router.py`)
        self.gate = router if router is not None else Linear(hidden, num_experts)
        self.custom_router = router is not None
        deferred = quant.weight_device()  # the meta device while the loader decides (quant.py)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden,
                                            device=deferred))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate, device=deferred))
        # quantized experts: `w13`/`w2` hold the codes, `*_scale`/`*_zero` the rest (quant.py)
        self.scheme: quant.QuantScheme | None = None
        self._c_quant = current().c_quant
        self._home, self._dtype = torch.empty(0).device, torch.get_default_dtype()
        self.shared_expert = shared_expert
        # Qwen2-MoE scales its shared expert by a sigmoid gate; DeepSeek-V3 adds it as is
        gated = shared_expert is not None and shared_expert_gated
        self.shared_expert_gate = Linear(hidden, 1) if gated else None
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.long),
                             persistent=False)
        self.triton = current().triton
        # resolved now so that a missing kernel fails when the model is built, not mid-step
        self._gpu_experts: ExpertsFn | None = _triton_experts() if self.triton else None
        # the CPU path reuses the activation kernel the backend picked for the dense MLPs
        self.act = SiluAndMul()
        # a step of up to `MAX_TOKENS` tokens runs all routed experts in one C call
        self._c_experts: ExpertsFn | None = cpu_moe.moe_experts if current().c_moe else None
        # where the expert weights come from when not from `w13` / `w2` (`stream_experts_from`)
        self._source: ExpertSource | None = None

    def stream_experts_from(self, source: ExpertSource) -> None:
        """From now on each step takes its routed experts' weights from `source` (they have left
        `w13` / `w2`: offload's expert streaming); quantized experts cannot stream."""
        if self.scheme is not None:
            raise ValueError("quantized MoE experts do not stream per expert (their scales would "
                             "have to move with the codes)")
        self._source = source

    def use_quant(self, scheme: quant.QuantScheme | None) -> None:
        """Allocates the expert weights deferred at build: stored as `scheme`, or dense."""
        e, i, h = self.num_experts, self.intermediate, self.hidden
        if scheme is None:
            self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, device=self._home, dtype=self._dtype))
            self.w2 = nn.Parameter(torch.empty(e, h, i, device=self._home, dtype=self._dtype))
            return
        self.scheme = scheme
        for leaf, rows, k in (("w13", 2 * i, h), ("w2", h, i)):
            stored = scheme.empty((e, rows), k, self._home)
            for suffix, t in zip(("", "_scale", "_zero"), stored):
                setattr(self, leaf + suffix,
                        None if t is None else nn.Parameter(t, requires_grad=False))

    def load_quant_expert(self, leaf: str, expert: int, start: int, src: quant.QuantWeight,
                          name: str) -> None:
        """Copies one expert's quantized matrix into rows [start, ...) of `leaf` (w13/w2)."""
        if self.scheme is None:
            raise ValueError(f"checkpoint weight {name!r} is quantized but its experts are not")
        src.check(name, self.scheme, self.hidden if leaf == "w13" else self.intermediate)
        if src.perm is not None:
            raise ValueError(f"checkpoint weight {name!r}: experts in GPTQ act order (g_idx) "
                             "are not supported")
        zero = getattr(self, leaf + "_zero")
        quant.fill_rows((getattr(self, leaf).data[expert],
                         getattr(self, leaf + "_scale").data[expert],
                         None if zero is None else zero.data[expert]), start, src)

    def _quant_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       counts: torch.Tensor) -> torch.Tensor:
        """The routed experts on quantized weights: per expert that received tokens, its two
        base matmuls on the stored codes (`quant.quant_matmul`), as `cpu_fused_experts`."""
        order, token_of, counts = _sort_pairs(ids, self.num_experts, counts)
        xs = x.index_select(0, token_of)  # [T*k, H] each expert's tokens contiguous
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            rows = slice(start, start + n)
            gate_up = quant.quant_matmul(xs[rows], self.w13[e], self.w13_scale[e],
                                         None if self.w13_zero is None else self.w13_zero[e],
                                         self.scheme, self._c_quant, self.triton)  # [n, 2I]
            inter = self.act(gate_up)  # [n, I]
            out[rows] = quant.quant_matmul(inter, self.w2[e], self.w2_scale[e],
                                           None if self.w2_zero is None else self.w2_zero[e],
                                           self.scheme, self._c_quant, self.triton)  # [n, H]
            start += n
        return _combine(x, out, weights, order, token_of)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, H] holds this step's tokens of every scheduled sequence (each one a coroutine
        # suspended at its model call): here they meet as one batch per expert
        if self.custom_router:
            weights, ids = self.gate(x)  # [T, k] each
        else:
            weights, ids = route(self.gate(x), self.top_k, self.norm_topk_prob)
        rows = _COUNTED_ROWS.get()  # a CUDA graph's padding rows are run, not counted
        if self.scheme is not None:
            counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
            self._count(ids, counts, rows)
            out = self._quant_experts(x, weights, ids, counts)
        elif self._gpu_experts is not None:
            self._count(ids, None, rows)
            w13, w2, ids, _ = self.experts_for(ids, None)
            out = self._gpu_experts(x, w13, w2, weights, ids)
        else:
            counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
            self._count(ids, counts, rows)
            w13, w2, ids, counts = self.experts_for(ids, counts)
            # the kernel reads the stacked weights in place: contiguous ones only
            if (self._c_experts is not None and x.shape[0] <= cpu_moe.MAX_TOKENS
                    and w13.is_contiguous() and w2.is_contiguous()):
                out = self._c_experts(x, w13, w2, weights, ids)
            else:
                out = cpu_fused_experts(x, w13, w2, weights, ids, self.act, counts)
        if self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))  # [T, 1]
            out = out + gate * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out

    def _count(self, ids: torch.Tensor, counts: torch.Tensor | None,
               rows: torch.Tensor | None) -> None:
        """Add a step's tokens per expert to `expert_tokens`: `counts` as computed, or (None, or
        with `rows`, a [T] 0/1 weight per token) a fixed-size scatter that a CUDA graph can
        capture (no host sync, no shape that depends on the data)."""
        if counts is not None and rows is None:
            self.expert_tokens += counts
            return
        flat = ids.reshape(-1)
        t, k = ids.shape
        weight = torch.ones_like(flat) if rows is None else \
            rows[:t].to(flat.dtype).unsqueeze(1).expand(t, k).reshape(-1)
        self.expert_tokens.index_add_(0, flat, weight)

    def experts_for(self, ids: torch.Tensor, counts: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(w13, w2, ids, counts) to compute this step's experts with: the layer's own weights,
        or, when they stream (`stream_experts_from`), only the experts `ids` [T, k] routes to,
        from the source, with `ids` and `counts` re-indexed to them."""
        if self._source is None:
            return self.w13, self.w2, ids, counts
        return self._source.experts_for(self, ids, counts)

    def take_expert_tokens(self) -> torch.Tensor:
        """Tokens each expert received since the last call ([E] int64), and a fresh count."""
        counts = self.expert_tokens.clone()
        self.expert_tokens.zero_()
        return counts

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"norm_topk_prob={self.norm_topk_prob}, custom_router={self.custom_router}, "
                f"triton={self.triton}")
