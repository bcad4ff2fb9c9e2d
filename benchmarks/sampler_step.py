"""Time one sampler call (SamplingBatch.build + the sampling kernels): the random draws against
greedy, and the cost of each sampling field.

Two modes:

* ``--mode draws`` (the default): the four settings of issue 35 — greedy, temperature 0.8,
  temperature 0.8 + top_p 0.95, temperature 0.7 + top_k 50 + top_p 0.9 — at 256 rows x 151,936
  vocabulary (Qwen's). The settings are timed round-robin (one call of each per round), so a
  neighbour's load falls on all of them alike; the table shows each setting's median, min and
  max over the rounds and its ratio to greedy (the median of the per-round ratios, with their
  spread). Goals (CPU): temperature-only <= 3x greedy, top_p <= 4x greedy; on a GPU every
  setting <= 0.3 ms a call.
  ``--baseline DIR`` first runs the same measurement on another source tree (e.g. a
  ``git archive`` of an older commit: the package is imported from DIR) and prints both.
* ``--mode features``: one field set on every row (logit_bias, allowed_token_ids, bad_words,
  random draws with top-k or top-p, penalties) per row count; a checkout without a field skips
  its rows.

Logits are random, [rows, vocab] float32 of std 5 by default (peaked like a language model's);
``--logit-std 0.5`` gives flat rows (a random model's, or a broad distribution at a high
temperature), whose top-p nucleus is most of the vocabulary. No model runs.

    .venv/bin/python benchmarks/sampler_step.py --rounds 15
    .venv/bin/python benchmarks/sampler_step.py --mode features --rows 64,256,1024 --vocab 49152
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, print_report, wait_for_quiet  # noqa: E402

from batchgen_data.sample.sampler import Sampler  # noqa: E402
from batchgen_data.core.sequence import Sequence  # noqa: E402
from batchgen_data.sampling_params import SamplingParams  # noqa: E402


class _Tokenizer:
    """Stand-in for bad_words: one id per character (no model or tokenizer files needed)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 1000 for c in text]


DRAWS = {
    "greedy": {"temperature": 0},
    "temperature 0.8": {"temperature": 0.8},
    "temperature 0.8, top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "temperature 0.7, top_k 50, top_p 0.9": {"temperature": 0.7, "top_k": 50, "top_p": 0.9},
}
GOALS = {"temperature 0.8": 3.0, "temperature 0.8, top_p 0.95": 4.0}  # x greedy, CPU
GPU_GOAL_MS = 0.3  # every setting, 256 rows, on the H200 (issue 35)

FEATURES = {
    "plain": {},
    "logit_bias": {"logit_bias": {i: 0.5 for i in range(0, 2000, 100)}},
    "allowed_token_ids": {"allowed_token_ids": list(range(10, 30))},
    "bad_words": {"bad_words": ["no", "never", " x"]},
    # random draws (sample/draw/token_draw.py) and the penalties, on every row
    "random": {"temperature": 1.0},
    "top_k": {"temperature": 1.0, "top_k": 50},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
    "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.2},
}


LOGIT_STD = 5.0  # --logit-std


def _call(rows: int, vocab: int, device: torch.device, extra: dict):
    """A no-argument function that runs one sampler call on fixed logits, synchronously."""
    params = SamplingParams(**{"temperature": 0, "max_tokens": 512, **extra})
    seqs = [Sequence(i, f"r{i}", 0, [1, 2, 3], params, seed=i, max_tokens=512,
                     token_ids=[1, 2, 3] + [5] * 40) for i in range(rows)]
    sampler = Sampler({2}, _Tokenizer()) if "bad_words" in extra else Sampler({2})
    gen = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=gen) * LOGIT_STD).to(device)

    def run() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sampler(logits, seqs)  # ends in .tolist(): synchronous
        return time.perf_counter() - t0
    return run


def time_step(rows: int, vocab: int, device: torch.device, extra: dict, repeats: int) -> float:
    run = _call(rows, vocab, device, extra)
    times = [run() for _ in range(repeats + 3)]
    return statistics.median(times[3:])


