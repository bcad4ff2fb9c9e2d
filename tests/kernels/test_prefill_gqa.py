"""Prefill attention with one program per (query block, kv head, head block): every query head
of a GQA group (or of a block of it) shares each K/V tile the program loads. Against the torch
reference, for groups that fill the q tile's rows evenly, unevenly and in several head blocks,
sequences with cached prefixes of different lengths, and the tiles the launcher picks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen_data.kernels import (  # noqa: E402
    _attention_checks,
    paged_prefill_attention,
    reference,
)
from batchgen_data.kernels._attention_checks import prefill_tiles  # noqa: E402
from batchgen_data.kernels._checks import tile  # noqa: E402
from kernel_test_utils import assert_close, shuffled_block_tables  # noqa: E402

# new tokens after cached prefixes of 40, 0, 8 and 24 tokens, and a sequence with none this step
SEQ_LENS, Q_LENS = [70, 23, 9, 41, 12], [30, 23, 1, 17, 0]


def _batch(kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, block_size: int = 16):
    """(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens), blocks shuffled."""
    tables, num_blocks = shuffled_block_tables(SEQ_LENS, block_size, spare=3)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    cu = torch.tensor([0] + Q_LENS).cumsum(0).to(torch.int32)
    q = torch.randn(sum(Q_LENS), kv_heads * group, head_dim).to(dtype)
    return q, k_cache, v_cache, tables, cu, torch.tensor(SEQ_LENS, dtype=torch.int32)


def _small_tiles(monkeypatch: pytest.MonkeyPatch, head_dim: int, elem_size: int) -> None:
    """Tiles of 16 rows and 16 tokens: many query blocks and KV tiles per sequence."""
    monkeypatch.setattr(_attention_checks, "PREFILL_Q_TILE_BYTES", 16 * tile(head_dim) * elem_size)
    monkeypatch.setattr(_attention_checks, "PREFILL_KV_TILE_BYTES",
                        32 * tile(head_dim) * elem_size)


@pytest.mark.parametrize("tiles", ["launcher", "small"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8, 3])  # 3: rows left over in every q tile
def test_prefill_gqa_matches_reference(monkeypatch: pytest.MonkeyPatch, group: int,
                                       head_dim: int, tiles: str) -> None:
    if tiles == "small":
        _small_tiles(monkeypatch, head_dim, 4)
    args = _batch(2, group, head_dim, torch.float32) + (head_dim**-0.5,)
    out = paged_prefill_attention(*args, max_seqlen_q=max(Q_LENS))
    assert_close(out, reference.paged_prefill_attention(*args))


# (kv heads, group): MLA's one kv head; two, in a number of head blocks that shares a factor
# with theirs (program ids split into (kv head, head block) in any other way then miss some)
@pytest.mark.parametrize("kv_heads, group", [(1, 40), (2, 24)])
@pytest.mark.parametrize("tiles", ["launcher", "small"])
def test_prefill_mla_like_group_in_head_blocks(monkeypatch: pytest.MonkeyPatch, tiles: str,
                                               kv_heads: int, group: int) -> None:
    # MLA in small: a kv head whose one plane is both K and V, many query heads for it, a head
    # dim that is not a power of two. Small tiles cut each group into head blocks of 16 (the
    # last one partial).
    if tiles == "small":
        _small_tiles(monkeypatch, 72, 4)
        assert prefill_tiles(72, group, max(Q_LENS), 4).heads == 16
    q, kv, _, tables, cu, lens = _batch(kv_heads, group, 72, torch.float32)
    out = paged_prefill_attention(q, kv, kv, tables, cu, lens, 0.1)
    assert_close(out, reference.paged_prefill_attention(q, kv, kv, tables, cu, lens, 0.1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_prefill_gqa_half_and_fp8_cache(monkeypatch: pytest.MonkeyPatch,
                                        dtype: torch.dtype) -> None:
    _small_tiles(monkeypatch, 64, 2)
    q, k_cache, v_cache, tables, cu, lens = _batch(2, 4, 64, torch.float16)
    scales = {}
    if dtype == torch.float8_e4m3fn:
        k_cache, v_cache = (k_cache.float() * 8).to(dtype), (v_cache.float() * 2).to(dtype)
        scales = {"k_scale": 0.125, "v_scale": 0.5}
    args = (q, k_cache, v_cache, tables, cu, lens, 0.125)
    out = paged_prefill_attention(*args, max_seqlen_q=max(Q_LENS), **scales)
    assert_close(out, reference.paged_prefill_attention(*args, **scales))


@pytest.mark.parametrize("head_dim", [64, 128, 256, 576])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16, 40, 128])
@pytest.mark.parametrize("max_seqlen_q", [1, 7, 4096])
def test_prefill_tiles(head_dim: int, group: int, max_seqlen_q: int) -> None:
    t = prefill_tiles(head_dim, group, max_seqlen_q, 2)  # bf16
    assert t.rows & (t.rows - 1) == 0 and 16 <= t.rows <= 128 and t.block_n >= 16
    assert 0 <= t.rows - t.heads * t.positions < t.heads  # rows left over: fewer than a token's
    if group <= 16 and head_dim <= 256:
        assert t.heads == group  # each K/V tile read once for the whole group
    else:
        assert t.heads == min(group, t.rows)
    if max_seqlen_q * t.heads <= 16:  # a short chunk: one 16-row tile
        assert t.rows == 16
    # bf16 q, K and V tiles stay under ~100 KB of shared memory (the H200 has 228 KB an SM)
    assert (t.rows + 2 * t.block_n) * tile(head_dim) * 2 <= 100 * 1024


def test_prefill_program_writes_only_its_own_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    # With a group of 3 in 16 rows, a q tile holds 5 tokens and one row left over, which would
    # be the next tile's first token; on a GPU a store of it would race with that tile's. The
    # interpreter runs the next tile later, so let there be none: max_seqlen_q = 5 launches one
    # tile a sequence, and every row past it must stay as allocated.
    _small_tiles(monkeypatch, 64, 4)
    assert prefill_tiles(64, 3, 5, 4).positions == 5
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", nan_empty)
    q, k_cache, v_cache, tables, cu, lens = _batch(2, 3, 64, torch.float32)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125, max_seqlen_q=5)
    monkeypatch.undo()
    want = reference.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125)
    first = torch.cat([torch.arange(s, min(s + 5, e)) for s, e in zip(cu[:-1], cu[1:])])
    rest = torch.ones(len(q), dtype=torch.bool)
    rest[first] = False
    assert_close(out[first], want[first])
    assert out[rest].isnan().all()
