"""Fused-MoE kernel benchmark: `fused_experts` against the per-expert torch loop, per batch size.

At decode sizes an MoE layer is memory bound: each step reads the weights of every expert that
got a token, and with 128 experts and top-8 nearly all of them do from ~16 tokens on. So the
figure of merit there is achieved bandwidth (bytes of the active experts' weights / time); at
prefill sizes it is compute (2 * 3 * pairs * H * I flops / time). Shapes default to one layer
of Qwen3-30B-A3B (H 2048, I 768, 128 experts, top-8), routing uniform at random.

    python benchmarks/moe_kernel_bench.py [--dtype bfloat16] [--tokens 1,16,64,256,1024,8192]
    TRITON_INTERPRET=1 python benchmarks/moe_kernel_bench.py --quick   # CPU smoke run

Prints a table, then one JSON object per row (``"bench": "fused_moe"``). Also checks the kernel
against the reference on every shape it times (``max_abs_err``).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_report  # noqa: E402

COLUMNS = ["tokens", "pairs_per_expert", "ours_ms", "torch_ms", "speedup", "weights_gbs",
           "tflops", "max_abs_err"]


def _time_ms(fn: Callable[[], object], warmup: int, iters: int, cuda: bool) -> float:
    """Median milliseconds of `fn` (CUDA events on a GPU, wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from batchgen_data.kernels import fused_experts, reference

    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device=device, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=device, generator=gen) / i**0.5).to(dtype)
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        x = torch.randn(t, h, device=device, generator=gen).to(dtype)
        scores = torch.rand(t, e, device=device, generator=gen)
        weights, ids = torch.softmax(scores, -1).topk(k, -1)
        weights = (weights / weights.sum(-1, keepdim=True)).float()
        ours = _time_ms(lambda: fused_experts(x, w13, w2, weights, ids), args.warmup,
                        args.iters, cuda)
        ref = _time_ms(lambda: reference.fused_experts(x, w13, w2, weights, ids), 1,
                       max(1, args.iters // 4), cuda)
        err = (fused_experts(x, w13, w2, weights, ids).float()
               - reference.fused_experts(x, w13, w2, weights, ids).float()).abs().max().item()
        active = int(torch.unique(ids).numel())
        weight_bytes = active * 3 * h * i * w13.element_size()
        flops = 2 * 3 * t * k * h * i
        rows.append({"bench": "fused_moe", "device": str(device), "dtype": args.dtype,
                     "tokens": t, "pairs_per_expert": round(t * k / e, 1),
                     "ours_ms": round(ours, 4), "torch_ms": round(ref, 4),
                     "speedup": round(ref / ours, 2), "active_experts": active,
                     "weights_gbs": round(weight_bytes / ours / 1e6, 1),
                     "tflops": round(flops / ours / 1e9, 2), "max_abs_err": round(err, 5)})
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes on the CPU (set TRITON_INTERPRET=1)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", default="1,16,64,256,1024,8192")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if args.quick:
        args.dtype, args.tokens, args.experts, args.hidden, args.inter, args.top_k = (
            "float32", "3,40", 8, 32, 16, 2)
        args.warmup, args.iters = 0, 1
    return args


def main(argv: list[str] | None = None) -> int:
    rows = measure(parse_args(argv))
    print_report(rows, COLUMNS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
