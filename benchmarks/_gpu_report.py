"""The GPU benchmark's records: kept in order, saved to $OUT/gpu_throughput.json after each
one (a run cut short by a timeout still leaves what it measured), printed as tables at the end."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

COLUMNS = ["system", "finished", "output_tokens", "wall_s", "tok_s", "tok_s_finished",
           "vs_hf_static", "vs_hf_cb", "error"]


class Report:
    """Collects records; rewrites $OUT/gpu_throughput.json after each phase, so a run cut
    short by a timeout still leaves what it measured."""

    def __init__(self, name: str = "gpu_throughput", benches: tuple[str, ...] = (
            "throughput", "moe_throughput")) -> None:
        out = os.environ.get("OUT")
        self.path = Path(out) / f"{name}.json" if out else None
        self.benches = benches
        self.records: list[dict[str, Any]] = []

    def add(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
        self.save()

    @staticmethod
    def _table(bench: str, rows: list[dict[str, Any]]) -> list[str]:
        """Print one bench's rows as a text table; return them as markdown lines."""
        base = {r["system"]: r.get("tok_s_finished") for r in rows}
        for r in rows:
            for b in ("hf_static", "hf_cb"):
                ok = base.get(b) and "tok_s" in r
                r[f"vs_{b}"] = round(r["tok_s"] / base[b], 2) if ok else None
        cols = COLUMNS + (["tokens_per_expert"] if bench == "moe_throughput" else [])
        cells = [[str(r.get(c, "-"))[:60] for c in cols] for r in rows]
        widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
        print(f"[{bench}]")
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        for x in cells:
            print("  ".join(v.rjust(w) for v, w in zip(x, widths)))
        return [f"### {bench}", "", "| " + " | ".join(cols) + " |",
                "|" + "---|" * len(cols), *("| " + " | ".join(x) + " |" for x in cells), ""]

    def save(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps(self.records, indent=1))

    def table(self) -> None:
        """Print the throughput tables (and write them to $OUT/gpu_throughput.md)."""
        md: list[str] = []
        for bench in self.benches:
            rows = [r for r in self.records if r.get("bench") == bench]
            if rows:
                md += self._table(bench, rows)
        self.save()
        if self.path is not None:
            self.path.with_suffix(".md").write_text("\n".join(md) + "\n")
        print("HF runs are time-boxed: tok_s_finished counts only requests that finished; "
              "vs_* divide our tok_s by the baseline's tok_s_finished.")
        for r in self.records:
            print(json.dumps(r))
