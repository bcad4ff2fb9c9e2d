"""Paged decode / prefill attention launchers vs. the torch reference; the reference vs. SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from batchgen_data.kernels import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
    reference,
    write_kv_cache,
)
from batchgen_data.kernels._attention_checks import pick_num_splits  # noqa: E402
from kernel_test_utils import assert_close  # noqa: E402

KV_HEADS = 2


def _paged_cache(seq_lens: list[int], block_size: int, head_dim: int, dtype: torch.dtype):
    """Random caches plus block tables that scatter each sequence over shuffled blocks."""
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    owners = torch.randperm(num_blocks).tolist()
    block_tables = torch.zeros(len(seq_lens), max(per_seq) + 1, dtype=torch.int32)  # 0-padded
    for i, count in enumerate(per_seq):
        block_tables[i, :count] = torch.tensor([owners.pop() for _ in range(count)])
    shape = (num_blocks, block_size, KV_HEADS, head_dim)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    return k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


DECODE_CASES = [  # block_size, group (GQA ratio), head_dim, dtype, num_splits
    (16, 1, 32, torch.float32, 1),
    (32, 3, 32, torch.float16, 1),
    (16, 4, 32, torch.float32, 3),
    (32, 4, 24, torch.float16, 2),
    (16, 3, 64, torch.float32, 2),
]


@pytest.mark.parametrize("block_size, group, head_dim, dtype, num_splits", DECODE_CASES)
def test_decode(block_size: int, group: int, head_dim: int, dtype: torch.dtype,
                num_splits: int) -> None:
    k_cache, v_cache, tables, lens = _paged_cache([1, 17, 100, 33], block_size, head_dim, dtype)
    q = torch.randn(4, KV_HEADS * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_heads_in_blocks(monkeypatch: pytest.MonkeyPatch, num_splits: int) -> None:
    # MLA's shape in small: one KV head, many query heads, a wide head dim. A program then
    # takes a block of the group's heads (whole-group tiles of 128 x 1024 would not fit an
    # H200's shared memory); a small tile budget makes the blocks several here, one partial
    from batchgen_data.kernels import attention

    monkeypatch.setattr(attention, "DECODE_TILE_ELEMS", 16 * 128)  # 16 heads of a 128 tile
    k_cache, v_cache, tables, lens = _paged_cache([1, 40, 23], 16, 72, torch.float32)
    k_cache, v_cache = k_cache[:, :, :1].contiguous(), v_cache[:, :, :1].contiguous()
    q = torch.randn(3, 40, 72)  # 40 heads: blocks of 16, 16 and 8
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, num_splits=num_splits)
    assert_close(out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1))


def test_decode_zero_length_and_default_splits() -> None:
    k_cache, v_cache, tables, lens = _paged_cache([0, 5], 16, 32, torch.float32)
    q = torch.randn(2, 4, 32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125))


PREFILL_CASES = [  # block_size, group, dtype
    (16, 1, torch.float32),
    (32, 3, torch.float16),
    (16, 4, torch.float32),
    (32, 4, torch.float16),
]
PREFIX = ([40, 17, 5, 70, 9], [8, 1, 5, 33, 0])  # seq_lens, q_lens (cached prefix before them)
NO_PREFIX = ([1, 20, 37], [1, 20, 37])


@pytest.mark.parametrize("lens", [PREFIX, NO_PREFIX], ids=["prefix", "no_prefix"])
@pytest.mark.parametrize("block_size, group, dtype", PREFILL_CASES)
def test_prefill(block_size: int, group: int, dtype: torch.dtype, lens) -> None:
    seq_lens, q_lens = lens
    k_cache, v_cache, tables, seq_lens_t = _paged_cache(seq_lens, block_size, 32, dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(q_lens), KV_HEADS * group, 32).to(dtype)
    args = (q, k_cache, v_cache, tables, cu, seq_lens_t, 32**-0.5)
    out = paged_prefill_attention(*args, max_seqlen_q=max(q_lens))
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, reference.paged_prefill_attention(*args))


def test_prefill_of_one_token_equals_decode() -> None:
    k_cache, v_cache, tables, lens = _paged_cache([23, 48], 16, 32, torch.float32)
    q = torch.randn(2, 6, 32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    decode = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2, num_splits=2)
    prefill = paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.2)
    assert_close(prefill, decode)


def test_write_then_prefill_matches_dense_causal_sdpa() -> None:
    """End to end against torch's own attention: scatter K/V into pages, then attend."""
    seq_len, heads, head_dim, block_size = 37, 6, 32, 16
    q = torch.randn(seq_len, heads, head_dim)
    k = torch.randn(seq_len, KV_HEADS, head_dim)
    v = torch.randn(seq_len, KV_HEADS, head_dim)
    k_cache = torch.zeros(5, block_size, KV_HEADS, head_dim)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.tensor([[4, 0, 2]], dtype=torch.int32)
    pos = torch.arange(seq_len)
    slots = tables[0].long()[pos // block_size] * block_size + pos % block_size
    write_kv_cache(k, v, k_cache, v_cache, slots)
    cu = torch.tensor([0, seq_len], dtype=torch.int32)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, head_dim**-0.5)
    group = heads // KV_HEADS
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1), is_causal=True,
    ).transpose(0, 1)
    assert_close(out, expected)
    assert_close(reference.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens,
                                                   head_dim**-0.5), expected)


