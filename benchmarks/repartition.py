"""What a re-partition costs on this machine, measured on the real engine: two one-device
engines (`EngineGroup`, engine/group/group.py) join into one tensor_parallel_size=2 engine mid-job
and split back, with `--seqs` live sequences of `--prompt-len` tokens each; and what a decode
step of that tail costs before the join, after it, and after the split.

The model is tp_step.py's random Llama shape (~150M parameters, fp32, written once to
`--cache`). Each repeat starts a fresh group (rank 0 here, the other engine a process it
starts, `--threads` per engine), submits the sequences (spread over both engines), steps
until every one decodes, times `--steps` decode steps, joins (`EngineGroup.repartition`),
times as many steps of the wide engine, splits (`EngineGroup.split`) and times the steps
again. A switch's seconds come from its `SwitchReport` (export of every live sequence with
its KV, the model group, the in-memory weight reshard: the slowest rank's, the import), so
the table gives each phase and the whole switch, seconds per GB of weights resharded and of
KV moved, and `wide_step_ratio` (the wide engine's step over the separate engines' step), the
two figures `PartitionPolicy` takes (`switch_s`, `wide_step_ratio`). The tokens of every
sequence are compared with a run of the same rows on one engine without any switch.

    .venv/bin/python benchmarks/repartition.py
    .venv/bin/python benchmarks/repartition.py --seqs 4 --prompt-len 256 --repeats 3

On a 2-core box the two engines share the host's cores and memory bandwidth: the step ratio
here says little about a multi-GPU node; the switch's phases (copies, a reshard in memory,
gloo collectives) are what this box can measure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, wait_for_quiet  # noqa: E402
from tp_step import TINY, model_dir  # noqa: E402


def _prompt(i: int, prompt_len: int) -> list[int]:
    return [(7 * i + j) % 290 + 5 for j in range(prompt_len)]


def _timed_steps(group: Any, steps: int, outs: dict[str, list[int]]) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        got = group.step()
        times.append(time.perf_counter() - t0)
        for o in got:
            outs[o.request_id] = list(o.outputs[0].token_ids)
    return times


def reference(path: Path, args: argparse.Namespace, max_tokens: int) -> list[list[int]]:
    """The rows' greedy tokens on one engine, no switch (the oracle of the switched run)."""
    from batchgen_data import SamplingParams
    from batchgen_data.engine.engine import Engine

    engine = Engine.from_kwargs(str(path), num_threads=args.threads, device=args.device,
                                enable_prefix_caching=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.submit(_prompt(i, args.prompt_len), params) for i in range(args.seqs)]
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = list(o.outputs[0].token_ids)
    return [outs[i] for i in ids]


def one_repeat(path: Path, args: argparse.Namespace, max_tokens: int) -> dict[str, Any]:
    from batchgen_data import SamplingParams
    from batchgen_data.engine.group.group import EngineGroup

    t0 = time.perf_counter()
    group = EngineGroup.from_kwargs(str(path), size=2, policy=None, num_threads=args.threads,
                                    device=args.device, enable_prefix_caching=False,
                                    collective_timeout_s=300.0)
    start_s = time.perf_counter() - t0
    outs: dict[str, list[int]] = {}
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = [group.submit(_prompt(i, args.prompt_len), params) for i in range(args.seqs)]
        _timed_steps(group, 4, outs)  # prefill and warm-up
        narrow = _timed_steps(group, args.steps, outs)
        join = group.repartition()
        _timed_steps(group, 2, outs)  # the first wide step writes the imported KV
        wide = _timed_steps(group, args.steps, outs)
        split = group.split()
        _timed_steps(group, 2, outs)
        after = _timed_steps(group, args.steps, outs)
        while group.has_unfinished():
            _timed_steps(group, 1, outs)
    finally:
        group.close()
    return {"ids": ids, "outs": outs, "start_s": start_s, "join": join, "split": split,
            "narrow_ms": statistics.median(narrow) * 1e3, "wide_ms": statistics.median(wide) * 1e3,
            "after_ms": statistics.median(after) * 1e3}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=4, help="live sequences at the switch")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed in each layout")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/batchgen-bench"))
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke runs)")
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="seconds to wait for the load average to fall under 1 first")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    path = model_dir(args.cache, TINY, "tp-step-llama-tiny") if args.tiny else model_dir(args.cache)
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    max_tokens = 3 * args.steps + 16
    want = reference(path, args, max_tokens)
    load = wait_for_quiet(args.wait_quiet) if args.wait_quiet else os.getloadavg()[0]
    runs = [one_repeat(path, args, max_tokens) for _ in range(args.repeats)]
    # greedy tokens against the run without switches: at TP=2 the sums run in another order,
    # so a near-tie of this random model's flat logits may flip a token (the tests check the
    # switch token for token on models where HF is the oracle: tests/integration/test_partition.py)
    same = sum([r["outs"][i] for i in r["ids"]] == want for r in runs)

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    records = []
    for name in ("join", "split"):
        reps = [r[name] for r in runs]
        kv = med([s.kv_bytes for s in reps])
        total = [s.total_s for s in reps]
        records.append({
            "switch": name, "seqs": reps[0].seqs, "kv_bytes": int(kv), "kv_mb": round(kv / 1e6, 1),
            "export_s": round(med([s.export_s for s in reps]), 3),
            "group_s": round(med([s.group_s for s in reps]), 3),
            "reshard_s": round(med([s.reshard_s for s in reps]), 3),
            "import_s": round(med([s.import_s for s in reps]), 3),
            "total_s": round(med(total), 3),
            "total_range_s": f"{min(total):.3f}-{max(total):.3f}",
            "reshard_s_per_gb_weights": round(med([s.reshard_s for s in reps]) / (weights / 1e9), 2),
            "export_s_per_gb_kv": round(med([s.export_s for s in reps]) / (kv / 1e9), 2) if kv else None})
    steps = {k: [round(r[k], 2) for r in runs] for k in ("narrow_ms", "wide_ms", "after_ms")}
    ratio = med([r["wide_ms"] / r["narrow_ms"] for r in runs])
    print(f"{args.seqs} sequences of {args.prompt_len} prompt tokens, weights "
          f"{weights / 1e9:.2f} GB (fp32), {args.threads} thread(s) per engine, {args.repeats} "
          f"repeats, load {load:.1f} at start; repeats whose tokens equal a run without switches: "
          f"{same} of {len(runs)}")
    print(format_table(records, list(records[0])))
    print(f"decode step of the tail, median ms over the repeats: two engines "
          f"{med(steps['narrow_ms']):.2f} {steps['narrow_ms']}, joined (TP=2) "
          f"{med(steps['wide_ms']):.2f} {steps['wide_ms']}, split again "
          f"{med(steps['after_ms']):.2f} {steps['after_ms']}; wide_step_ratio {ratio:.3f}; "
          f"group start {med([r['start_s'] for r in runs]):.1f} s")
    result = {"bench": "repartition", "seqs": args.seqs, "prompt_len": args.prompt_len,
              "threads": args.threads, "repeats": args.repeats, "load": round(load, 2),
              "weights_bytes": weights, "tokens_equal": same, "switches": records,
              "step_ms": steps, "wide_step_ratio": round(ratio, 3),
              "switch_s": {r["switch"]: r["total_s"] for r in records},
              "start_s_all": [round(r["start_s"], 2) for r in runs]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
