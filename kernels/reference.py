"""Plain-PyTorch references for every kernel in this package.

Each function has the same name, signature and semantics as its Triton launcher (including which
arguments are updated in place), so tests can compare the two and CPU code paths can call these
directly. They run on any device and float dtype, compute in float32 and cast back at the end.
Clarity over speed: attention loops over sequences in Python.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[T, 2*I] -> [T, I]``: ``silu(gate) * up`` with gate the first half."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``[..., N]``: ``x / sqrt(mean(x**2) + eps) * weight``, new tensor of x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x``; ``x = rms_norm(residual)``. Returns ``(x, residual)``."""
    total = x.float() + residual.float()
    residual.copy_(total.to(residual.dtype))
    x.copy_(rms_norm(total, weight, eps).to(x.dtype))
    return x, residual


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place NeoX-style rotary on the first ``R = cos_sin_cache.shape[1]`` dims of q and k."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions].float()  # [T, R]
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]  # [T, 1, R/2]
    for x in (q, k):
        x1 = x[..., :half].float()
        x2 = x[..., half : 2 * half].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x[..., : 2 * half] = rotated.to(x.dtype)
    return q, k


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """In place: ``cache.view(-1, Hkv, D)[slot_mapping[t]] = k[t]`` for every slot != -1; an
    FP8 cache takes ``fp8_codes(k[t], k_scale)``."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if k_cache.dtype == torch.float8_e4m3fn:
        k, v = fp8_codes(k, k_scale), fp8_codes(v, v_scale)
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def fp8_codes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3 codes of ``x / scale``: x times the fp32 reciprocal, clamped to +-448, rounded to
    nearest even (the FP8 KV cache's rounding, `batchgen_data/layers/kv_quant.py`)."""
    inv = float(torch.tensor(1.0 / scale, dtype=torch.float32))
    return (x.float() * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int,
               scale: float = 1.0) -> torch.Tensor:
    """The first ``length`` tokens of one sequence: ``[length, Hkv, D]`` in float32 (an FP8
    cache's codes times `scale`)."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    slots = block_table.long()[pos // block_size] * block_size + pos % block_size
    rows = cache.view(-1, *cache.shape[2:])[slots].float()
    return rows * scale if cache.dtype == torch.float8_e4m3fn else rows


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor, sinks: torch.Tensor | None = None,
            softcap: float | None = None) -> torch.Tensor:
    """q ``[M, H, D]``, k/v ``[N, Hkv, D]``, mask ``[M, N]`` (True = attend) -> ``[M, H, D]``.
    ``sinks`` ``[H]``: one more logit per head in each softmax, with no value behind it;
    ``softcap``: each score s becomes softcap * tanh(s / softcap) first."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with nothing to attend -> 0
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("hmn,nhd->mhd", probs, v)


