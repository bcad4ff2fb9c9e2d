"""A/B of the CPU expert path on fixed shapes: what one step's MoE layers cost, per strategy.

The shapes are those of `moe_throughput.py` (hidden 512, 32 experts of width 256, top-4, 8 MoE
layers, fp32). Each layer gets its own random weights, so a pass over the layers streams the
experts' weights from memory as a decode step does (8 x 48 MiB; they do not fit a cache), and
its own fixed random routing. For each token count (1..32 are decode steps of that many
sequences, 256 and 2048 prefill chunks) the strategies run interleaved in one process, the
order rotated every repeat, so a machine whose load changes slows them alike; the figures are
medians of wall time and of process CPU time (all threads) per pass over the layers.

Strategies (checked against the first one; all but `c` are exact: same fp32 products and sums):
  loop     one `torch.mm` pair per expert with tokens, a Python loop (`_experts_loop`)
  grouped  `torch._grouped_mm` over the experts' token groups, one call per projection
           (`_experts_grouped`; torch >= 2.9 has it on the CPU)
  c        the C kernel (`kernels/cpu/moe.py`: buckets, gate/up + SiLU * up, down and the
           weighted sum in one call; AVX2/FMA); it sums in another order, so it matches to
           float rounding, not bit for bit
  padded   every expert's group padded to the largest and one `torch.bmm` per projection over
           all experts (reads idle experts' weights too; here for comparison only)
(Also tried and dropped: the grouped call with the operands swapped, W_e @ x^T per group, which
BLAS runs as a weight-streaming kernel for a single matrix at 2-4 rows: 0.5-0.9x here.)

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python lab/scripts/moe_step_ab.py
    .venv/bin/python lab/scripts/moe_step_ab.py --tokens 4,32 --repeat 5 --threads 1

Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),  # lab/: batchgen_lab
                str(Path(__file__).resolve().parents[2] / "benchmarks")]
from _common import format_table  # noqa: E402

from batchgen_data.kernels.cpu import moe as cpu_moe  # noqa: E402
from batchgen_data.layers import moe  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 512, 256, 32, 4
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                   torch.Tensor]


def padded_bmm(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Each expert's tokens in a [E, n_max, H] block (zero rows for padding), one bmm per
    projection over all experts; padding rows are computed and dropped."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0])
    n_max = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    sorted_ids = flat[order]
    slot = sorted_ids * n_max + (torch.arange(flat.numel()) - starts[sorted_ids])  # row in block
    token_of = order // top_k
    block = hidden.new_zeros(w13.shape[0] * n_max, hidden.shape[1])
    block[slot] = hidden[token_of]
    gate_up = torch.bmm(block.view(w13.shape[0], n_max, -1), w13.transpose(1, 2))
    gate, up = gate_up.chunk(2, dim=-1)
    down = torch.bmm(torch.nn.functional.silu(gate) * up, w2.transpose(1, 2))
    rows = down.reshape(-1, hidden.shape[1])[slot]
    scaled = rows * topk_weights.reshape(-1)[order][:, None]
    return torch.zeros_like(hidden).index_add_(0, token_of, scaled)


def strategies() -> dict[str, Experts]:
    found: dict[str, Experts] = {"loop": moe._experts_loop}
    if moe.GROUPED_MM:
        found["grouped"] = moe._experts_grouped
    if cpu_moe.available():
        found["c"] = cpu_moe.moe_experts
    found["padded"] = padded_bmm
    return found


def make_layers(num_layers: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(w13, w2, router) per layer, scaled so the activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * HIDDEN ** -0.5,
             torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * INTER ** -0.5,
             torch.randn(EXPERTS, HIDDEN, generator=g)) for _ in range(num_layers)]


def run_pass(fn: Experts, x: torch.Tensor, layers: list, routes: list) -> torch.Tensor:
    """One step's worth of MoE layers, each fed the same x (the sum is kept so that nothing
    is optimised away and outputs can be compared)."""
    total = torch.zeros_like(x)
    for (w13, w2, _), (weights, ids) in zip(layers, routes):
        total += fn(x, w13, w2, weights, ids)
    return total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,8,16,32,256,2048", help="tokens per step (comma list)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=9, help="timed passes per strategy and size")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers = make_layers(args.layers, args.seed)
    fns = strategies()
    records = []
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            g = torch.Generator().manual_seed(args.seed + tokens)
            x = torch.randn(tokens, HIDDEN, generator=g)
            routes = [moe.route(x @ router.t(), TOP_K, True) for _, _, router in layers]
            outs = {name: run_pass(fn, x, layers, routes) for name, fn in fns.items()}  # warm-up
            ref = outs["loop"]
            wall: dict[str, list[float]] = {n: [] for n in fns}
            cpu: dict[str, list[float]] = {n: [] for n in fns}
            names = list(fns)
            for rep in range(args.repeat):
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    c0, w0 = time.process_time(), time.perf_counter()
                    run_pass(fns[name], x, layers, routes)
                    wall[name].append(time.perf_counter() - w0)
                    cpu[name].append(time.process_time() - c0)
            base_wall, base_cpu = statistics.median(wall["loop"]), statistics.median(cpu["loop"])
            for name in names:
                w, c = statistics.median(wall[name]), statistics.median(cpu[name])
                records.append({
                    "tokens": tokens, "strategy": name, "wall_ms": round(w * 1e3, 2),
                    "cpu_ms": round(c * 1e3, 2), "speedup_wall": round(base_wall / w, 3),
                    "speedup_cpu": round(base_cpu / c, 3),
                    "max_abs_diff": float((outs[name] - ref).abs().max()),
                    "bitwise_equal": bool(torch.equal(outs[name], ref))})
            print(f"tokens={tokens} done", file=sys.stderr, flush=True)
    print(format_table(records, ["tokens", "strategy", "wall_ms", "cpu_ms", "speedup_wall",
                                 "speedup_cpu", "max_abs_diff", "bitwise_equal"]))
    print(json.dumps({"benchmark": "moe_step_ab", "threads": args.threads, "layers": args.layers,
                      "shape": {"hidden": HIDDEN, "intermediate": INTER, "experts": EXPERTS,
                                "top_k": TOP_K}, "repeat": args.repeat, "records": records}))


if __name__ == "__main__":
    main()
