"""Module-based batching over a step larger than the device KV cache (issue 16).

A step's sequences are cut into micro-batches; each micro-batch's KV lives either in the device
cache or in the host tier (`kv_tier.py`). `forward` runs the decoder layer by layer: attention
per micro-batch (device micro-batches attend in the device cache; host ones are routed through
the tier's caches, staged in or attended on the host as `choose_mode` decides), the hidden
states of all micro-batches accumulate, and then each layer's MLP (dense or the experts) runs
once over the whole step. So a streamed layer's weights serve every sequence of the step, however
many of them the device KV could hold. The layer loop is the model's own
(`DecoderForCausalLM.forward` given `parts`): the schedule `MoeForCausalLM.forward` runs with
`attention_micro_batch_seqs`, for dense and MoE decoders alike, with each micro-batch's
metadata naming where its KV is.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from batchgen_data.layers.micro_batch import AttentionPart
from batchgen_data.worker.offload.kv_tier import HostKVCaches, MicroBatch, Mode, metadata


@dataclass(frozen=True, slots=True)
class Placed:
    """A micro-batch and where its KV is: `mode` None (device cache, device block ids), or
    "swap" / "host" (host tier, host block ids)."""

    batch: MicroBatch
    mode: Mode | None = None


def tier_parts(placed: Sequence[Placed], tier: HostKVCaches, block_size: int,
               device: torch.device, torch_decode: bool) -> list[AttentionPart]:
    """The step's micro-batches, in order (the step's tokens are their tokens one after
    another, each decodes first, then prefill chunks): device ones attend in the step's
    caches, host ones in the tier's (`HostKVCaches.caches_for`) with the tier's metadata."""
    out, start = [], 0
    tier.plan([p.batch for p in placed if p.mode == "swap"])
    for p in placed:
        rows = slice(start, start + sum(p.batch.query_lens))
        if p.mode is None:
            out.append(AttentionPart(rows, metadata(p.batch, block_size, device, torch_decode)))
        else:
            out.append(AttentionPart(rows, tier.metadata_for(p.batch, p.mode),
                                     tier.caches_for(p.batch, p.mode)))
        start = rows.stop
    return out


def forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], parts: list[AttentionPart],
            tier: HostKVCaches | None = None) -> torch.Tensor:
    """Hidden states [T, hidden] of a decoder (`DecoderForCausalLM`): per layer, attention per
    micro-batch of `parts`, then the MLP once over every token of the step (the model's own
    layer loop, given the parts); then the tier's last swapped rows go to the host."""
    try:
        return model(input_ids, positions, kv_caches, parts[0].meta, parts)
    finally:
        if tier is not None:
            tier.flush()
