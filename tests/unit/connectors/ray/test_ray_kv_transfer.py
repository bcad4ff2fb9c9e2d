"""What the coordinator learns about KV transfers, without Ray: it counts KV that reaches it
inline in mail (`kv_bytes_relayed`, 0 when owners send ObjectRefs) and sums the engines'
reported transfer totals, also of engines that stopped reporting."""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from batchgen_data.connectors.ray.coordinator import Coordinator, Report, kv_nbytes
from batchgen_data.placement import EngineLoad

IDLE = EngineLoad("", waiting=0, running=0, held=0, remaining_tokens_est=0, free_blocks=100,
                  total_blocks=100, max_num_seqs=2, block_size=16)


def state_with_kv(layers: int, tokens: int) -> dict:
    kv = [(torch.zeros(tokens, 2, 4), torch.zeros(tokens, 2, 4)) for _ in range(layers)]
    return {"request_id": "r", "seqs": [{"index": 0, "kv": kv}, {"index": 1, "kv": None}]}


def test_kv_nbytes_counts_every_layer_of_every_sequence() -> None:
    assert kv_nbytes(state_with_kv(3, 5)) == 3 * 2 * 5 * 2 * 4 * 4  # fp32
    assert kv_nbytes({"request_id": "r", "seqs": [{"index": 0}]}) == 0  # a queued row


def test_inline_kv_in_mail_is_counted_and_a_handle_is_not() -> None:
    c = Coordinator()
    load = replace(IDLE, engine_id="a")
    c.exchange(Report(replace(IDLE, engine_id="b")), [])
    c.exchange(Report(load), [("b", ("import", "a", object(), "r1"))])  # stands for an ObjectRef
    assert c.stats()["kv_bytes_relayed"] == 0
    c.exchange(Report(load), [("b", ("import", "a", state_with_kv(2, 3), "r2"))])
    assert c.stats()["kv_bytes_relayed"] == kv_nbytes(state_with_kv(2, 3)) > 0


def test_transfer_totals_are_summed_over_engines_and_kept_after_they_leave() -> None:
    c = Coordinator(dead_after_s=0.2)
    c.exchange(Report(replace(IDLE, engine_id="a"), kv_bytes_received=100, kv_transfer_s=0.5), [])
    c.exchange(Report(replace(IDLE, engine_id="b"), kv_bytes_received=40, kv_transfer_s=0.25), [])
    # a later report replaces the engine's totals (they are cumulative), never adds to them
    c.exchange(Report(replace(IDLE, engine_id="a"), kv_bytes_received=150, kv_transfer_s=0.75), [])
    assert (c.stats()["kv_bytes_moved"], c.stats()["kv_transfer_s"]) == (190, 1.0)
    time.sleep(0.3)
    c.exchange(Report(replace(IDLE, engine_id="b"), kv_bytes_received=40, kv_transfer_s=0.25), [])
    stats = c.stats()
    assert stats["engines"] == ["b"] and stats["kv_bytes_moved"] == 190
