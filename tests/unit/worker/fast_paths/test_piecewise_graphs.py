"""Piecewise (mixed-step) CUDA graphs, checked on the CPU through a capture seam that behaves like
a CUDA graph (`tests/recording_capture.py`: a piece's aten ops recorded and replayed on the same
tensors; a host read inside a piece fails). An engine whose every step runs through those
replays, the attention eagerly between them, must give HF `generate`'s greedy tokens."""
from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from batchgen_data.worker.fast_paths.piecewise_graphs import MixedGraphs, token_sizes
from batchgen_data.layers.attention import Attention
from recording_capture import RecordingPieces


def test_token_sizes() -> None:
    assert token_sizes(2048) == [8, 16, 32, 64, 128, 256, 512]
    assert token_sizes(100) == [8, 16, 32, 64]
    assert token_sizes(3) == [8]


def test_recording_refuses_a_host_read() -> None:
    cap = RecordingPieces()
    x = torch.ones(3)
    cap.begin()
    with pytest.raises(RuntimeError, match="host read"):
        float(x.sum())
    cap.end()


def test_recording_replays_on_fresh_inputs() -> None:
    """The seam itself: a replay recomputes from the recorded tensors' current values (through
    views, in-place ops, and a reshape that had to copy), and a host value read at capture stays
    frozen (as in a CUDA graph)."""
    x = torch.arange(4.0)
    acc = torch.zeros(4)
    scale = 2.0
    cap = RecordingPieces()
    cap.begin()
    y = (x * scale).exp().sum(0, keepdim=True)
    acc += x.view(2, 2).t().reshape(-1)  # not a view of x: reshape copies here
    replay = cap.end()
    x.copy_(torch.tensor([1.0, 0.0, 0.0, 3.0]))
    acc.zero_()
    scale = 100.0
    replay()
    torch.testing.assert_close(y, (x * 2.0).exp().sum(0, keepdim=True))
    torch.testing.assert_close(acc, torch.tensor([1.0, 0.0, 0.0, 3.0]))


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@contextlib.contextmanager
def _counting(graphs: MixedGraphs, steps: list[tuple[int, int]]) -> Iterator[None]:
    """Record (tokens, decodes) of every step the graphs run."""
    run = graphs.run

    def counted(inp):  # type: ignore[no-untyped-def]
        steps.append((inp.input_ids.shape[0], inp.meta.num_decodes))
        return run(inp)
    graphs.run = counted  # type: ignore[method-assign]
    yield


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_engine_through_piecewise_graphs_matches_hf(arch: str, tiny_model_dir, hf_model
                                                    ) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    path = tiny_model_dir(arch)
    # torch kernels only: every op of a piece is an aten op the recording sees; every step of
    # at most 16 tokens fits a captured size
    llm = LLM(str(path), block_size=4, max_num_seqs=6, max_model_len=96, dtype="float32",
              max_num_batched_tokens=16, cpu_kernels=False)
    runner = llm.engine.runner
    cap = RecordingPieces()
    graphs = MixedGraphs(runner.model, runner.kv_caches, 16, runner.device, cap)
    assert graphs.sizes == [8, 16] and graphs.num_attention == 2
    runner.fast_paths = [graphs]
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 30))] for _ in range(8)]
    max_tokens = [rng.randint(2, 9) for _ in prompts]
    steps: list[tuple[int, int]] = []
    with _counting(graphs, steps):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                             for m in max_tokens], use_tqdm=False)
    hf = hf_model(path)
    for p, m, o in zip(prompts, max_tokens, outs):
        assert list(o.outputs[0].token_ids) == _hf_greedy(hf, p, m)
    # steps mixing decodes with prefill chunks, chunks alone, decodes alone, and sizes padded
    assert any(0 < d < t for t, d in steps), steps
    assert any(d == 0 for t, d in steps) and any(d == t for t, d in steps)
    assert {t for t, _ in steps} - {8, 16}, steps
    assert cap.replays == len(steps) * 3  # layers + 1 pieces a step


def test_capture_cuts_every_attention_call(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """A model that calls an attention layer outside the cuts (here: one hidden from the count)
    is refused at capture rather than replayed with a stale attention."""
    llm = LLM(str(tiny_model_dir("qwen2")), block_size=4, max_num_seqs=2, max_model_len=32,
              dtype="float32", max_num_batched_tokens=8, cpu_kernels=False)
    runner = llm.engine.runner
    model = runner.model
    model.extra = Attention(4, 2, 16, 0.25, 0)  # counted among the layers, never called
    with pytest.raises(RuntimeError, match="cut 2 attention calls of 3"):
        MixedGraphs(model, runner.kv_caches, 8, runner.device, RecordingPieces())
