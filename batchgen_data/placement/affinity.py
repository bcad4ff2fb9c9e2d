"""Prefix affinity: which engine a row should run on so that rows sharing a prefix meet.

A row's preferred engine is the one whose prefix cache holds the longest match of its leading
blocks (`prefix.match_depth` against each engine's `PrefixSummary`); where no engine holds more
than the others, a consistent hash of its leading blocks picks one, so rows of one document meet
on one engine before any of them is cached. Every choice is bounded (consistent hashing with
bounded loads, Mirrokni, Thorup and Zadimoghaddam 2018): no engine takes more than
`ceil((1 + epsilon) * total / n)` rows, and a row whose first choice is full walks on, in the
same order for every row that shares its key, so a hot document spills to the same next engine
rather than everywhere. An engine's fair share always fits (n caps hold at least the total), so
every row finds a place. A row already bound to an engine moves only when that gains: another
engine caches more of its prefix, or rows sharing its ring key sit on other engines too (they
meet at the ring's choice); rows that share nothing with anyone stay put.

Pure and deterministic: the same loads, summaries and rows give the same answer whatever the
order engines are listed in, and adding an engine moves only the keys it now owns.
"""
from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass

from batchgen_data.placement.migration import EngineId, Move, RequestSummary
from batchgen_data.placement.prefix import match_depth


@dataclass(frozen=True, slots=True)
class AffinityConfig:
    # no engine above (1 + epsilon) times its share of the rows (bounded load)
    epsilon: float = 0.25
    vnodes: int = 64  # points per engine on the hash ring: evens out the engines' arcs
    # the ring hashes a row's key at this published depth (1-based index into prefix.DEPTHS,
    # 3: four blocks) or its deepest if shorter: deep enough that a chat template's shared
    # system prompt does not send every row to one engine, shallow enough to stay within a
    # document's text before its question starts
    hash_depth: int = 3

    def __post_init__(self) -> None:
        if not self.epsilon > 0:
            raise ValueError(f"affinity epsilon={self.epsilon!r}: must be > 0")
        if self.vnodes < 1 or self.hash_depth < 1:
            raise ValueError(f"affinity vnodes={self.vnodes!r}, hash_depth={self.hash_depth!r}: "
                             "must be >= 1")


@dataclass(frozen=True, slots=True)
class RowPrefix:
    """A row to place: its prefix keys (`prefix.prefix_keys`) and where it is (None: unbound)."""

    row_id: str
    keys: tuple[int, ...]
    at: EngineId | None = None


def _point(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "little")


class Ring:
    """A consistent-hash ring of engines, `vnodes` points each, by stable digests of their ids."""

    def __init__(self, engine_ids: Iterable[EngineId], vnodes: int = 64) -> None:
        points = sorted((_point(f"{eid!s}#{i}"), str(eid), eid)
                        for eid in set(engine_ids) for i in range(vnodes))
        self._hashes = [p[0] for p in points]
        self._owners = [p[2] for p in points]
        self.num_engines = len({p[1] for p in points})

    def order(self, key: int) -> list[EngineId]:
        """Every engine once, clockwise from `key`: the first owns it, the rest are spills."""
        out: list[EngineId] = []
        n = len(self._owners)
        start = bisect.bisect_left(self._hashes, key % (1 << 64))
        for i in range(n):
            eid = self._owners[(start + i) % n]
            if eid not in out:
                out.append(eid)
                if len(out) == self.num_engines:
                    break
        return out


def capacity(total: int, num_engines: int, epsilon: float) -> int:
    """The most rows any one engine may hold: (1 + epsilon) of an even share, at least 1."""
    return max(1, math.ceil((1.0 + epsilon) * total / max(1, num_engines)))


def preference(keys: Sequence[int], ring: Ring, held: Mapping[EngineId, Container[int]],
               cfg: AffinityConfig) -> tuple[list[EngineId], dict[EngineId, int]]:
    """The engines in the order a row would take them (longest cached match first, the ring's
    order among equals) and each one's match depth."""
    order = ring.order(ring_key(keys, cfg))
    depth = {e: match_depth(keys, held.get(e, ())) for e in order}
    return sorted(order, key=lambda e: -depth[e]), depth


