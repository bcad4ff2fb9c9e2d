"""One decode step through the one-call CPU decode stack against the per-layer path, side by side.

Same model as `cpu_throughput.py` (SmolLM2-135M shape, fp32, random weights). For each number of
sequences it fills the engine with that many prompts of `--context` tokens, builds one
pure-decode step and times, interleaved in one process, the model forward layer by layer
(`model(...)`, what a step ran before) and through `CpuDecodeStack.run` (one C call for all
layers). Both write the same KV slots; the script checks that hidden states and KV are bitwise
equal, then prints medians and the ratio per row count, and a JSON line.

    .venv/bin/python lab/scripts/decode_step_ab.py --rows 1,4,5,8,16,32
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),  # lab/: batchgen_lab
                str(Path(__file__).resolve().parents[2] / "benchmarks")]
from _common import schedule_decode  # noqa: E402
from cpu_throughput import FIRST_PLAIN_ID, VOCAB_SIZE, default_model_dir, prepare_model_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,5,8,16,32", help="sequences per decode step")
    ap.add_argument("--context", type=int, default=450, help="prompt tokens per sequence")
    ap.add_argument("--repeat", type=int, default=15, help="timed steps per path and row count")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from batchgen_data import LLM, SamplingParams

    model_dir = prepare_model_dir(default_model_dir(args.seed), args.seed)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for rows in rows_list:
        llm = LLM(model=str(model_dir), dtype="float32", max_num_seqs=rows,
                  max_num_batched_tokens=2048, enable_prefix_caching=False)
        eng, runner = llm.engine, llm.engine.runner
        if runner.cpu_stack is None:
            sys.exit("the CPU decode stack is not available here (no C kernels, AVX-512 or fp32)")
        rng = random.Random(rows)
        for _ in range(rows):
            eng.submit([rng.randrange(FIRST_PLAIN_ID, VOCAB_SIZE) for _ in range(args.context)],
                       SamplingParams(max_tokens=64, ignore_eos=True, temperature=0))
        inp = runner.prepare(schedule_decode(eng))
        assert inp.meta.num_decodes == rows
        model, stack = runner.model, runner.cpu_stack
        with torch.inference_mode():
            kv0 = runner.kv.clone()
            a = stack.run(inp)
            kv_a = runner.kv.clone()
            runner.kv.copy_(kv0)
            b = model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)
            equal = bool(torch.equal(a, b) and torch.equal(kv_a, runner.kv))
            t_stack, t_layers = [], []
            for i in range(args.repeat):  # interleaved, alternating which goes first
                pair = [(t_stack, lambda: stack.run(inp)),
                        (t_layers, lambda: model(inp.input_ids, inp.positions, runner.kv_caches,
                                                 inp.meta))]
                for out, fn in (pair if i % 2 == 0 else pair[::-1]):
                    t0 = time.perf_counter()
                    fn()
                    out.append(time.perf_counter() - t0)
        ms_s, ms_l = statistics.median(t_stack) * 1e3, statistics.median(t_layers) * 1e3
        results.append({"rows": rows, "context": args.context, "stack_ms": round(ms_s, 2),
                        "per_layer_ms": round(ms_l, 2), "speedup": round(ms_l / ms_s, 3),
                        "bitwise_equal": equal})
        del llm, eng, runner
    print("rows  per_layer_ms  stack_ms  speedup  bitwise_equal")
    for r in results:
        print(f"{r['rows']:4d}  {r['per_layer_ms']:12.2f}  {r['stack_ms']:8.2f}  "
              f"{r['speedup']:7.3f}  {r['bitwise_equal']}")
    print(json.dumps({"threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