def test_num_splits_heuristic(monkeypatch: pytest.MonkeyPatch) -> None:
    class _Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Props())
    cuda = torch.device("cuda")
    assert pick_num_splits(None, 4, 2048, cuda) == 8  # capped by >= 256 tokens per split
    assert pick_num_splits(None, 1, 10**6, cuda) == 16  # capped by the split limit
    assert pick_num_splits(None, 32, 10**6, cuda) == 16  # 32 * 8 = 256 < 264 programs
    assert pick_num_splits(None, 512, 4096, cuda) == 1  # the batch alone fills the GPU
    assert pick_num_splits(None, 4, 300, cuda) == 1  # too short to be worth splitting
    assert pick_num_splits(None, 4, 4096, torch.device("cpu")) == 1
    assert pick_num_splits(5, 4, 4096, cuda) == 5


def _decode_args(**override):
    k_cache, v_cache, tables, lens = _paged_cache([3, 9], 16, 32, torch.float32)
    args = dict(q=torch.randn(2, 4, 32), k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                seq_lens=lens, scale=0.5)
    args.update(override)
    return args


@pytest.mark.parametrize(
    "override, match",
    [
        ({"q": torch.randn(2, 5, 32)}, "multiple of num_kv_heads"),
        ({"q": torch.randn(2, 4, 32).half()}, "k_cache dtype"),
        ({"q": torch.randn(2, 4, 16)}, "head_dim"),
        ({"block_tables": torch.zeros(2, 3, dtype=torch.int64)}, "block_tables dtype"),
        ({"block_tables": torch.zeros(3, 3, dtype=torch.int32)}, "block_tables has 3 rows"),
        ({"seq_lens": torch.tensor([3], dtype=torch.int32)}, "seq_lens must have shape"),
        ({"scale": 0.0}, "scale"),
        ({"num_splits": 0}, "num_splits"),
    ],
)
def test_decode_validation(override: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**_decode_args(**override))


@pytest.mark.parametrize(
    "cu, match",
    [
        (torch.tensor([0, 1, 2]), "cu_seqlens_q dtype"),
        (torch.tensor([0, 1], dtype=torch.int32), "block_tables has 2 rows"),
    ],
)
def test_prefill_validation(cu: torch.Tensor, match: str) -> None:
    args = _decode_args()
    args.pop("num_splits", None)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(args["q"], args["k_cache"], args["v_cache"],
                                args["block_tables"], cu, args["seq_lens"], args["scale"])
