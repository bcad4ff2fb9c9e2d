"""A batch job's report: `summarize(rows)` counts what its output rows say (summary.py).

The HTML run report is `batchgen_data.report.html.write_html` over a `record.RunRecord` (or the
output rows alone); `svg.py` draws its charts.
"""
from __future__ import annotations

from batchgen_data.report.summary import summarize

__all__ = ["summarize"]
