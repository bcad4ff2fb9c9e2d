"""The HTML run report: self-contained, one timeline per actor, idle time, every section."""
from __future__ import annotations

import re
from pathlib import Path

from batchgen_data.report.html import idle_spans, write_html
from batchgen_data.report.record import EngineSampler, RunRecord, Sample


def _record() -> RunRecord:
    rec = RunRecord(start=1000.0, title="t")
    for actor, shift in (("a1", 0.0), ("a2", 2.0)):
        for i, (run, wait) in enumerate([(0, 0), (4, 2), (6, 0), (3, 0), (0, 0)]):
            rec.add_sample(Sample(1001.0 + shift + i, actor, wait, run, 0, 10 * i))
    rec.add_migration(1003.5, "a1", "export")
    rec.add_migration(1003.6, "a2", "import")
    for i in range(8):
        rec.add_finished("a1", 5 + i, None, t=1002.0 + i / 2)
    rec.add_finished("a2", 0, "prompt has 9000 tokens; max_model_len is 2048", t=1004.0)
    rec.end = 1010.0
    return rec


def test_report_has_every_section_inline(tmp_path: Path) -> None:
    html = write_html(_record(), tmp_path / "r.html").read_text()
    assert html.count("<svg") == 2 + 2 + 1 + 1  # timelines, throughput x2, histogram, errors
    assert "<script" not in html and not re.search(r'(src|href)="(http|/)', html)
    assert "prompt has N tokens" in html  # errors grouped by kind
    assert "1 exported, 1 imported" in html
    assert html.count("<h3>") == 2 and "a2: started after 3.0 s, then idle 4.0 s of 7.0 s, migrations: 1" in html


def test_idle_spans_join_gaps_and_run_to_the_end() -> None:
    series = [(1.0, 0, 0, 0), (2.0, 3, 0, 0), (4.0, 0, 0, 0), (5.0, 0, 0, 0)]
    assert idle_spans(series, 6.0) == [(1.0, 2.0), (4.0, 6.0)]
    assert idle_spans([], 3.0) == []


def test_rows_alone_make_a_report_without_timelines(tmp_path: Path) -> None:
    rows = [{"num_generated_tokens": 3, "error": None}, {"num_generated_tokens": 0,
                                                         "error": "prompt is null"}]
    html = write_html(rows, tmp_path / "r.html").read_text()
    assert "no engine samples" in html and "prompt is null" in html


class _Load:
    waiting, running, held = 1, 2, 0


class _Engine:
    def __init__(self) -> None:
        self.active = 3
        self.stats = type("S", (), {"generated_tokens": 7})()

    def num_unfinished(self) -> int:
        return self.active

    def load(self) -> _Load:
        return _Load()


def test_sampler_throttles_but_never_misses_going_idle() -> None:
    rec = RunRecord()
    sampler, engine = EngineSampler(rec, "x", interval_s=3600), _Engine()
    sampler(engine)
    sampler(engine)  # within the interval, still busy: skipped
    engine.active = 0
    sampler(engine)  # went idle: recorded at once
    assert len(rec.samples) == 2 and rec.samples[0].active == 3
    part = rec.drain()
    assert len(part["samples"]) == 2 and rec.samples == []
    other = RunRecord()
    other.merge(part)
    assert other.samples[0].actor == "x"
