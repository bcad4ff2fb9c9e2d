"""The coordinator's late binding by prefix (connectors/ray/affinity.py), without Ray: waiting
rows of one document spread over engines meet; a cached prefix pulls its rows; rows already
together stay; rows in flight are not ordered twice; prefix_affinity=False leaves queued rows to
the load rules alone."""
from __future__ import annotations

import random
from dataclasses import replace

from batchgen_data.connectors.ray.coordinator import Coordinator, Report
from batchgen_data.placement import EngineLoad, RequestSummary, Ring, prefix_keys

BS = 16
# two engines whose seats are all busy: the load rules move nothing, only affinity does
FULL = EngineLoad("", waiting=0, running=2, held=0, remaining_tokens_est=0, free_blocks=50,
                  total_blocks=100, max_num_seqs=2, block_size=BS)


def doc_rows(num_docs: int, per_doc: int) -> tuple[list[RequestSummary], dict[str, int]]:
    rng = random.Random(0)
    rows, doc_of = [], {}
    for d in range(num_docs):
        text = [rng.randrange(1000) for _ in range(8 * BS)]
        for q in range(per_doc):
            rid = f"d{d}q{q}"
            keys = prefix_keys(text + [rng.randrange(1000) for _ in range(9)], BS)
            rows.append(RequestSummary(rid, "waiting", 8 * BS + 9, 0, 0, keys))
            doc_of[rid] = d
    return rows, doc_of


def exchange(c: Coordinator, eid: str, rows: list[RequestSummary],
             prefixes: frozenset[int] | None = None) -> Report:
    load = replace(FULL, engine_id=eid, waiting=len(rows))
    return c.exchange(Report(load, tuple(rows), prefixes=prefixes), [])


def test_waiting_rows_of_one_document_meet() -> None:
    rows, doc_of = doc_rows(6, 4)
    at_a, at_b = rows[0::2], rows[1::2]  # every document's questions on both engines
    c = Coordinator(cooldown_s=60.0, affinity={"epsilon": 1.0})
    exchange(c, "b", at_b)
    reply_a = exchange(c, "a", at_a)
    reply_b = exchange(c, "b", at_b)
    where = {r.request_id: "a" for r in at_a} | {r.request_id: "b" for r in at_b}
    moved = 0
    for eid, reply in (("a", reply_a), ("b", reply_b)):
        for mv in reply.orders:
            assert mv.src == eid and mv.dst != eid and mv.kind == "waiting"
            for rid in mv.request_ids:
                assert where[rid] == eid
                where[rid] = mv.dst
                moved += 1
    for d in range(6):
        assert len({where[rid] for rid, dd in doc_of.items() if dd == d}) == 1
    assert moved and c.stats()["affinity_moves"] == moved
    # the same stale reports again: the rows in flight are not ordered a second time
    assert exchange(c, "a", at_a).orders == () and exchange(c, "b", at_b).orders == ()


def test_a_cached_prefix_pulls_its_rows_and_lone_rows_stay() -> None:
    rows, doc_of = doc_rows(6, 3)
    ring = Ring(["a", "b"])
    mine = [r for r in rows if ring.order(r.prefix[2])[0] == "a"]
    assert mine and len(mine) < len(rows)
    c = Coordinator(cooldown_s=60.0, affinity={"epsilon": 1.0})
    exchange(c, "b", [])  # holds nothing yet
    assert exchange(c, "a", rows).orders == ()  # together on "a" already: nothing to gain
    d = doc_of[mine[0].request_id]  # a document whose ring engine is "a" itself
    c = Coordinator(cooldown_s=60.0, affinity={"epsilon": 1.0})
    exchange(c, "b", [], prefixes=frozenset(mine[0].prefix))  # but "b" caches it
    moved = {rid for mv in exchange(c, "a", rows).orders for rid in mv.request_ids}
    assert moved == {rid for rid, dd in doc_of.items() if dd == d}


def test_affinity_off_moves_nothing_between_full_engines() -> None:
    rows, _ = doc_rows(6, 4)
    for on in (True, False):
        c = Coordinator(cooldown_s=60.0, prefix_affinity=on, affinity={"epsilon": 1.0})
        exchange(c, "b", rows[1::2])
        orders = exchange(c, "a", rows[0::2]).orders + exchange(c, "b", rows[1::2]).orders
        assert bool(orders) is on and c.stats()["affinity_moves"] == (
            sum(len(mv.request_ids) for mv in orders))
