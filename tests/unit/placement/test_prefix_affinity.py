"""Placement by prefix (placement/affinity.py): the longest cached match wins, else a consistent
hash; loads stay bounded under skew; the answer is deterministic; a new engine moves only the
keys it takes over. Oracles: counts over the result (the bound recomputed here from its
definition), the shares consistent hashing should give, and hand-made summaries."""
from __future__ import annotations

import math
import random
from collections import Counter, defaultdict

import pytest

from batchgen_data.placement import (AffinityConfig, RequestSummary, RowPrefix, affinity_moves,
                                     assign, chain_keys, prefix_keys)

BS = 16


def doc_rows(num_docs: int, questions: list[int], seed: int = 0) -> list[tuple[int, RowPrefix]]:
    """(document, row) pairs: each document's ~1000-token text then a question, shuffled."""
    rng = random.Random(seed)
    out = []
    for d in range(num_docs):
        text = [rng.randrange(50_000) for _ in range(1000)]
        for q in range(questions[d]):
            toks = text + [rng.randrange(50_000) for _ in range(20)]
            out.append((d, RowPrefix(f"d{d}q{q}", prefix_keys(toks, BS))))
    rng.shuffle(out)
    return out


def engines(n: int) -> dict[str, int]:
    return {f"engine-{i}": 0 for i in range(n)}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bounded_load_under_skew(n: int) -> None:
    # one document with 10x the questions of the others, rows in shuffled order
    pairs = doc_rows(24, [200] + [20] * 23)
    rows = [r for _, r in pairs]
    got = assign(rows, engines(n), {}, AffinityConfig(epsilon=0.25))
    per_engine = Counter(got.values())
    cap = math.ceil(1.25 * len(pairs) / n)
    assert max(per_engine.values()) <= cap and len(per_engine) == n
    # the hot document spills over as many engines as the bound needs
    hot = Counter(got[r.row_id] for d, r in pairs if d == 0)
    assert len(hot) >= math.ceil(200 / cap)
    # a document whose own engine (the ring's choice, no bound) never filled up sits there whole
    owner = assign(rows, engines(n), {}, AffinityConfig(epsilon=1000.0))
    full = {e for e, c in per_engine.items() if c == cap}
    for d in range(24):
        mine = [r.row_id for dd, r in pairs if dd == d]
        if owner[mine[0]] not in full:
            assert {got[rid] for rid in mine} == {owner[mine[0]]}
    # placed a document at a time (as affinity_moves orders rows), each engine that fills up
    # splits at most one document
    by_doc = sorted(pairs, key=lambda p: p[0])
    got = assign([r for _, r in by_doc], engines(n), {}, AffinityConfig(epsilon=0.25))
    assert max(Counter(got.values()).values()) <= cap
    assert len({(d, got[r.row_id]) for d, r in by_doc}) <= 24 + n


def test_without_a_bound_each_document_sits_on_one_engine() -> None:
    pairs = doc_rows(30, [10] * 30, seed=1)
    got = assign([r for _, r in pairs], engines(4), {}, AffinityConfig(epsilon=100.0))
    for d in range(30):
        assert len({got[r.row_id] for dd, r in pairs if dd == d}) == 1


def test_deterministic_whatever_the_engine_order() -> None:
    pairs = doc_rows(12, [15] * 12, seed=2)
    rows = [r for _, r in pairs]
    cfg = AffinityConfig()
    names = list(engines(5))
    first = assign(rows, dict.fromkeys(names, 3), {}, cfg)
    for seed in range(3):
        random.Random(seed).shuffle(names)
        assert assign(rows, dict.fromkeys(names, 3), {}, cfg) == first


def test_a_new_engine_moves_only_the_keys_it_takes() -> None:
    rng = random.Random(3)
    rows = [RowPrefix(f"r{i}", tuple(chain_keys([rng.randrange(10**6) for _ in range(64)], BS)))
            for i in range(4000)]
    cfg = AffinityConfig(epsilon=1000.0)  # no bound: consistent hashing alone
    before = assign(rows, engines(4), {}, cfg)
    after = assign(rows, engines(5), {}, cfg)
    moved = [r for r in before if before[r] != after[r]]
    assert {after[r] for r in moved} == {"engine-4"}
    assert 0.12 < len(moved) / len(rows) < 0.28  # about a fifth
    shares = Counter(before.values())
    assert all(0.15 < c / len(rows) < 0.35 for c in shares.values())  # 64 points even arcs out


