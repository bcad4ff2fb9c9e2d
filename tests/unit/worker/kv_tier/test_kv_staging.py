"""Double-buffered KV staging (issue 16): a swapped micro-batch finds its blocks in staging,
copied ahead while the one before it attended, under the copy ordering contract the CUDA copy
stream relies on (as `test_store.py` checks it for weights); out-of-plan requests are staged on
demand."""
from __future__ import annotations

import torch

from batchgen_data.worker.kv_tier.staging import KVStaging
from copy_order import OrderChecker

LAYERS, HOST_BLOCKS, BLOCK, HKV, D = 3, 24, 4, 2, 8


def _host_caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return [(torch.randn(HOST_BLOCKS, BLOCK, HKV, D), torch.randn(HOST_BLOCKS, BLOCK, HKV, D))
            for _ in range(LAYERS)]


def _check(staging: KVStaging, caches: list, layer: int, key: int, tables: list[list[int]]
           ) -> None:
    (k, v), used, slot = staging.acquire(layer, key, tables)
    assert used == sorted({b for t in tables for b in t})
    host_k, host_v = caches[layer]
    assert torch.equal(k[:len(used)], host_k[used]) and torch.equal(v[:len(used)], host_v[used])
    staging.release(slot)


def test_planned_micro_batches_are_prefetched_in_order() -> None:
    caches = _host_caches()
    staging = KVStaging(caches, blocks=6, device=torch.device("cpu"))
    checker = OrderChecker(2)
    staging.copier = checker
    batches = [(1, [[0, 1], [5]]), (2, [[7, 8, 9]]), (3, [[20], [21, 22]])]
    for _ in range(2):  # two steps: the plan starts afresh
        staging.plan(batches)
        before = staging.prefetched
        for layer in range(LAYERS):
            for key, tables in batches:
                _check(staging, caches, layer, key, tables)
        # every micro-batch but each step's first was copied while the one before attended
        assert staging.prefetched - before == LAYERS * len(batches) - 1
    # each planned micro-batch was copied exactly once: k and v, one copy each
    assert checker.copies == 2 * 2 * LAYERS * len(batches)
    blocks = sum(len({b for t in tables for b in t}) for _, tables in batches)
    assert staging.bytes_copied == 2 * 2 * LAYERS * blocks * BLOCK * HKV * D * 4


def test_out_of_plan_requests_are_staged_on_demand() -> None:
    caches = _host_caches()
    staging = KVStaging(caches, blocks=6, device=torch.device("cpu"))
    staging.copier = OrderChecker(2)
    batches = [(1, [[0, 1]]), (2, [[3]]), (3, [[4, 6]])]
    staging.plan(batches)
    _check(staging, caches, 0, 1, [[0, 1]])
    _check(staging, caches, 0, 3, [[4, 6]])  # skips batch 2: its prefetch is not used
    _check(staging, caches, 1, 99, [[10, 11]])  # not in the plan at all
    _check(staging, caches, 1, 1, [[0, 1]])
    _check(staging, caches, 1, 2, [[3]])
