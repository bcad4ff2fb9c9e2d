"""The Attention layer's torch and C paths with a sliding window and attention sinks, on a step
of decodes and prefill chunks (with and without a cached prefix), against the torch reference
kernels (`kernels/reference.py`, one sequence at a time, explicit softmax)."""
from __future__ import annotations

import pytest
import torch

from batchgen_data.kernels import reference
from batchgen_data.layers.attention import Attention, AttentionMetadata
from batchgen_data.layers.attention_torch import attend
from batchgen_data.layers.kv_quant import KVScales

BS, KV, GROUP, D = 8, 2, 2, 32
# decodes (KV 30, 9, 1), then prefill chunks: 12 new of 40, 20 fresh, 1 new of 17
Q_LENS, SEQ_LENS, DECODES = [1, 1, 1, 12, 20, 1], [30, 9, 1, 40, 20, 17], 3


def _step():  # type: ignore[no-untyped-def]
    """Caches, the step's metadata and its new tokens' q/k/v (k/v as already cached, so the
    layer's write changes nothing)."""
    torch.manual_seed(0)
    nblk = [-(-n // BS) for n in SEQ_LENS]
    num_blocks = sum(nblk) + 1
    order = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(SEQ_LENS), max(nblk), dtype=torch.int32)
    for i, n in enumerate(nblk):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    k_cache = torch.randn(num_blocks, BS, KV, D)
    v_cache = torch.randn(num_blocks, BS, KV, D)
    slots = torch.cat([tables[i].long()[torch.arange(s - q, s) // BS] * BS
                       + torch.arange(s - q, s) % BS
                       for i, (q, s) in enumerate(zip(Q_LENS, SEQ_LENS))])
    prefill_q = Q_LENS[DECODES:]
    meta = AttentionMetadata(
        slot_mapping=slots, num_decodes=DECODES, block_tables=tables,
        seq_lens=torch.tensor(SEQ_LENS, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0] + prefill_q).cumsum(0).to(torch.int32),
        seq_lens_host=SEQ_LENS, query_lens_host=Q_LENS,
        max_decode_len=max(SEQ_LENS[:DECODES]), max_prefill_len=max(prefill_q))
    width = -(-meta.max_decode_len // BS)
    meta.decode_blocks = tables[:DECODES, :width].reshape(-1).long()
    lens = torch.tensor(SEQ_LENS[:DECODES])
    meta.decode_mask = (torch.arange(width * BS)[None, :] < lens[:, None])[:, None, None, :]
    q = torch.randn(len(slots), KV * GROUP, D)
    k = k_cache.view(-1, KV, D)[slots].clone()
    v = v_cache.view(-1, KV, D)[slots].clone()
    return q, k, v, k_cache, v_cache, meta


def _reference(q, k_cache, v_cache, meta, window, sinks):  # type: ignore[no-untyped-def]
    nd = meta.num_decodes
    dec = reference.paged_decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                           meta.seq_lens[:nd], 0.25, sliding_window=window,
                                           sinks=sinks)
    pre = reference.paged_prefill_attention(q[nd:], k_cache, v_cache, meta.block_tables[nd:],
                                            meta.cu_seqlens_q, meta.seq_lens[nd:], 0.25,
                                            sliding_window=window, sinks=sinks)
    return torch.cat([dec, pre])


@pytest.mark.parametrize("window", [None, 1, 7, 16])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("c_decode", [False, True])
def test_torch_path_window_and_sinks(window: int | None, with_sinks: bool,
                                     c_decode: bool) -> None:
    if c_decode:
        from batchgen_data.kernels.cpu import attention as cpu_attention

        if not cpu_attention.supports(D):
            pytest.skip("no C attention kernel here")
    q, k, v, k_cache, v_cache, meta = _step()
    sinks = torch.randn(KV * GROUP) * 2 if with_sinks else None
    out = attend(q, k, v, k_cache, v_cache, meta, 0.25, c_decode, KVScales(), window,
                           sinks)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, meta, window, sinks),
                               rtol=1e-5, atol=1e-5)


def test_layer_holds_its_window_and_sinks() -> None:
    layer = Attention(4, 2, D, 0.25, 0, sliding_window=7, sinks=True)
    assert layer.sliding_window == 7 and layer.sinks.shape == (4,)
    assert Attention(4, 2, D, 0.25, 0).sinks is None
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(4, 2, D, 0.25, 0, sliding_window=0)
