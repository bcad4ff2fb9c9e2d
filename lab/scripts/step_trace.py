"""Where a CPU throughput run spends its time: this engine's step times, grouped by batch size.

Runs one workload of `cpu_throughput.py` (same model, prompts and output lengths) through the
engine step by step and prints, per number of running sequences, how many steps ran and how long
they took. The prefill steps (the first few, each up to `--max-num-batched-tokens` tokens) and the
long-tail decode steps show up as separate rows.

    .venv/bin/python lab/scripts/step_trace.py --workload longtail
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),  # lab/: batchgen_lab
                str(Path(__file__).resolve().parents[2] / "benchmarks")]
from _common import OUTPUT_LENGTHS, make_workload  # noqa: E402
from cpu_throughput import (  # noqa: E402
    FIRST_PLAIN_ID, VOCAB_SIZE, default_model_dir, prepare_model_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="longtail", choices=sorted(OUTPUT_LENGTHS))
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from batchgen_data import LLM, SamplingParams

    model_dir = prepare_model_dir(default_model_dir(args.seed), args.seed)
    llm = LLM(model=str(model_dir), dtype="float32", max_num_seqs=args.num_requests,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    eng = llm.engine
    eng.submit([FIRST_PLAIN_ID] * 16, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    while eng.has_unfinished():  # warm-up: thread pools, kernel build, oneDNN primitives
        eng.step()
    reqs = make_workload(args.workload, args.num_requests, args.seed, VOCAB_SIZE, FIRST_PLAIN_ID)
    for r in reqs:
        eng.submit(r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True,
                                                      temperature=0))
    steps: list[tuple[float, int]] = []
    start = time.perf_counter()
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        steps.append((time.perf_counter() - t0, eng.load().running))
    total = time.perf_counter() - start
    by_batch: dict[int, list[float]] = collections.defaultdict(list)
    for dt, n in steps:
        by_batch[n].append(dt)
    print(f"{args.workload}: {len(steps)} steps, {total:.1f} s, "
          f"{sum(r.max_tokens for r in reqs) / total:.1f} tok/s; output lengths "
          f"{sorted(r.max_tokens for r in reqs)}")
    print("running  steps  total_s  mean_ms")
    for n in sorted(by_batch):
        ts = by_batch[n]
        print(f"{n:7d}  {len(ts):5d}  {sum(ts):7.1f}  {sum(ts) / len(ts) * 1e3:7.1f}")
    print(json.dumps({"workload": args.workload, "total_s": round(total, 2), "steps": len(steps),
                      "first_steps_ms": [round(dt * 1e3) for dt, _ in steps[:4]],
                      "by_running": {n: {"steps": len(ts), "total_s": round(sum(ts), 2)}
                                     for n, ts in sorted(by_batch.items())}}))


if __name__ == "__main__":
    main()
