"""Module-based batching over a step larger than the device KV cache (issue 16).

A step's sequences are cut into micro-batches; each micro-batch's KV lives either in the device
cache or in the host tier (`kv_tier.py`). `forward` runs the decoder layer by layer: attention
per micro-batch (device micro-batches attend in the device cache; host ones are routed through
`KVTierAttention`, swapped in or attended on the host as `choose_mode` decides), the hidden
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
from functools import partial

import torch
from torch import nn

from batchgen_data.layers.attention import Attention, AttentionMetadata
from batchgen_data.offload.kv_tier import KVTierAttention, MicroBatch, Mode, metadata


@dataclass(frozen=True, slots=True)
class Placed:
    """A micro-batch and where its KV is: `mode` None (device cache, device block ids), or
    "swap" / "host" (host tier, host block ids)."""

    batch: MicroBatch
    mode: Mode | None = None


class TierRouter:
    """Sends host micro-batches' attention to `tier`, knowing each attention module's layer."""

    def __init__(self, model: nn.Module, tier: KVTierAttention) -> None:
        self.tier = tier
        self.layer_of = {id(m): i for i, layer in enumerate(model.layers)
                         for m in layer.modules() if isinstance(m, Attention)}

    def route(self, batch: MicroBatch, mode: Mode, attn: Attention, q: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.tier.attend(self.layer_of[id(attn)], attn, q, k, v, batch, mode)

    def parts(self, placed: Sequence[Placed], block_size: int, device: torch.device,
              torch_decode: bool) -> list[tuple[slice, AttentionMetadata]]:
        """(token rows, metadata) of each micro-batch, in order: the step's tokens are the
        micro-batches' tokens one after another (each decodes first, then prefill chunks)."""
        out, start = [], 0
        for p in placed:
            n = sum(p.batch.query_lens)
            if p.mode is None:
                meta = metadata(p.batch, block_size, device, torch_decode)
            else:  # the route attends; the metadata only says where to send it
                meta = metadata(p.batch, block_size, torch.device("cpu"), False)
                meta.kv_route = partial(self.route, p.batch, p.mode)
            out.append((slice(start, start + n), meta))
            start += n
        return out


def forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            parts: list[tuple[slice, AttentionMetadata]]) -> torch.Tensor:
    """Hidden states [T, hidden] of a decoder (`DecoderForCausalLM`): per layer, attention per
    micro-batch of `parts`, then the MLP once over every token of the step (the model's own
    layer loop, given the parts)."""
    return model(input_ids, positions, kv_caches, parts[0][1], parts)
