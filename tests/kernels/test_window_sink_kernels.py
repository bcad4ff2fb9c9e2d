"""Sliding windows and attention sinks in the paged-attention kernels: the Triton decode and
prefill launchers (interpreted) and the C decode kernel against the torch reference, and the
reference itself against identities that do not share its code (a window as long as the
sequence changes nothing; a sink scales each output row by sigmoid(logsumexp - sink)); a
windowed model on the Triton path against the torch path (itself checked against HF in
tests/integration/test_sliding_window_vs_hf.py)."""

from __future__ import annotations

import pytest
import torch

from batchgen_data.kernels import reference
from kernel_test_utils import assert_close

KV_HEADS, GROUP, HEAD_DIM = 2, 2, 32
# decode lengths around block edges; windows of one token, inside a block, across blocks
LENS = [1, 7, 16, 17, 40, 75]
WINDOWS = [1, 5, 16, 23]


def _paged(seq_lens: list[int], block_size: int, dtype: torch.dtype = torch.float32):
    """Random caches with each sequence on shuffled blocks (tables padded with block 0)."""
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    owners = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(seq_lens), max(per_seq) + 1, dtype=torch.int32)
    for i, count in enumerate(per_seq):
        tables[i, :count] = torch.tensor([owners.pop() for _ in range(count)])
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    return (torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), tables,
            torch.tensor(seq_lens, dtype=torch.int32))


def _sinks() -> torch.Tensor:
    return torch.randn(KV_HEADS * GROUP) * 2.0


