"""One self-contained HTML file about a run: what each engine did over time, and what came out.

    from batchgen_data.report.html import write_html
    write_html(record, "report.html")          # a RunRecord (the command, Ray, Spark jobs)
    write_html(output_table, "report.html")    # only output rows: no timeline, the rest as is

Sections: a summary table; per actor, a timeline of active sequences (running / waiting / held)
with idle time shaded and migrations marked; throughput over time (generated tokens/s and
rows/s); a histogram of output lengths; errors by kind. Charts are inline SVG and the styles
are inline, so the file opens anywhere, offline, and can be mailed as is.
"""
from __future__ import annotations

import time
from collections import Counter
from html import escape
from pathlib import Path
from typing import Any

from batchgen_data.report import svg as report_svg
from batchgen_data.report.record import RunRecord

_STYLE = ("body{font-family:sans-serif;margin:24px;color:#222;max-width:900px}"
          "h1{font-size:20px}h2{font-size:16px;margin-top:28px}"
          "table{border-collapse:collapse}td,th{padding:3px 10px;border-bottom:1px solid #eee;"
          "text-align:left}.key span{display:inline-block;width:10px;height:10px;"
          "margin:0 4px 0 12px}.note{color:#666;font-size:12px}")


def write_html(source: RunRecord | Any, path: str | Path) -> Path:
    """Write the report of a RunRecord (or of output rows alone) to `path`; returns it."""
    record = source if isinstance(source, RunRecord) else _record_from_rows(source)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(record), encoding="utf-8")
    return path


def _record_from_rows(rows: Any) -> RunRecord:
    """A record with one finished entry per output row (no times, no engine samples)."""
    record = RunRecord(title="batchgen_data job")
    record.add_rows(rows)
    record.end = time.time()
    return record


def render(record: RunRecord) -> str:
    t0 = record.start
    end = record.end or max([s.t for s in record.samples] + [f.t for f in record.finished]
                            + [t0])
    t_max = max(end - t0, 1e-6)
    good = [f for f in record.finished if f.error is None]
    errors = Counter(f.error for f in record.finished if f.error is not None)
    parts = [f"<h1>{escape(record.title)}</h1>",
             f'<p class="note">started {time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0))}'
             f", {t_max:.1f} s</p>", _summary(record, t_max, errors)]
    timelines = "".join(_actor_section(record, actor, t0, t_max) for actor in record.actors()
                        if any(s.actor == actor for s in record.samples))
    parts.append("<h2>Active sequences per actor</h2>" + (
        _key() + timelines if timelines else
        '<p class="note">no engine samples in this record</p>'))
    parts.append("<h2>Throughput</h2>" + _throughput(record, t0, t_max))
    parts.append("<h2>Output length</h2>" + report_svg.histogram(
        [f.generated_tokens for f in good], "generated tokens per row"))
    parts.append("<h2>Errors by kind</h2>" + report_svg.bars(errors.most_common(),
                                                             "errors by kind"))
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
            f"<title>{escape(record.title)}</title><style>{_STYLE}</style></head><body>"
            + "".join(parts) + "</body></html>")


def _summary(record: RunRecord, t_max: float, errors: Counter) -> str:
    good = [f for f in record.finished if f.error is None]
    tokens = sum(f.generated_tokens for f in good)
    moved = Counter(kind for _, _, kind in record.migrations)
    rows = [("rows", f"{len(record.finished)} ({len(good)} good, {sum(errors.values())} errors)"),
            ("generated tokens", f"{tokens}"),
            ("wall time", f"{t_max:.1f} s"),
            ("rows/s", f"{len(record.finished) / t_max:.2f}"),
            ("generated tokens/s", f"{tokens / t_max:.1f}"),
            ("actors", f"{len(record.actors())}"),
            ("migrations", f"{moved.get('export', 0)} exported, {moved.get('import', 0)} imported")]
    return "<table>" + "".join(f"<tr><th>{k}</th><td>{escape(v)}</td></tr>" for k, v in rows) \
        + "</table>"


def _key() -> str:
    c = report_svg.COLORS
    items = [("running", c["running"]), ("waiting", c["waiting"]), ("held", c["held"]),
             ("idle", c["idle"]), ("starting", c["loading"]), ("exported ▼", c["export"]), ("imported ▲", c["import"])]
    return '<p class="key">' + "".join(f'<span style="background:{col}"></span>{escape(k)}'
                                       for k, col in items) + "</p>"


def _actor_section(record: RunRecord, actor: str, t0: float, t_max: float) -> str:
    samples = sorted((s for s in record.samples if s.actor == actor), key=lambda s: s.t)
    series = [(s.t - t0, s.running, s.waiting, s.held) for s in samples]
    loading = series[0][0] if series else t_max  # before its first step: building the engine
    idle = idle_spans(series, t_max)
    moves = [(t - t0, kind) for t, a, kind in record.migrations if a == actor]
    idle_s = sum(b - a for a, b in idle)
    title = (f"{actor}: started after {loading:.1f} s, then idle {idle_s:.1f} s of "
             f"{max(t_max - loading, 0):.1f} s, migrations: {len(moves)}")
    return f"<h3>{escape(title)}</h3>" + report_svg.timeline(series, idle, moves, t_max, title,
                                                          loading)


def idle_spans(series: list[tuple[float, int, int, int]], t_max: float
               ) -> list[tuple[float, float]]:
    """Stretches after the engine's first step with no active sequence: from a sample with
    none to the next sample (or to the end)."""
    spans: list[tuple[float, float]] = []
    for i, (t, running, waiting, held) in enumerate(series):
        if running + waiting + held == 0:
            nxt = series[i + 1][0] if i + 1 < len(series) else t_max
            if spans and abs(spans[-1][1] - t) < 1e-9:
                spans[-1] = (spans[-1][0], nxt)
            else:
                spans.append((t, nxt))
    return spans


def _throughput(record: RunRecord, t0: float, t_max: float, buckets: int = 40) -> str:
    width = t_max / buckets
    tokens, rows = [0.0] * buckets, [0.0] * buckets
    def bucket(t: float) -> int:
        return min(max(int((t - t0) / width), 0), buckets - 1)

    for f in record.finished:
        rows[bucket(f.t)] += 1 / width
    by_actor: dict[str, list[Any]] = {}
    for smp in sorted(record.samples, key=lambda x: x.t):
        by_actor.setdefault(smp.actor, []).append(smp)
    if by_actor:  # tokens as the engines generated them, not when their rows finished
        for series in by_actor.values():
            for prev, cur in zip(series, series[1:]):
                tokens[bucket(cur.t)] += (cur.generated_tokens - prev.generated_tokens) / width
    else:
        for f in record.finished:
            tokens[bucket(f.t)] += f.generated_tokens / width
    mid = [(i + 0.5) * width for i in range(buckets)]
    return (report_svg.line_chart(list(zip(mid, tokens)), t_max, "generated tokens/s",
                                  "tokens/s")
            + report_svg.line_chart(list(zip(mid, rows)), t_max, "rows finished/s", "rows/s"))
