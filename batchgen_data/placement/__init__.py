"""Placement policy: where rows and running sequences go among engines, decided from what the
engines report (load, movable requests, prefix-cache summaries). Pure Python with no engine or
Ray imports, so the same code drives the Ray coordinator and the cluster simulator.

* `migration`: load reports, late binding by load and the migration of queued, held and
  running work (`plan_moves`);
* `prefix`: prefix keys, the cross-process names of a prompt's leading KV blocks, and an
  engine's `PrefixSummary`;
* `affinity`: the engine a row should run on so rows sharing a prefix meet (longest cached
  match, else consistent hashing with bounded loads).
"""
from __future__ import annotations

from batchgen_data.placement.affinity import (AffinityConfig, Ring, RowPrefix, affinity_moves,
                                              assign, capacity)
from batchgen_data.placement.migration import (KINDS, EngineId, EngineLoad, Move,
                                               PlacementConfig, RequestSummary, TransferCost,
                                               find_receivers, has_free_seat, is_short_of_work,
                                               pick_donors, plan_moves, rows_wanted)
from batchgen_data.placement.prefix import (DEPTHS, PrefixSummary, block_key, chain_keys,
                                            match_depth, prefix_keys)

__all__ = ["AffinityConfig", "DEPTHS", "EngineId", "EngineLoad", "KINDS", "Move",
           "PlacementConfig", "PrefixSummary", "RequestSummary", "Ring", "RowPrefix",
           "TransferCost", "affinity_moves", "assign", "block_key", "capacity", "chain_keys",
           "find_receivers", "has_free_seat", "is_short_of_work", "match_depth", "pick_donors",
           "plan_moves", "prefix_keys", "rows_wanted"]