def _in_window(q_pos: torch.Tensor, length: int, sliding_window: int | None) -> torch.Tensor:
    """[M, N]: key n is seen by the query at ``q_pos[m]`` (causal, and within the last
    ``sliding_window`` positions, itself included, when a window is given)."""
    keys = torch.arange(length, device=q_pos.device)[None, :]
    mask = keys <= q_pos[:, None]
    if sliding_window:
        mask &= keys > q_pos[:, None] - sliding_window
    return mask


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q ``[S, H, D]`` attends to its ``seq_lens[i]`` cached tokens (the last
    ``sliding_window`` of them when given) -> ``[S, H, D]``; ``sinks`` ``[H]`` float32: a
    logit per head added to each softmax with no value (gpt-oss's attention sinks);
    ``softcap``: scores soft-capped (Gemma 2).

    ``num_splits`` is accepted for signature parity and ignored.
    """
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i, length in enumerate(seq_lens.tolist()):
        k = _gather_kv(k_cache, block_tables[i], length, k_scale)
        v = _gather_kv(v_cache, block_tables[i], length, v_scale)
        q_pos = torch.tensor([length - 1], device=q.device)
        mask = _in_window(q_pos, length, sliding_window)
        out[i] = _attend(q[i : i + 1], k, v, scale, mask, sinks, softcap)[0]
    return out.to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal varlen attention; q rows of sequence i are its last ``q_len`` tokens -> ``[T, H, D]``.
    ``sliding_window`` / ``sinks`` / ``softcap``: as `paged_decode_attention`.

    ``max_seqlen_q`` is accepted for signature parity and ignored.
    """
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens_q.tolist()
    for i, length in enumerate(seq_lens.tolist()):
        start, end = bounds[i], bounds[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = _gather_kv(k_cache, block_tables[i], length, k_scale)
        v = _gather_kv(v_cache, block_tables[i], length, v_scale)
        q_pos = torch.arange(length - q_len, length, device=q.device)
        mask = _in_window(q_pos, length, sliding_window)  # [q_len, N]
        out[start:end] = _attend(q[start:end], k, v, scale, mask, sinks, softcap)
    return out.to(q.dtype)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routed pairs grouped by expert, each group padded to ``block_size`` with ``T * k``.

    Returns ``(sorted_token_ids [P], expert_ids [ceil(P / block_size)], total [1])`` in int32,
    ``P = numel + min(E, numel) * (block_size - 1)``; ids outside ``[0, E)`` are left out.
    """
    ids = topk_ids.reshape(-1).long()
    numel = ids.numel()
    padded_len = numel + min(num_experts, numel) * (block_size - 1)
    sorted_ids = torch.full((padded_len,), numel, dtype=torch.int32, device=ids.device)
    expert_ids = torch.full((-(-padded_len // block_size),), -1, dtype=torch.int32,
                            device=ids.device)
    pos = 0
    for e in range(num_experts):
        pairs = (ids == e).nonzero().flatten()  # ascending: token order kept
        if pairs.numel() == 0:
            continue
        sorted_ids[pos : pos + pairs.numel()] = pairs.int()
        blocks = -(-pairs.numel() // block_size)
        expert_ids[pos // block_size : pos // block_size + blocks] = e
        pos += blocks * block_size
    return sorted_ids, expert_ids, torch.tensor([pos], dtype=torch.int32, device=ids.device)


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``[T, H]``: ``sum_j topk_weights[t, j] * w2[e] @ (silu(gate) * up)`` with
    ``gate, up = w13[e] @ hidden[t]`` split in halves and ``e = topk_ids[t, j]``; one matmul
    per expert over its pairs, in float32, the activations rounded to hidden's dtype as the
    kernel stores them."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    flat = topk_ids.reshape(-1)
    for e in range(w13.shape[0]):
        pairs = (flat == e).nonzero().flatten()
        if pairs.numel() == 0:
            continue
        tokens = pairs // top_k
        act = silu_and_mul(hidden[tokens].float() @ w13[e].float().t()).to(hidden.dtype)
        down = act.float() @ w2[e].float().t()  # [pairs, H]
        out.index_add_(0, tokens, down * topk_weights.reshape(-1)[pairs, None].float())
    return out.to(hidden.dtype)


_U64 = (1 << 64) - 1


def _splitmix(z: int) -> int:
    """splitmix64's finaliser on a Python int (exact uint64 arithmetic)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def race_candidates(
    vals: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
    top_p: torch.Tensor | None, min_p: torch.Tensor | None, seeds: torch.Tensor,
    steps: torch.Tensor, total: torch.Tensor | None, ranked: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row by row: scaled logits ``s = vals / T``; top-k by position; top-p keeps a
    candidate while the mass before it (``exp(s - s_max)`` over ``total``, or over the
    top-k candidates) is below top_p; min-p drops ``exp(s - s_max) < min_p``; the race
    ``s - log(-log u)`` with ``u`` the splitmix64 hash of (seed, step, token), Python ints;
    the best, ties to the lower id. Returns (token, best, settled) like the launcher."""
    golden = 0x9E3779B97F4A7C15
    n, c = vals.shape
    tokens, bests, settled = [], [], []
    for r in range(n):
        t = float(temperature.reshape(-1)[r])
        s = vals[r].float() / t
        keep = s > float("-inf")
        if ranked:
            keep &= torch.arange(c, device=vals.device) < int(top_k.reshape(-1)[r])
        top = s[0] if ranked else s.max()
        e = torch.exp(s - top)
        done = True
        if top_p is not None:
            p_cut = float(top_p.reshape(-1)[r])
            mass = e[keep].sum() if total is None else total.reshape(-1)[r]
            probs = torch.where(keep, e, torch.zeros_like(e)) / mass
            cum = probs.cumsum(0)
            done = bool(cum[-1] >= p_cut) or p_cut >= 1
            nucleus = (cum - probs < p_cut) | (p_cut >= 1)
            nucleus[0] = True
            keep &= nucleus
        if min_p is not None:
            keep &= ~(e < float(min_p.reshape(-1)[r]))
        key = (int(seeds[r]) * 0x2545F4914F6CDD1D + golden) & _U64
        key = _splitmix((_splitmix(key) + int(steps[r]) * golden) & _U64)
        u = torch.tensor([(_splitmix((int(i) * golden + key) & _U64) >> 40)
                          for i in ids[r].tolist()], dtype=torch.float32, device=vals.device)
        u = ((u + 0.5) * (1.0 / (1 << 24))).clamp(max=1.0 - 2.0**-24)
        race = torch.where(keep, s - torch.log(-torch.log(u)),
                           torch.full_like(s, float("-inf")))
        best = race.max()
        tokens.append(int(ids[r][race == best].min()))
        bests.append(float(best))
        settled.append(done)
    dev = vals.device
    return (torch.tensor(tokens, dtype=torch.int64, device=dev),
            torch.tensor(bests, dtype=torch.float32, device=dev),
            torch.tensor(settled, dtype=torch.bool, device=dev))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_idx: torch.Tensor,
                seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_seg_len: int
                ) -> torch.Tensor:
    """``h [N, R]``: ``h[i] = x[token_idx[i]] @ a[slot]^T`` for the segment holding i."""
    h = torch.empty((token_idx.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    starts = seg_starts.tolist()
    for s, slot in enumerate(seg_slots.tolist()):
        rows = token_idx[starts[s]:starts[s + 1]].long()
        h[starts[s]:starts[s + 1]] = x[rows].float() @ a[slot].float().T
    return h.to(x.dtype)


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, token_idx: torch.Tensor,
                seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_seg_len: int
                ) -> torch.Tensor:
    """In place: ``y[token_idx[i]] += h[i] @ b[slot]^T``; returns y."""
    starts = seg_starts.tolist()
    for s, slot in enumerate(seg_slots.tolist()):
        rows = token_idx[starts[s]:starts[s + 1]].long()
        delta = h[starts[s]:starts[s + 1]].float() @ b[slot].float().T
        y[rows] = (y[rows].float() + delta).to(y.dtype)
    return y


# the quantized matmuls' references live in reference_quant.py; this module names every reference
from batchgen_data.kernels.reference_quant import (  # noqa: E402,F401
    DEFAULT_ZERO,
    FP4_E2M1,
    MXFP4_BLOCK,
    QUANT_KINDS,
    dequantize,
    fp8_block_matmul,
    fp8_block_matmul_quantized,
    mxfp4_dequantize,
    mxfp4_linear,
    per_token_group_quant_fp8,
    quant_codes,
    quant_linear,
)
