"""Interleaved A/B of the CPU MoE decode step: the C kernels on against torch, in one engine.

One engine of `moe_throughput.py`'s model (random Qwen3-MoE shape: 8 layers, hidden 512, 32
experts of 256, top-4, tied 49k vocabulary, fp32) decodes B sequences; each decode step runs
under one arm, the arms taking turns step by step (the order rotated each round), so a machine
whose load changes slows every arm alike. Arms:
  torch    experts on torch's grouped matmuls, the tied head through F.linear (MKL)
  experts  the one-call C experts kernel (`kernels/cpu/moe.py`), head on F.linear
  head     the AVX2 row kernel for the tied head (`rows_linear`), experts on torch
  c        both kernels (the engine's default on an AVX2 CPU)
Steps grow each sequence's KV by one token, the same for every arm. Reported per B: median wall
and process CPU time per step, the spread (p10-p90 of wall), and each arm's speed-up over
`torch` (ratio of medians).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python lab/scripts/moe_decode_ab.py --batches 1,8,16,32

Prints a table, then one JSON line.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),  # lab/: batchgen_lab
                str(Path(__file__).resolve().parents[2] / "benchmarks")]
from _common import make_workload, step_until_decode  # noqa: E402
from batchgen_lab.ab import interleaved_steps  # noqa: E402
from cpu_throughput import FIRST_PLAIN_ID, VOCAB_SIZE  # noqa: E402
from moe_throughput import moe_model_dir, print_step_records, step_bench_parser  # noqa: E402

ARMS = {"torch": (False, False), "experts": (True, False), "head": (False, True), "c": (True, True)}


def set_arm(model, experts: bool, head: bool) -> None:  # type: ignore[no-untyped-def]
    from batchgen_data.kernels.cpu import moe as cpu_moe

    for layer in model.moe_layers:
        layer._c_experts = cpu_moe.moe_experts if experts else None
    model.embed_tokens.c_rows = head


def run_batch(model_dir: Path, batch: int, rounds: int, seed: int) -> list[dict]:
    from batchgen_data import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", max_num_seqs=batch,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    eng, model = llm.engine, llm.engine.runner.model
    if not (model.embed_tokens.c_rows and all(l._c_experts for l in model.moe_layers)):
        raise SystemExit("the C kernels are off here (no compiler, no AVX2, or AVX-512 panels)")
    for r in make_workload("uniform", batch, seed, VOCAB_SIZE, FIRST_PLAIN_ID):
        eng.submit(r.prompt_token_ids, SamplingParams(max_tokens=rounds * len(ARMS) + 8,
                                                      ignore_eos=True, temperature=0))
    step_until_decode(eng)
    return interleaved_steps(eng.step, lambda name: set_arm(model, *ARMS[name]), list(ARMS),
                             rounds, batch, base="torch")


def main(argv: list[str] | None = None) -> None:
    args = step_bench_parser(__doc__).parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = moe_model_dir(args.seed)
    records = []
    for batch in (int(b) for b in args.batches.split(",")):
        records += run_batch(model_dir, batch, args.rounds, args.seed)
        print(f"B={batch} done", file=sys.stderr, flush=True)
    print_step_records("moe_decode_ab", records, ["batch", "arm", "wall_ms", "p10_ms", "p90_ms",
                                                  "cpu_ms", "speedup"],
                       threads=args.threads, rounds=args.rounds)

if __name__ == "__main__":
    main()
