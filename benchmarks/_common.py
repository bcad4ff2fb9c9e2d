"""Shared pieces of the benchmark scripts: synthetic workloads, results, and their reporting.

Every script prints a human-readable table followed by one JSON object per line, so that a run
can be read by eye and also parsed (`grep '^{' | jq`) without a second code path.
"""
from __future__ import annotations

import ast
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int  # generated to exactly this length (EOS ignored)


# An output-length sampler draws one request's max_tokens.
LengthSampler = Callable[[random.Random], int]


def _uniform(lo: int, hi: int) -> LengthSampler:
    return lambda rng: rng.randint(lo, hi)


def _longtail(rng: random.Random) -> int:
    # Most requests are short, a few are very long: the case where a static batch idles on padding.
    return rng.randint(256, 512) if rng.random() < 0.1 else rng.randint(16, 32)


OUTPUT_LENGTHS: dict[str, LengthSampler] = {
    "uniform": _uniform(32, 256),
    "longtail": _longtail,
}


def make_workload(
    name: str,
    num_requests: int,
    seed: int,
    vocab_size: int,
    min_token_id: int,
    prompt_len: tuple[int, int] = (32, 256),
) -> list[BenchRequest]:
    """Random prompts of ids in [min_token_id, vocab_size), so no special or EOS id appears.

    Prompt lengths depend only on `seed`, so every workload of one run shares the same prompts
    and differs only in output lengths.
    """
    if name not in OUTPUT_LENGTHS:
        raise ValueError(f"workload={name!r}: valid names are {sorted(OUTPUT_LENGTHS)}")
    if not 0 <= min_token_id < vocab_size:
        raise ValueError(f"min_token_id={min_token_id!r}: must be in [0, vocab_size={vocab_size})")
    prompt_rng = random.Random(seed)
    output_rng = random.Random(f"{seed}:{name}")
    sample_output = OUTPUT_LENGTHS[name]
    requests = []
    for _ in range(num_requests):
        n = prompt_rng.randint(*prompt_len)
        ids = [prompt_rng.randrange(min_token_id, vocab_size) for _ in range(n)]
        requests.append(BenchRequest(ids, sample_output(output_rng)))
    return requests


@dataclass(slots=True)
class RunResult:
    system: str
    workload: str
    output_tokens: int  # useful tokens: each request's own max_tokens, never padding
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")


def median_result(runs: Sequence[RunResult]) -> RunResult:
    """The run with the median wall time (the lower middle one for an even count)."""
    assert runs, "median of no runs"
    ordered = sorted(runs, key=lambda r: r.wall_s)
    chosen = ordered[(len(ordered) - 1) // 2]
    extra = dict(chosen.extra)
    if len(runs) > 1:
        extra["wall_s_all"] = [round(r.wall_s, 3) for r in runs]
    return RunResult(chosen.system, chosen.workload, chosen.output_tokens, chosen.wall_s, extra)


def with_ratios(results: Sequence[RunResult], baselines: Sequence[str]) -> list[dict[str, Any]]:
    """One flat record per result, with tok/s divided by each baseline system's on the same workload."""
    by_key = {(r.system, r.workload): r for r in results}
    records = []
    for r in results:
        rec: dict[str, Any] = {
            "system": r.system,
            "workload": r.workload,
            "output_tokens": r.output_tokens,
            "wall_s": round(r.wall_s, 3),
            "tok_s": round(r.tok_s, 2),
        }
        for base in baselines:
            b = by_key.get((base, r.workload))
            rec[f"vs_{base}"] = round(r.tok_s / b.tok_s, 3) if b is not None and b.tok_s > 0 else None
        rec.update(r.extra)
        records.append(rec)
    return records


def format_table(records: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    rows = [[cell(rec.get(c)) for c in columns] for rec in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def print_report(records: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    print(format_table(records, columns))
    for rec in records:
        print(json.dumps(rec, sort_keys=False))


def parse_key_values(items: Sequence[str] | None) -> dict[str, Any]:
    """`["a=1", "b=x", "c=None"]` -> `{"a": 1, "b": "x", "c": None}`; values are Python literals or strings."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected key=value, got {item!r}")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def wait_for_quiet(max_wait_s: float, below: float = 1.0, poll_s: float = 5.0) -> float:
    """Waits up to `max_wait_s` for the 1-minute load average to drop under `below`; returns it.

    On a shared machine another job's threads halve a CPU benchmark's speed; waiting for a quiet
    moment beats reporting a number that measures the neighbours.
    """
    deadline = time.monotonic() + max_wait_s
    load = os.getloadavg()[0]
    while load >= below and time.monotonic() < deadline:
        time.sleep(poll_s)
        load = os.getloadavg()[0]
    return load


def tensor_bytes(module: Any) -> int:
    """Bytes of a torch module's parameters and buffers, each tensor once (packed oneDNN
    tensors, whose size torch cannot report, left out)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t is not None and id(t) not in seen and not t.is_mkldnn:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def step_until_decode(engine: Any) -> None:
    """Step `engine` until sequences run and each has exactly one token pending: the next step
    is a pure decode (where runner and step benchmarks start). Reads only the engine's public
    surface (its scheduler's running sequences), so it drives any tree's engine alike."""
    while not engine.scheduler.running or any(
            s.num_pending_tokens != 1 for s in engine.scheduler.running):
        if not engine.has_unfinished():
            raise RuntimeError("step_until_decode: no unfinished request to decode")
        engine.step()


def schedule_decode(engine: Any) -> Any:
    """`step_until_decode`, then the next step scheduled without running it (its
    `SchedulerOutput`), for a caller that drives the model runner itself; a later `step()`
    schedules the same batch again, so the engine's tokens do not change."""
    step_until_decode(engine)
    return engine.scheduler.schedule()
