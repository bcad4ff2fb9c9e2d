"""Decode-attention bandwidth benchmark: how close does paged decode get to a plain device copy?

Decode attention is memory bound: every step reads each sequence's whole K and V once. So the
figure of merit is achieved bandwidth (KV bytes read / kernel time) against what the device
reaches on a large ``Tensor.copy_`` (read + write bytes / time). CUDA only.

    python benchmarks/kernel_bench.py [--dtype float16] [--heads 32 --kv-heads 8 --head-dim 128]

Prints a table, then one JSON object per row (machine-readable, ``"bench": "decode_attention"``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch

# (batch, context length) rows: single long sequence, mid batches, a large short-context batch.
_SHAPES = [(1, 8192), (8, 4096), (32, 2048), (64, 1024), (128, 512), (256, 2048)]


def _time_ms(fn: Callable[[], object], warmup: int, iters: int, inner: int = 20) -> float:
    """Median milliseconds of one ``fn`` call over ``iters`` CUDA-event timings of ``inner``
    calls replayed from one CUDA graph. One launch timed alone measures the launch as much as
    the kernel (a few microseconds, which is all of a small shape's time), and ``inner`` calls
    launched one by one can still starve the device of work; a graph replays them back to
    back. Where capture fails, the ``inner`` calls are launched in a row instead."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # captured on a side stream of its own
            for _ in range(inner):
                fn()
        torch.cuda.synchronize()
        run: Callable[[], object] = graph.replay
    except RuntimeError:
        def run() -> None:
            for _ in range(inner):
                fn()
    run()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int, warmup: int, iters: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), warmup, iters)
    return 2 * nbytes / ms / 1e6  # read + write


def _paged_inputs(batch: int, context: int, args: argparse.Namespace, dtype: torch.dtype):
    """Caches holding exactly ``batch * context`` tokens, blocks shuffled across sequences."""
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device="cuda")
    v_cache = torch.randn(shape, dtype=dtype, device="cuda")
    perm = torch.randperm(num_blocks, device="cuda", dtype=torch.int64)
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, args.heads, args.head_dim, dtype=dtype, device="cuda")
    return q, k_cache, v_cache, block_tables, seq_lens


def _check_correctness(args: argparse.Namespace, dtype: torch.dtype) -> None:
    from batchgen_data.kernels import paged_decode_attention, reference

    q, k_cache, v_cache, tables, lens = _paged_inputs(3, 777, args, dtype)
    lens[1] = 1
    scale = args.head_dim**-0.5
    for splits in (1, 4):
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=splits)
        expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> list[dict]:
    """Check the kernel against the reference, then time every shape; one record per shape."""
    from batchgen_data.kernels import paged_decode_attention
    from batchgen_data.kernels._attention_checks import pick_num_splits

    dtype = getattr(torch, args.dtype)
    _check_correctness(args, dtype)
    copy_gbs = copy_bandwidth_gbs(1 << 30, args.warmup, args.iters)
    device = torch.device("cuda")
    rows = []
    for batch, context in _SHAPES:
        q, k_cache, v_cache, tables, lens = _paged_inputs(batch, context, args, dtype)
        ms = _time_ms(
            lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, args.head_dim**-0.5),
            args.warmup, args.iters,
        )
        kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * k_cache.element_size()
        gbs = kv_bytes / ms / 1e6
        rows.append({
            "bench": "decode_attention", "device": torch.cuda.get_device_name(),
            "dtype": args.dtype, "batch": batch, "context": context, "heads": args.heads,
            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "block_size": args.block_size,
            "num_splits": pick_num_splits(None, batch * args.kv_heads, tables.shape[1] *
                                          args.block_size, device),
            "time_us": round(ms * 1e3, 2), "kv_bytes": kv_bytes, "achieved_gbs": round(gbs, 1),
            "copy_gbs": round(copy_gbs, 1), "fraction_of_copy": round(gbs / copy_gbs, 3),
        })
        del q, k_cache, v_cache, tables, lens
    return rows


def print_rows(rows: list[dict]) -> None:
    r0 = rows[0]
    print(f"copy_ bandwidth: {r0['copy_gbs']:.1f} GB/s ({r0['device']}, {r0['dtype']})")
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'time_us':>10} {'KV MB':>9} "
          f"{'GB/s':>8} {'% copy':>7}")
    for r in rows:
        print(f"{r['batch']:>6} {r['context']:>8} {r['num_splits']:>6} {r['time_us']:>10.1f} "
              f"{r['kv_bytes'] / 1e6:>9.1f} {r['achieved_gbs']:>8.1f} "
              f"{100 * r['fraction_of_copy']:>6.1f}%")
    for r in rows:
        print(json.dumps(r))


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_bench: no CUDA device found; this benchmark measures GPU bandwidth only")
    print_rows(measure(args))


if __name__ == "__main__":
    main()
