"""One benchmark, two source trees, side by side in one run: is a change behaviour-neutral in cost?

Each tree runs its own copy of the benchmark script (a tree's benchmarks import its own
internals) with its own package: the tree is installed as a wheel would be (``pip install
--no-deps --target``) into a scratch folder that goes first on ``PYTHONPATH``, so neither run
sees the other's modules nor this checkout's editable install. The runs alternate
(before, after, before, after, ...), so slow drifts of a shared machine's load fall on both
trees alike. Per measured arm (the benchmark's records, matched by their key fields) the table
gives the median of the metric over the repeats for each tree, the spread (min-max) and
``after_over_before``; the JSON line has every run's value.

    .venv/bin/python benchmarks/tree_ab.py --before /tmp/old --after . --bench host_overhead \\
        --repeat 3 -- --seqs 256,1024 --workloads decode,mixed
    .venv/bin/python benchmarks/tree_ab.py --before /tmp/old --after . --bench cpu_throughput \\
        --repeat 3 -- --systems ours --workloads uniform,longtail

``--before`` / ``--after`` are source trees (e.g. ``git archive <commit> | tar -x -C DIR``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table  # noqa: E402

# per benchmark: the fields that name an arm, the metric compared (lower or higher is better)
BENCHES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "host_overhead": (("workload", "seqs", "sleep_ms", "scheduling"), "cpu_ms", "lower"),
    "cpu_throughput": (("system", "workload"), "tok_s", "higher"),
}


def install(tree: Path, into: Path) -> None:
    """The tree's package as its wheel installs it, into `into` (no dependencies)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(into), str(tree)],
                   check=True, capture_output=True, text=True)


def records(output: str) -> list[dict[str, Any]]:
    """The benchmark's JSON lines as records (a line holding ``results`` gives those)."""
    found: list[dict[str, Any]] = []
    for line in output.splitlines():
        if not line.startswith("{"):
            continue
        obj = json.loads(line)
        found.extend(obj["results"] if "results" in obj else [obj])
    return found


def run_once(tree: Path, site: Path, bench: str, extra: list[str]) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, str(tree / "benchmarks" / f"{bench}.py"), *extra],
                         cwd=tree, env=env, check=True, capture_output=True, text=True)
    return records(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="the source tree before")
    ap.add_argument("--after", type=Path, required=True, help="the source tree after")
    ap.add_argument("--bench", choices=sorted(BENCHES), required=True)
    ap.add_argument("--repeat", type=int, default=3, help="runs per tree, alternating")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="-- then the benchmark's own flags")
    args = ap.parse_args()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    keys, metric, better = BENCHES[args.bench]
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    values: dict[tuple[Any, ...], dict[str, list[float]]] = {}
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="tree_ab_") as tmp:
        sites = {name: Path(tmp) / name for name in trees}
        for name, tree in trees.items():
            install(tree, sites[name])
        for _ in range(args.repeat):
            for name, tree in trees.items():
                loads.append(os.getloadavg()[0])
                start = time.perf_counter()
                for rec in run_once(tree, sites[name], args.bench, extra):
                    arm = tuple(rec.get(k) for k in keys)
                    values.setdefault(arm, {"before": [], "after": []})[name].append(
                        float(rec[metric]))
                print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    rows = []
    for arm, got in values.items():
        if not got["before"] or not got["after"]:
            continue
        before, after = statistics.median(got["before"]), statistics.median(got["after"])
        rows.append({**dict(zip(keys, arm)), f"before_{metric}": round(before, 3),
                     f"after_{metric}": round(after, 3),
                     "before_spread": f"{min(got['before']):.3f}-{max(got['before']):.3f}",
                     "after_spread": f"{min(got['after']):.3f}-{max(got['after']):.3f}",
                     "after_over_before": round(after / before, 3) if before else None})
    print(f"{args.bench}: {metric} ({better} is better), medians of {args.repeat} alternating "
          f"runs per tree; load {min(loads):.2f}-{max(loads):.2f}")
    print(format_table(rows, [*keys, f"before_{metric}", f"after_{metric}", "before_spread",
                              "after_spread", "after_over_before"]))
    ratios = [r["after_over_before"] for r in rows if r["after_over_before"] is not None]
    print(json.dumps({"bench": "tree_ab", "of": args.bench, "metric": metric, "better": better,
                      "before": str(trees["before"]), "after": str(trees["after"]),
                      "repeat": args.repeat, "extra": extra, "load": [min(loads), max(loads)],
                      "median_after_over_before": statistics.median(ratios) if ratios else None,
                      "arms": rows, "runs": [{"arm": list(a), **v} for a, v in values.items()]}))


if __name__ == "__main__":
    main()
