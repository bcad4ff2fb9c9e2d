"""Host time of one engine step: the real engine around a model that costs nothing.

The model's forward is a stub (`_stub_parts.py`) that returns fixed logits at once, so a step's
wall time is what the host spends around the model: scheduling, preparing the inputs
(`ModelRunner.prepare`), sampling (`Sampler`), and the rest of `Engine.step` (coroutine resumes,
stop checks, prefix-cache publication, finished rows, stats). Two workloads at each count of
running sequences:

* ``decode``: every sequence decodes one token per step (nothing joins or leaves);
* ``mixed``: sequences of 16-47 output tokens, so about 1/32 of them finish each step and as
  many new rows (64-token prompts) join in the same step.

The vocabulary is small (``--vocab``, 32): the sampler's math over the logits is device work on
a GPU, and at 151,936 ids it would be most of a CPU step; at 32 ids what ``sample_ms`` measures
is the host's part (the per-row sampling batch, the launches, the token list).

Each arm then runs again with the stub sleeping a fixed device time (``--device-ms``, 2 ms),
which a GPU step would take: ``wall_ms`` against ``device_ms`` shows how much host time the
device waits for (``exposed_ms``, the step's wall time minus its device time).

Per arm, after a warm-up to steady state, ``--steps`` steps are timed one by one, by the wall
clock (``wall_ms``, ``host_ms`` = wall - device) and by the engine thread's CPU time (``cpu_ms``,
split into the phases; on a loaded box the wall clock also counts the time the thread waited for
a core, the CPU time does not). The table has each figure's median over the steps, the JSON also
the 10th and 90th percentiles of ``host_ms`` and ``cpu_ms``. The goals are read on ``cpu_ms``. ``--baseline DIR`` also measures
another source tree (e.g. a ``git archive`` of main, imported from DIR), each pair of arms just
before this tree's, and ``cpu_vs_baseline`` is its CPU time over this tree's.

    .venv/bin/python benchmarks/host_overhead.py
    .venv/bin/python benchmarks/host_overhead.py --seqs 256 --workloads decode --steps 500
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, step_until_decode, wait_for_quiet  # noqa: E402
from _stub_parts import StubModel, build_parts  # noqa: E402

from batchgen_data.config import engine_kwarg_names, make_engine_config  # noqa: E402
from batchgen_data.engine.engine import Engine  # noqa: E402
from batchgen_data.sampling_params import SamplingParams  # noqa: E402

PROMPT_LEN = 64
MIXED_LENGTHS = (16, 32)  # output lengths lo .. lo + span - 1: 1/span of the rows leave a step
PHASES = ("schedule", "prepare", "sample", "rest")  # thread CPU time
STATS = ("wall", "device", "host", "cpu", *PHASES)
GOALS_MS = {("decode", 256): 0.4, ("decode", 1024): 1.2}  # host ms per decode step
ASYNC_GOAL_MS = 2.1  # wall ms per overlapped step with a 2 ms device step


class PhaseClock:
    """CPU seconds of the engine's thread in the engine's parts, by phase, summed over the
    steps it watches (thread CPU time: what a neighbour's load does not inflate). With
    `async_scheduling` the sampler's device part (`launch`) runs on the device thread: not
    counted."""

    def __init__(self, engine: Engine) -> None:
        self.total = dict.fromkeys(PHASES[:-1], 0.0)
        self.scheduled = 0  # sequences scheduled, summed over steps
        self.model: StubModel = engine.runner.model  # type: ignore[assignment]
        self.thread = threading.get_ident()
        schedule = self._timed("schedule", engine.scheduler.schedule)

        def counted() -> Any:
            out = schedule()
            self.scheduled += len(out.seqs)
            return out
        engine.scheduler.schedule = counted  # type: ignore[method-assign]
        engine.runner.prepare = self._timed("prepare", engine.runner.prepare)
        sampler: Any = engine.sampler
        if hasattr(sampler, "sample"):  # the sampler in parts (engine/stepper.py)
            parts = ("batch", "launch", "finish") if hasattr(sampler, "launch") \
                else ("batch", "sample")  # an older tree's two halves
            for part in parts:
                setattr(sampler, part, self._timed("sample", getattr(sampler, part)))
        else:
            engine.sampler = self._timed("sample", sampler)

    def _timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.thread:
                return fn(*args, **kwargs)
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[phase] += time.thread_time() - t0
        return run

    def snapshot(self) -> dict[str, float]:
        return {**self.total, "device": self.model.device_time_s, "running": self.scheduled}


@functools.lru_cache(maxsize=None)
def _params(max_tokens: int, sampled: bool) -> SamplingParams:
    """One object per setting, shared by the requests that use it, as `LLM.generate(prompts,
    params)` and a connector's rows without overrides share theirs."""
    extra = {"temperature": 0.8, "top_p": 0.95} if sampled else {"temperature": 0.0}
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra)