def ring_key(keys: Sequence[int], cfg: AffinityConfig) -> int:
    """The key a row is hashed by: its key at `hash_depth`, or its deepest if shorter."""
    return keys[min(cfg.hash_depth, len(keys)) - 1]


def assign(rows: Sequence[RowPrefix], loads: Mapping[EngineId, int],
           held: Mapping[EngineId, Container[int]], cfg: AffinityConfig,
           ring: Ring | None = None) -> dict[str, EngineId]:
    """An engine for every row. `loads`: the rows each engine holds besides these (its keys are
    the engines to place on); `held`: each engine's summary keys. Rows go in the given order.
    A bound row (`at`) under the bound stays where it is unless moving gains something: an
    engine caches more of its prefix, or rows of its ring key sit on other engines too (they
    should meet). It also stays when its engine already matches it as deeply as the best does
    and to its ring key, or when it has no full block. `ring`: the ring of exactly these
    engines, when the caller keeps one."""
    if not loads:
        raise ValueError("loads: no engine to place rows on")
    load = dict(loads)
    ring = ring if ring is not None else Ring(load, cfg.vnodes)
    cap = capacity(sum(load.values()) + len(rows), len(load), cfg.epsilon)
    spread: dict[int, set[EngineId]] = {}  # engines each ring key's bound rows sit on
    for row in rows:
        if row.keys and row.at is not None:
            spread.setdefault(ring_key(row.keys, cfg), set()).add(row.at)
    out: dict[str, EngineId] = {}
    for row in rows:
        here = row.at if row.at in load and load[row.at] < cap else None
        if not row.keys:
            dst = here if here is not None else min(load, key=lambda e: (load[e], str(e)))
        else:
            order, depth = preference(row.keys, ring, held, cfg)
            dst = next(e for e in order if load[e] < cap)
            if here is not None:
                settled = depth[here] >= max(depth[dst], min(cfg.hash_depth, len(row.keys)))
                alone = (depth[dst] <= depth[here]
                         and len(spread.get(ring_key(row.keys, cfg), ())) < 2)
                if settled or alone:
                    dst = here
        load[dst] += 1
        out[row.row_id] = dst
    return out


def affinity_moves(waiting: Mapping[EngineId, Sequence[RequestSummary]],
                   active: Mapping[EngineId, int], held: Mapping[EngineId, Container[int]],
                   cfg: AffinityConfig, ring: Ring | None = None) -> list[Move]:
    """Late binding by prefix: the waiting rows (no KV yet, free to move) each engine reports,
    sent where `assign` places them. `active`: every engine's rows now, its waiting ones
    included (those that may take rows: its keys). A row moves at most to one engine; rows of
    engines not in `active` are left alone."""
    rows = [RowPrefix(r.request_id, r.prefix, src)
            for src in sorted(waiting, key=str) if src in active
            for r in waiting[src] if r.kind == "waiting"]
    # a prefix's rows placed one after another: an engine that fills up splits one prefix
    rows.sort(key=lambda r: (ring_key(r.keys, cfg) if r.keys else -1, r.row_id))
    if len(active) < 2 or not rows:
        return []
    placed = {src: sum(1 for r in waiting[src] if r.kind == "waiting")
              for src in waiting if src in active}
    base = {e: max(0, n - placed.get(e, 0)) for e, n in active.items()}
    dst_of = assign(rows, base, held, cfg, ring)
    grouped: dict[tuple[EngineId, EngineId], list[str]] = {}
    for row in rows:
        dst = dst_of[row.row_id]
        if dst != row.at:
            grouped.setdefault((row.at, dst), []).append(row.row_id)
    return [Move(src, dst, "waiting", tuple(ids)) for (src, dst), ids in grouped.items()]