def test_reference_window_and_sink_identities() -> None:
    k, v, tables, lens = _paged(LENS, 16)
    q = torch.randn(len(LENS), KV_HEADS * GROUP, HEAD_DIM)
    plain = reference.paged_decode_attention(q, k, v, tables, lens, 0.3)
    assert torch.equal(reference.paged_decode_attention(q, k, v, tables, lens, 0.3,
                                                        sliding_window=max(LENS)), plain)
    windowed = reference.paged_decode_attention(q, k, v, tables, lens, 0.3, sliding_window=5)
    assert not torch.allclose(windowed[-1], plain[-1])  # the window changes a long row
    # a window of one: each query attends to its own token only, so the output is its value
    one = reference.paged_decode_attention(q, k, v, tables, lens, 0.3, sliding_window=1)
    for i, n in enumerate(LENS):
        last = tables[i, (n - 1) // 16].long() * 16 + (n - 1) % 16
        want = v.view(-1, KV_HEADS, HEAD_DIM)[last].repeat_interleave(GROUP, 0)
        torch.testing.assert_close(one[i], want)
    # a sink adds exp(sink) to the denominator: out * Z / (Z + exp(sink)), Z the row's sum
    sinks = _sinks()
    got = reference.paged_decode_attention(q, k, v, tables, lens, 0.3, sinks=sinks)
    for i, n in enumerate(LENS):
        pos = torch.arange(n)
        keys = k.view(-1, KV_HEADS, HEAD_DIM)[tables[i].long()[pos // 16] * 16 + pos % 16]
        scores = torch.einsum("hd,nhd->hn", q[i], keys.repeat_interleave(GROUP, 1)) * 0.3
        lse = torch.logsumexp(scores, dim=-1)
        torch.testing.assert_close(got[i], plain[i] * torch.sigmoid(lse - sinks)[:, None])


@pytest.mark.parametrize("num_splits, window, with_sinks", [
    (1, 1, False), (1, 5, True), (1, 23, False), (1, None, True),
    (3, 1, True), (3, 16, False), (3, 23, True), (3, None, False)])
def test_triton_decode(num_splits: int, window: int | None, with_sinks: bool) -> None:
    pytest.importorskip("triton")
    from batchgen_data.kernels import paged_decode_attention

    k, v, tables, lens = _paged(LENS, 16)
    q = torch.randn(len(LENS), KV_HEADS * GROUP, HEAD_DIM)
    sinks = _sinks() if with_sinks else None
    out = paged_decode_attention(q, k, v, tables, lens, 0.2, num_splits=num_splits,
                                 sliding_window=window, sinks=sinks)
    assert_close(out, reference.paged_decode_attention(q, k, v, tables, lens, 0.2,
                                                       sliding_window=window, sinks=sinks))


# (seq_lens, q_lens): a cached prefix before the chunk, chunks longer than the window, a chunk
# of one token
PREFILL = ([40, 70, 9, 33], [8, 50, 9, 1])


@pytest.mark.parametrize("block_size, dtype, window, with_sinks", [
    (16, torch.float32, 1, False), (16, torch.float32, 6, True), (16, torch.float32, 21, False),
    (8, torch.float16, 6, False), (8, torch.float16, 21, True)])
def test_triton_prefill(block_size: int, dtype: torch.dtype, window: int,
                        with_sinks: bool) -> None:
    pytest.importorskip("triton")
    from batchgen_data.kernels import paged_prefill_attention

    seq_lens, q_lens = PREFILL
    k, v, tables, lens = _paged(seq_lens, block_size, dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(q_lens), KV_HEADS * GROUP, HEAD_DIM).to(dtype)
    sinks = _sinks() if with_sinks else None
    out = paged_prefill_attention(q, k, v, tables, cu, lens, 0.2, max_seqlen_q=max(q_lens),
                                  sliding_window=window, sinks=sinks)
    want = reference.paged_prefill_attention(q, k, v, tables, cu, lens, 0.2,
                                             sliding_window=window, sinks=sinks)
    assert_close(out, want)


def test_triton_rejects_bad_window_and_sinks() -> None:
    pytest.importorskip("triton")
    from batchgen_data.kernels import paged_decode_attention

    k, v, tables, lens = _paged([3, 9], 16)
    q = torch.randn(2, KV_HEADS * GROUP, HEAD_DIM)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention(q, k, v, tables, lens, 0.5, sliding_window=-1)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(q, k, v, tables, lens, 0.5, sinks=torch.zeros(3))


def _c_kernel():  # type: ignore[no-untyped-def]
    from batchgen_data.kernels.cpu import attention as cpu_attention

    if not cpu_attention.supports(HEAD_DIM):
        pytest.skip("no C attention kernel here")
    return cpu_attention


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window, with_sinks", [(1, True), (5, False), (16, True), (23, False),
                                                (300, True), (None, True), (None, False)])
def test_c_decode(block_size: int, window: int | None, with_sinks: bool) -> None:
    cpu_attention = _c_kernel()
    lens = LENS + [600]  # several 256-token chunks, merged
    k, v, tables, lens_t = _paged(lens, block_size)
    q = torch.randn(len(lens), KV_HEADS * GROUP, HEAD_DIM)
    sinks = _sinks() if with_sinks else None
    out = cpu_attention.paged_decode(q, k, v, tables, lens_t, 0.2, sliding_window=window,
                                     sinks=sinks)
    want = reference.paged_decode_attention(q, k, v, tables, lens_t, 0.2,
                                            sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_c_decode_fp8_window_and_sinks() -> None:
    cpu_attention = _c_kernel()
    k, v, tables, lens = _paged(LENS, 16)
    k8, v8 = reference.fp8_codes(k, 0.05), reference.fp8_codes(v, 0.04)
    q = torch.randn(len(LENS), KV_HEADS * GROUP, HEAD_DIM)
    sinks = _sinks()
    out = cpu_attention.paged_decode(q, k8, v8, tables, lens, 0.2, 0.05, 0.04, sliding_window=5,
                                     sinks=sinks)
    want = reference.paged_decode_attention(q, k8, v8, tables, lens, 0.2, k_scale=0.05,
                                            v_scale=0.04, sliding_window=5, sinks=sinks)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_windowed_model_triton_path_matches_torch_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    import random

    from batchgen_data import LLM, SamplingParams
    from engine_seams import triton_llm
    from tests.conftest import build_tiny_model, build_tokenizer

    torch.set_num_threads(1)
    # layer 0 global, layer 1 windowed; prompts of 2-3 windows, chunked by the token budget
    build_tiny_model("qwen2", tmp_path, vocab_size=len(build_tokenizer(tmp_path)),
                     use_sliding_window=True, sliding_window=6, max_window_layers=1)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (14, 19)]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    kw = dict(block_size=4, max_num_batched_tokens=12, dtype="float32")
    runs = []
    for llm in (LLM(str(tmp_path), **kw), triton_llm(str(tmp_path), **kw)):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        runs.append([(list(o.outputs[0].token_ids),
                      [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                     for o in outs])
    assert runs[1][0][0] and [t for t, _ in runs[1]] == [t for t, _ in runs[0]]
    for (_, got), (_, want) in zip(runs[1], runs[0]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)