def measure_draws(rows: int, vocab: int, device: torch.device, rounds: int) -> list[dict]:
    runs = {name: _call(rows, vocab, device, extra) for name, extra in DRAWS.items()}
    for run in runs.values():  # warm-up: first-call set-up, allocator
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(run())
    records = []
    for name, ts in times.items():
        ratios = [t / g for t, g in zip(ts, times["greedy"])]
        ratio = statistics.median(ratios)
        records.append({
            "setting": name, "rows": rows, "vocab": vocab, "device": device.type,
            "median_ms": round(statistics.median(ts) * 1e3, 2),
            "min_ms": round(min(ts) * 1e3, 2), "max_ms": round(max(ts) * 1e3, 2),
            "vs_greedy": round(ratio, 2),
            "vs_greedy_min": round(min(ratios), 2), "vs_greedy_max": round(max(ratios), 2),
        })
        if device.type == "cpu":  # goals: a ratio to greedy on the CPU, milliseconds on a GPU
            goal = GOALS.get(name)
            records[-1].update(goal=goal, goal_met=None if goal is None else ratio <= goal)
        else:
            records[-1].update(goal=f"<= {GPU_GOAL_MS} ms",
                               goal_met=statistics.median(ts) * 1e3 <= GPU_GOAL_MS)
    return records


def _baseline(src: str, args: argparse.Namespace) -> list[dict]:
    """The draws measured with the package imported from another source tree."""
    cmd = [sys.executable, __file__, "--mode", "draws", "--json-only", "--rounds",
           str(args.rounds), "--rows", str(args.rows), "--vocab", str(args.vocab),
           "--device", args.device, "--logit-std", str(args.logit_std)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["results"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["draws", "features"], default="draws")
    ap.add_argument("--rows", default=None, help="draws: one count (256); features: a list")
    ap.add_argument("--vocab", type=int, default=None, help="draws: 151936; features: 49152")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=15, help="draws: rounds over the settings")
    ap.add_argument("--repeats", type=int, default=30, help="features: calls per row")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--baseline", default=None, help="draws: a source tree to measure first")
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="wait up to this many seconds for a load average under 1")
    ap.add_argument("--logit-std", type=float, default=5.0,
                    help="std of the random logits (5: peaked; 0.5: flat rows)")
    ap.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global LOGIT_STD
    LOGIT_STD = args.logit_std
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    load = wait_for_quiet(args.wait_quiet) if args.wait_quiet else os.getloadavg()[0]
    if args.mode == "features":
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        records = []
        for rows in (int(r) for r in (args.rows or "64,256,1024").split(",")):
            for name, extra in FEATURES.items():
                if not set(extra) <= known:
                    continue
                s = time_step(rows, args.vocab or 49152, device, extra, args.repeats)
                records.append({"feature": name, "rows": rows, "step_ms": round(s * 1e3, 3),
                                "device": args.device, "vocab": args.vocab or 49152})
        print_report(records, ["feature", "rows", "step_ms", "device"])
        print(json.dumps({"bench": "sampler_step", "results": records}))
        return
    args.rows, args.vocab = int(args.rows or 256), args.vocab or 151936
    base = _baseline(args.baseline, args) if args.baseline else []
    records = measure_draws(args.rows, args.vocab, device, args.rounds)
    for rec in base:
        rec["tree"] = "baseline"
    for rec in records:
        rec["tree"] = "this"
    if not args.json_only:
        print(f"{args.rows} rows x {args.vocab} vocabulary, logits of std {LOGIT_STD}, "
              f"{args.device}, "
              f"{torch.get_num_threads()} threads, {args.rounds} rounds, load {load:.2f}")
        print(format_table(base + records, ["tree", "setting", "median_ms", "min_ms", "max_ms",
                                            "vs_greedy", "vs_greedy_min", "vs_greedy_max",
                                            "goal", "goal_met"]))
    print(json.dumps({"bench": "sampler_step", "mode": "draws", "load": round(load, 2),
                      "logit_std": LOGIT_STD,
                      "threads": torch.get_num_threads(), "results": base + records}))


if __name__ == "__main__":
    main()
