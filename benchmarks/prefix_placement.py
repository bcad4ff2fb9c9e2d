"""Placement by prefix across engines: prefill tokens computed, prefix-cache hit rate and batch
completion time under four routings, against one engine's ideal (issue 55).

    python benchmarks/prefix_placement.py --model tiny                 # a tiny random Llama
    python benchmarks/prefix_placement.py --model default --docs 16 --questions 8

Workloads, rows shuffled:
  document  D documents of `doc_tokens` tokens with Q questions each (a question: 16 tokens)
  fewshot   8 task prefixes of `doc_tokens` tokens with `fewshot_rows` rows each
Arms (2 and 4 engines by default):
  default   Ray Data's routing: batches of `batch_size` rows cut in input order, each to the
            engine that frees first (one with room for a batch in its window)
  grouping  rows sorted by their prefix hash before batches are cut (`prefix_grouping=True`)
  affinity  each dispatched batch's rows placed by the coordinator's policy
            (`placement.assign` over the engines' `prefix_summary()` and loads)
  both      grouping and affinity

How it runs: A engines in this one process. The engine whose clock is earliest among those with
work steps next, and its clock advances by that step's measured wall time, as if each engine had
a device of its own; completion time is the latest clock. An engine takes a batch while the rows
of the batches it took that are still running, wherever they run, leave room for one in its
window (`window_batches`), as a Ray task stays in flight until its rows come home. Late
binding's moves take no time here (on Ray a queued row moves within two report intervals, and
rows an engine has started stay), so the affinity arms are what the policy gives when it acts
at once: the Ray run is the real test.
Prefill tokens are the tokens computed less the decode steps' one token per output after the
first; the ideal is one engine whose cache holds every prefix, each computed once
(`ideal_prefill`). Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import format_table, parse_key_values  # noqa: E402

ARMS = ("default", "grouping", "affinity", "both")
QUESTION_TOKENS = 16
COLUMNS = ["workload", "engines", "arm", "prefill_tokens", "vs_ideal", "hit_rate",
           "completion_s", "speedup", "max_rows_share"]


def tiny_model(max_len: int) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_model, build_tokenizer

    path = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    tok = build_tokenizer(path)
    build_tiny_model("llama", path, vocab_size=len(tok), max_position_embeddings=max_len)
    return str(path)


def workload(kind: str, args: argparse.Namespace, vocab: int, seed: int
             ) -> list[tuple[int, list[int]]]:
    """(group, prompt token ids) rows, shuffled; a group is a document or a task prefix."""
    rng = random.Random(seed)
    groups, per = (args.docs, args.questions) if kind == "document" else (8, args.fewshot_rows)
    rows = []
    for g in range(groups):
        prefix = [rng.randrange(10, vocab) for _ in range(args.doc_tokens)]
        rows += [(g, prefix + [rng.randrange(10, vocab) for _ in range(QUESTION_TOKENS)])
                 for _ in range(per)]
    rng.shuffle(rows)
    return rows


def ideal_prefill(rows: list[tuple[int, list[int]]], prefix_tokens: int, block_size: int) -> int:
    """One engine whose cache holds every prefix: each group's first row computes its whole
    prompt, the others only what lies past the prefix's full blocks (the last prompt token is
    always computed)."""
    seen: set[int] = set()
    total = 0
    for group, toks in rows:
        if group in seen:
            total += len(toks) - min(prefix_tokens, len(toks) - 1) // block_size * block_size
        else:
            seen.add(group)
            total += len(toks)
    return total


def run_arm(engines: list[Any], rows: list[tuple[int, list[int]]], arm: str,
            args: argparse.Namespace) -> dict[str, Any]:
    from batchgen_data.connectors.ray.grouping import leading_text, prefix_hash
    from batchgen_data.placement import AffinityConfig, RowPrefix, assign, prefix_keys
    from batchgen_data.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    if arm in ("grouping", "both"):  # the pre-stage's key: a hash of the leading text
        rows = sorted(rows, key=lambda r: prefix_hash(
            leading_text({"prompt_token_ids": r[1]}, 512)))
    batches = [rows[i:i + args.batch_size] for i in range(0, len(rows), args.batch_size)]
    window = args.window_batches * args.batch_size
    ids = [f"e{i}" for i in range(len(engines))]
    clock = dict.fromkeys(ids, 0.0)
    by_id = dict(zip(ids, engines))
    taken = dict.fromkeys(ids, 0)
    # rows of the batches each engine took and not finished yet, wherever they run: on Ray the
    # task that took a batch stays in flight until its rows come home, so its window is full
    owned = dict.fromkeys(ids, 0)
    owner: dict[str, str] = {}
    cfg = AffinityConfig()
    for e in engines:
        e.reset_prefix_cache()
    start = [(e.stats.computed_tokens, e.pool.hits, e.pool.queries) for e in engines]
    n = 0
    while batches or any(e.has_unfinished() for e in engines):
        free = [i for i in ids if batches and owned[i] + args.batch_size <= window]
        busy = [i for i in ids if by_id[i].has_unfinished()]
        eid = min(free + busy, key=lambda i: (clock[i], i))
        if eid in free:  # the batch goes to the engine that frees first
            batch = batches.pop(0)
            dst = dict.fromkeys(range(len(batch)), eid)
            if arm in ("affinity", "both"):
                bs = engines[0].pool.block_size
                want = [RowPrefix(str(k), prefix_keys(toks, bs))  # not bound yet
                        for k, (_, toks) in enumerate(batch)]
                loads = {i: by_id[i].num_unfinished() for i in ids}
                held = {i: by_id[i].prefix_summary(i).keys for i in ids}
                dst = {int(k): v for k, v in assign(want, loads, held, cfg).items()}
            for k, (_, toks) in enumerate(batch):
                by_id[dst[k]].submit(toks, params, request_id=f"r{n}")
                owner[f"r{n}"] = eid
                taken[dst[k]] += 1
                n += 1
            owned[eid] += len(batch)
            continue
        t0 = time.perf_counter()
        for out in by_id[eid].step():
            if out.finished:
                owned[owner[out.request_id]] -= 1
        clock[eid] += time.perf_counter() - t0
    computed = sum(e.stats.computed_tokens - s[0] for e, s in zip(engines, start))
    hits = sum(e.pool.hits - s[1] for e, s in zip(engines, start))
    queries = sum(e.pool.queries - s[2] for e, s in zip(engines, start))
    return {"prefill_tokens": computed - len(rows) * (args.max_tokens - 1),
            "hit_rate": round(hits / max(1, queries), 3),
            "completion_s": round(max(clock.values()), 4),
            "max_rows_share": round(max(taken.values()) * len(engines) / len(rows), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="tiny | default | a model path")
    ap.add_argument("--engine", nargs="*", help="extra engine kwargs, key=value")
    ap.add_argument("--workloads", nargs="+", default=["document", "fewshot"])
    ap.add_argument("--actors", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--fewshot-rows", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--window-batches", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from batchgen_data.engine.engine import Engine

    max_len = args.doc_tokens + QUESTION_TOKENS + args.max_tokens + 16
    model = {"tiny": tiny_model(max(1024, max_len)), "default": None}.get(args.model, args.model)
    kw = {"max_model_len": max_len, "max_num_seqs": 2 * args.batch_size,
          **parse_key_values(args.engine)}
    pool = [Engine.from_kwargs(model, **kw) for _ in range(max(args.actors))]
    vocab = min(pool[0].vocab_size, len(pool[0].tokenizer))
    records: list[dict[str, Any]] = []
    warm = workload(args.workloads[0], args, vocab, seed=1)[:2 * args.batch_size]
    run_arm(pool, warm, "default", args)  # first steps pay one-time set-up: not an arm's
    for kind in args.workloads:
        rows = workload(kind, args, vocab, seed=0)
        ideal = ideal_prefill(rows, args.doc_tokens, pool[0].pool.block_size)
        for a in args.actors:
            runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
            for _ in range(args.repeats):  # the arms alternate, so drift hits each alike
                for arm in ARMS:
                    runs[arm].append(run_arm(pool[:a], rows, arm, args))
            base = statistics.median(r["completion_s"] for r in runs["default"])
            for arm, rs in runs.items():
                med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                times = [r["completion_s"] for r in rs]
                records.append({"workload": kind, "engines": a, "arm": arm, **med,
                                "vs_ideal": round(med["prefill_tokens"] / ideal, 3),
                                "speedup": round(base / med["completion_s"], 3),
                                "completion_spread_s": round(max(times) - min(times), 4),
                                "ideal_prefill_tokens": ideal})
    print(format_table(records, COLUMNS))
    print(json.dumps({"benchmark": "prefix_placement", "model": args.model, "args": vars(args),
                      "load_avg_1m": round(os.getloadavg()[0], 2), "results": records}))


if __name__ == "__main__":
    main()
