"""Decode CUDA graphs, checked on the CPU: size bucketing, static-buffer padding, and a whole
engine run in which every pure-decode step goes through the static buffers of `DecodeGraphs`
(replayed eagerly with the Triton kernels under the interpreter) and still yields the tokens of
the plain eager torch path. Only the graph capture itself is left for a GPU."""
from __future__ import annotations

import random

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from batchgen_data.worker.fast_paths.cuda_graphs import (
    BATCH_SIZES,
    DecodeGraphs,
    GraphBuffers,
    capture_sizes,
    eager_capture,
    padded_size,
)
from engine_seams import triton_llm
from batchgen_data.worker.model_input import ModelInput
from batchgen_data.layers.attention import AttentionMetadata


def _input(n: int, meta: AttentionMetadata) -> ModelInput:
    return ModelInput(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), meta,
                      torch.arange(n), [], list(range(n)))


@pytest.mark.parametrize("max_seqs, want", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (100, [1, 2, 4, 8, 16, 32, 64, 100]),
    (256, list(BATCH_SIZES)), (1000, list(BATCH_SIZES)),
])
def test_capture_sizes(max_seqs: int, want: list[int]) -> None:
    assert capture_sizes(max_seqs) == want


def test_padded_size() -> None:
    sizes = capture_sizes(100)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 64, 65, 100)] == [1, 2, 4, 8, 64, 100, 100]
    assert padded_size(101, sizes) is None


def _decode_meta(slots: list[int], tables: list[list[int]], lens: list[int]) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decodes=len(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens_q=torch.zeros(1, dtype=torch.int32), seq_lens_host=lens,
        query_lens_host=[1] * len(lens), max_decode_len=max(lens), max_prefill_len=0)


def test_buffers_load_pads_rows_and_keeps_width() -> None:
    buf = GraphBuffers.allocate(8, max_blocks=5, device=torch.device("cpu"))
    big = _decode_meta([1, 2, 3, 4, 5], [[9] * 5] * 5, [80] * 5)
    buf.load(torch.arange(5) + 10, torch.arange(5) + 20, big, batch=8)
    meta = _decode_meta([7, 33, 41], [[1, 2], [3, 0], [4, 5]], [30, 20, 17])
    buf.load(torch.tensor([5, 6, 7]), torch.tensor([29, 19, 16]), meta, batch=4)
    assert buf.input_ids[:4].tolist() == [5, 6, 7, 0]
    assert buf.positions[:4].tolist() == [29, 19, 16, 0]
    assert buf.slot_mapping[:4].tolist() == [7, 33, 41, -1]  # padding: no KV write
    assert buf.seq_lens[:4].tolist() == [30, 20, 17, 0]  # padding: zero-length attention
    assert buf.block_tables[:3, :2].tolist() == [[1, 2], [3, 0], [4, 5]]
    assert buf.block_tables.shape == (8, 5)  # fixed width whatever the step's width
    g = buf.metadata(4)
    assert g.block_tables.shape == (4, 5) and g.num_decodes == 4
    assert g.seq_lens_host == [] and g.query_lens_host == []  # no host values in a graph
    assert g.block_tables.data_ptr() == buf.block_tables.data_ptr()


def test_graphs_decline_steps_without_a_graph() -> None:
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.sizes, graphs.max_blocks = [1, 2], 4
    prefill = _decode_meta([1, 2], [[0], [1]], [2, 2])
    prefill.num_decodes = 1  # one decode and one prefill token
    assert not graphs.applies(_input(2, prefill))
    three = _decode_meta([1, 2, 3], [[0]] * 3, [1] * 3)
    assert not graphs.applies(_input(3, three))
    wide = _decode_meta([1], [[0] * 5], [70])
    assert not graphs.applies(_input(1, wide))
    assert graphs.applies(_input(2, _decode_meta([1, 2], [[0], [1]], [2, 2])))


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int]
              ) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens, and the logprob of every generated token (flattened)."""
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=0)
              for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    lps = [lp[t] for o in outs for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
    return tokens, lps


def test_engine_through_graph_buffers_matches_eager(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    torch.set_num_threads(1)
    path = str(tiny_model_dir("qwen2"))
    kw = dict(block_size=4, max_num_seqs=5, max_model_len=64, dtype="float32")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(2, 9))] for _ in range(5)]
    max_tokens = [2, 6, 3, 5, 4]  # the decode batch shrinks 5 -> 4 -> 3 -> 2 -> 1
    want, want_lp = _generate(LLM(path, **kw), prompts, max_tokens)

    llm = triton_llm(path, **kw)  # the model's layers are built for the Triton kernels
    runner = llm.engine.runner
    assert runner.backend.triton and runner.fast_paths == []  # no CUDA here: nothing captured
    graphs = DecodeGraphs(runner.model, runner.kv_caches, 5, 64, 4, runner.device,
                          capture=eager_capture)
    runner.fast_paths = [graphs]
    assert runner.graphs is graphs and graphs.sizes == [1, 2, 4, 5]
    replays = {b: 0 for b in graphs.sizes}
    for b, fn in list(graphs._replay.items()):
        def counted(b: int = b, fn=fn) -> None:  # type: ignore[no-untyped-def]
            replays[b] += 1
            fn()
        graphs._replay[b] = counted
    got, got_lp = _generate(llm, prompts, max_tokens)
    assert got == want
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-4, rtol=1e-4)
    assert all(replays[b] > 0 for b in (4, 5)), replays
