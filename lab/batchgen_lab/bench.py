"""The benchmarks' shared helpers (``benchmarks/_common.py``: workloads, tables, the one-JSON-
line report) for the lab's experiments: the one place the lab reaches into benchmarks/."""
from __future__ import annotations

import sys
from pathlib import Path

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(_BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(_BENCHMARKS))

from _common import (  # noqa: E402
    OUTPUT_LENGTHS, format_table, make_workload, parse_key_values, print_report)

__all__ = ["OUTPUT_LENGTHS", "format_table", "make_workload", "parse_key_values",
           "print_report"]
