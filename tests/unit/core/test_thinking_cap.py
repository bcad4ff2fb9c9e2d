"""The job cap's quantile (core/thinking.censored_quantile): the product-limit estimate with
rows still reasoning counted as at least their length so far. Oracles: numpy's empirical
quantile where nothing is censored, and a Kaplan-Meier table worked by hand."""
from __future__ import annotations

import random

import numpy as np
import pytest

from batchgen_data.core.thinking import ThinkingCap, censored_quantile


@pytest.mark.parametrize("q", [0.5, 0.9, 0.95, 1.0])
def test_without_censoring_it_is_the_empirical_quantile(q: float) -> None:
    rng = random.Random(3)
    for _ in range(50):
        xs = sorted(rng.randint(1, 400) for _ in range(rng.randint(1, 60)))
        want = int(np.quantile(np.array(xs), q, method="inverted_cdf"))
        assert censored_quantile(xs, [], q) == want


def test_a_kaplan_meier_table_worked_by_hand() -> None:
    # ended at 2, 4, 4, 7; at least 3 and at least 5 (still reasoning)
    # t=2: 6 at risk, 1 ends -> S = 5/6; t=4: 4 at risk (4, 4, 7, >=5), 2 end -> S = 5/12;
    # t=7: 1 at risk -> S = 0
    ended, bounds = [2, 4, 4, 7], [3, 5]
    assert censored_quantile(ended, bounds, 0.1) == 2  # 5/6 <= 0.9
    assert censored_quantile(ended, bounds, 0.5) == 4  # 5/12 <= 0.5
    assert censored_quantile(ended, bounds, 0.6) == 7
    assert censored_quantile([2, 4, 4], bounds + [9], 0.7) is None  # 5/12 > 0.3 and no more


def test_early_finishers_do_not_set_the_cap() -> None:
    # 90 short rows ended (500..2000 tokens), 10 long ones still reasoning at 2000: 10% of the
    # job is known to reason longer, so no p95 exists yet; the finished rows' own p95 (what a
    # cap over them alone would give) would cut all ten
    short = sorted(random.Random(0).randint(500, 2000) for _ in range(90))
    assert censored_quantile(short, [2000] * 10, 0.95) is None
    assert int(np.quantile(short, 0.95, method="inverted_cdf")) < 2000
    # once the long ones end (8000..30000), the cap is the job's p95: one of them
    long = sorted(random.Random(1).randint(8000, 30000) for _ in range(10))
    got = censored_quantile(sorted(short + long), [], 0.95)
    assert got == int(np.quantile(short + long, 0.95, method="inverted_cdf")) and got >= 8000


class _Row:
    def __init__(self, used: int) -> None:
        self.used = used


def test_the_cap_counts_live_and_cut_rows_as_censored() -> None:
    cap = ThinkingCap(0.9, min_rows=4)
    live = [_Row(50) for _ in range(2)]
    for r in live:
        cap.watch(r)
    for n in (3, 5, 6):
        r = _Row(n)
        cap.watch(r)
        cap.ended(r)
    assert cap.value is None  # fewer than min_rows ended
    cut = _Row(40)
    cap.watch(cut)
    cap.cut(cut)
    r = _Row(8)
    cap.watch(r)
    cap.ended(r)
    # ended 3, 5, 6, 8; at least 40, 50, 50: 3/7 of the rows go past 8, so no 0.9 cap yet
    assert cap.value is None and cap.live == set(live)