def _prompt(i: int, vocab: int) -> list[int]:
    """Ids in [1, vocab) (0 is EOS); the first three spell i, so no two prompts share a block."""
    base = vocab - 1
    head = [1 + i // base ** k % base for k in range(3)]
    return head + [1 + (i + j) % base for j in range(PROMPT_LEN - 3)]


def build_engine(workload: str, seqs: int, steps: int, vocab: int, device_ms: float,
                 sampled: bool, overlapped: bool = False) -> Engine:
    lo, span = MIXED_LENGTHS
    total_steps = 2 * (lo + span) + steps  # warm-up, then the measured steps
    if workload == "decode":
        max_len = PROMPT_LEN + total_steps + 8
        blocks = seqs * -(-max_len // 16) + 16
    else:
        max_len = PROMPT_LEN + lo + span + 8
        blocks = 2 * seqs * -(-max_len // 16) + 16
    config = make_engine_config(
        f"stub?vocab={vocab}&device_ms={device_ms}",
        max_num_seqs=seqs, max_num_batched_tokens=max(8192, seqs * (PROMPT_LEN + 1)),
        max_model_len=max_len, num_kv_blocks=blocks, enable_prefix_caching=True, seed=0,
        **({"async_scheduling": True} if overlapped else {}))
    engine = Engine(config, build_parts(config))  # the real engine around the stub's parts
    if workload == "decode":
        for i in range(seqs):
            engine.submit(_prompt(i, vocab), _params(total_steps + 4, sampled))
    else:
        joins = -(-seqs // span) + 1
        for i in range(seqs + joins * total_steps):
            engine.submit(_prompt(i, vocab), _params(lo + i % span, sampled))
    return engine


def measure(workload: str, seqs: int, steps: int, vocab: int, device_ms: float,
            sampled: bool, overlapped: bool = False) -> dict[str, Any]:
    lo, span = MIXED_LENGTHS
    engine = build_engine(workload, seqs, steps, vocab, device_ms, sampled, overlapped)
    step_until_decode(engine)
    for _ in range(2 * (lo + span) if workload == "mixed" else 8):  # warm-up: steady state
        engine.step()
    clock = PhaseClock(engine)
    samples: dict[str, list[float]] = {k: [] for k in STATS}
    running = 0
    for _ in range(steps):
        before, t0, c0 = clock.snapshot(), time.perf_counter(), time.thread_time()
        engine.step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        after = clock.snapshot()
        ms = {k: (after[k] - before[k]) * 1e3 for k in ("device", *PHASES[:-1])}
        ms["wall"], ms["cpu"] = wall * 1e3, cpu * 1e3
        ms["host"] = ms["wall"] - ms["device"]
        ms["rest"] = ms["cpu"] - sum(ms[p] for p in PHASES[:-1])
        running += after["running"] - before["running"]
        for k, v in ms.items():
            samples[k].append(v)
    rec: dict[str, Any] = {"workload": workload, "seqs": seqs, "sleep_ms": device_ms,
                           "scheduling": "async" if overlapped else "sync",
                           "sampling": "temperature 0.8, top_p 0.95" if sampled else "greedy",
                           "running": round(running / steps, 1), "steps": steps}
    for key, vals in samples.items():  # medians over the steps: robust to a neighbour's load
        rec[f"{key}_ms"] = round(statistics.median(vals), 3)
    for key in ("host", "cpu"):
        rec[f"{key}_ms_p10_p90"] = [round(q, 3) for q in _deciles(samples[key])]
    rec["exposed_ms"] = rec["host_ms"] if device_ms else None
    if overlapped:  # the goal of overlapped steps: the wall time of a step near the device's
        goal, got = ASYNC_GOAL_MS, rec["wall_ms"]
    else:
        goal, got = (None, None) if device_ms else (GOALS_MS.get((workload, seqs)), rec["cpu_ms"])
    rec["goal_ms"] = goal
    rec["goal_met"] = None if goal is None else got <= goal
    return rec


def _deciles(vals: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(vals, n=10)
    return q[0], q[-1]


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every arm; with ``--baseline`` each (seqs, workload) pair is measured on the baseline
    tree just before this one, so a neighbour's load falls on both alike."""
    records = []
    for seqs in args.seqs.split(","):
        for workload in args.workloads.split(","):
            if args.baseline:
                for rec in _baseline(args.baseline, args, seqs, workload):
                    records.append({**rec, "tree": "baseline"})
            for device_ms, overlapped in _arms(args.device_ms):
                rec = measure(workload, int(seqs), args.steps, args.vocab, device_ms,
                              args.sampled, overlapped)
                base = next((r for r in records if r["tree"] == "baseline"
                             and (r["workload"], r["seqs"], r["sleep_ms"], r["scheduling"]) ==
                             (workload, int(seqs), device_ms, rec["scheduling"])), None)
                rec["cpu_vs_baseline"] = (round(base["cpu_ms"] / rec["cpu_ms"], 2)
                                          if base is not None else None)
                records.append({**rec, "tree": "this"})
    return records


def _arms(device_ms: float) -> list[tuple[float, bool]]:
    """(stub device ms, overlapped) of each arm: host time alone, then under a device step
    synchronous and, where this tree has it, with `async_scheduling`."""
    if not device_ms:
        return [(0.0, False)]
    overlap = "async_scheduling" in engine_kwarg_names()
    return [(0.0, False), (device_ms, False)] + ([(device_ms, True)] if overlap else [])


def _baseline(src: str, args: argparse.Namespace, seqs: str, workload: str
              ) -> list[dict[str, Any]]:
    """The arms of one (seqs, workload) pair with the package imported from another tree."""
    cmd = [sys.executable, __file__, "--json-only", "--seqs", seqs, "--workloads", workload,
           "--steps", str(args.steps), "--vocab", str(args.vocab), "--device-ms",
           str(args.device_ms), "--threads", str(args.threads)]
    if args.sampled:
        cmd.append("--sampled")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["results"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="64,256,1024", help="running sequences, a list")
    ap.add_argument("--workloads", default="decode,mixed")
    ap.add_argument("--steps", type=int, default=200, help="measured steps per arm")
    ap.add_argument("--vocab", type=int, default=32)
    ap.add_argument("--device-ms", type=float, default=2.0,
                    help="the stub's device time of the second run of each arm (0: none)")
    ap.add_argument("--sampled", action="store_true", help="temperature 0.8, top_p 0.95")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--baseline", default=None,
                    help="a source tree (e.g. a git archive of main) to measure alongside")
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="wait up to this many seconds for a load average under 1")
    ap.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = wait_for_quiet(args.wait_quiet) if args.wait_quiet else os.getloadavg()[0]
    records = run_all(args)
    load_end = os.getloadavg()[0]
    if not args.json_only:
        print(f"vocab {args.vocab}, {args.threads} thread(s), {args.steps} steps an arm, "
              f"load {load:.2f} -> {load_end:.2f}; ms per step (medians), phases in CPU ms")
        print(format_table(records, [
            "tree", "workload", "seqs", "scheduling", "sleep_ms", "device_ms", "wall_ms", "host_ms",
            "cpu_ms", *(f"{p}_ms" for p in PHASES), "exposed_ms", "cpu_vs_baseline",
            "goal_ms", "goal_met"]))
    print(json.dumps({"bench": "host_overhead", "vocab": args.vocab, "threads": args.threads,
                      "load": [round(load, 2), round(load_end, 2)],
                      "sampling": "temperature 0.8, top_p 0.95" if args.sampled else "greedy",
                      "results": records}))


if __name__ == "__main__":
    main()