def test_the_longest_cached_match_wins_over_the_hash() -> None:
    toks = list(range(100, 100 + 20 * BS))
    keys = prefix_keys(toks, BS)  # depths 1, 2, 4, 8, 16
    row = RowPrefix("r", keys)
    cfg = AffinityConfig()
    ring_choice = assign([row], engines(4), {}, cfg)["r"]
    deep = next(e for e in engines(4) if e != ring_choice)
    held = {ring_choice: {keys[0]}, deep: set(keys[:4])}
    assert assign([row], engines(4), held, cfg)["r"] == deep
    # ... unless that engine is full: the row walks on in its own order
    full = {**engines(4), deep: 10}
    assert assign([row], full, held, cfg)["r"] == ring_choice


def test_a_bound_row_moves_only_when_that_gains() -> None:
    keys = prefix_keys(list(range(7, 7 + 8 * BS)), BS)
    cfg = AffinityConfig(epsilon=2.0)  # room for two rows on one engine
    owner = assign([RowPrefix("r", keys)], engines(3), {}, cfg)["r"]
    here = next(e for e in engines(3) if e != owner)
    # its engine holds the whole prefix, as the ring's choice does: it stays
    both = {owner: set(keys), here: set(keys)}
    assert assign([RowPrefix("r", keys, at=here)], engines(3), both, cfg)["r"] == here
    # nothing cached beyond a shared first block (a chat template's system prompt) and no other
    # row of its prefix anywhere: nothing to gain by moving
    first = {owner: {keys[0]}, here: {keys[0]}}
    assert assign([RowPrefix("r", keys, at=here)], engines(3), first, cfg)["r"] == here
    # ... but a row of the same prefix on another engine: they meet at the ring's choice
    pair = [RowPrefix("r", keys, at=here), RowPrefix("s", keys, at=owner)]
    assert assign(pair, engines(3), first, cfg) == {"r": owner, "s": owner}
    # ... and an engine caching more of it pulls it
    deeper = {owner: set(keys[:2]), here: {keys[0]}}
    assert assign([RowPrefix("r", keys, at=here)], engines(3), deeper, cfg)["r"] == owner


def test_affinity_moves_send_waiting_rows_to_their_engine() -> None:
    pairs = doc_rows(6, [8] * 6, seed=4)
    names = list(engines(3))
    waiting: dict[str, list[RequestSummary]] = defaultdict(list)
    for i, (_, r) in enumerate(pairs):  # rows dealt round robin, as free actors take batches
        waiting[names[i % 3]].append(RequestSummary(r.row_id, "waiting", 1020, 0, 0, r.keys))
    waiting[names[0]].append(RequestSummary("run", "running", 1020, 5, 1020))
    active = {e: len(v) for e, v in waiting.items()}
    cfg = AffinityConfig(epsilon=1.0)
    moves = affinity_moves(waiting, active, {}, cfg)
    placed = {r.request_id: e for e, rs in waiting.items() for r in rs}
    for mv in moves:
        assert mv.kind == "waiting" and mv.src != mv.dst and "run" not in mv.request_ids
        for rid in mv.request_ids:
            assert placed[rid] == mv.src
            placed[rid] = mv.dst
    for d in range(6):  # every document's rows now meet on one engine
        assert len({placed[r.row_id] for dd, r in pairs if dd == d}) == 1
    assert affinity_moves(waiting, {names[0]: 5}, {}, cfg) == []  # one engine: nothing to do


def test_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="epsilon"):
        AffinityConfig(epsilon=0)
    with pytest.raises(ValueError, match="vnodes"):
        AffinityConfig(vnodes=0)
    with pytest.raises(ValueError, match="loads"):
        assign([], {}, {}, AffinityConfig())
