"""MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral) give HF `generate`'s greedy tokens (fp32, CPU):
mixed prompt lengths, small prefill chunks, forced preemption, prefix-cache hits, steps where
most experts get no token, `norm_topk_prob` off, dense layers mixed in, and a running sequence
exported from one engine and imported into another."""
from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from batchgen_data.kernels.cpu import moe as cpu_moe
from engine_seams import watch_steps

# tiny configs: hidden 64, 2-3 layers, a few experts of width 32
_COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, eos_token_id=2, bos_token_id=0, pad_token_id=0,
               tie_word_embeddings=False)
CONFIGS: dict[str, Callable[[int], object]] = {
    # layer 1 dense (mlp_only_layers), renormalised top-2 of 8
    "qwen3_moe": lambda vocab: __import__("transformers").Qwen3MoeConfig(
        vocab_size=vocab, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], head_dim=16, **_COMMON),
    # 16 experts and top-2 (most idle in a decode step), weights not renormalised, shared expert
    "qwen2_moe": lambda vocab: __import__("transformers").Qwen2MoeConfig(
        vocab_size=vocab, intermediate_size=96, moe_intermediate_size=32, num_experts=16,
        num_experts_per_tok=2, norm_topk_prob=False, shared_expert_intermediate_size=48,
        **_COMMON),
    "mixtral": lambda vocab: __import__("transformers").MixtralConfig(
        vocab_size=vocab, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        **_COMMON),
}


def build_moe_model(arch: str, path: Path, vocab: int) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(sorted(CONFIGS).index(arch) + 10)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch](vocab)).eval()
    # random init gives near-flat logits and router scores; widen them so that greedy and
    # top-k ties are vanishingly rare
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_model(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Factory: arch -> (model dir, HF model), built once per module."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple[Path, object]] = {}

    def make(arch: str) -> tuple[Path, object]:
        if arch not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            tok_src = tiny_model_dir("llama")  # reuse the session's tiny tokenizer
            for f in tok_src.glob("*token*"):
                shutil.copy(f, path / f.name)
            build_moe_model(arch, path, vocab=300)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[arch] = (path, hf)
        return cache[arch]

    return make


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def prompts_with_shared_prefix(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(13)]
    mixed = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    return mixed + [system + [rng.randrange(3, 300) for _ in range(rng.randint(1, 6))]
                    for _ in range(2)]


CASES = {
    "plain": dict(block_size=4),
    "tiny_chunks": dict(max_num_batched_tokens=7, block_size=4),
    "preemption": dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=64),
}


def check_greedy_case(llm: LLM, hf, case: str) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Mixed-length prompts give HF's greedy tokens under `case`'s engine settings; the last
    prompt runs after the others, so its shared prefix blocks are cache hits; "preemption"
    preempts. Returns each step's tokens-per-expert counts."""
    prompts = prompts_with_shared_prefix(seed=len(case))
    max_tokens = [random.Random(i).randint(4, 16) for i in range(len(prompts))]
    steps: list[torch.Tensor] = []
    load = llm.engine.stats.tokens_per_expert
    record = load.record
    load.record = lambda counts: (steps.append(counts), record(counts))  # type: ignore[method-assign]
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:5]],
                         [greedy(m) for m in max_tokens[:5]], use_tqdm=False)
    hits = llm.engine.pool.hits
    last = llm.generate([{"prompt_token_ids": prompts[5]}], [greedy(max_tokens[5])],
                        use_tqdm=False)
    got = [o.outputs[0].token_ids for o in first + last]
    assert got == [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    if case == "preemption":
        assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.pool.hits > hits  # the last prompt reused the shared prefix
    return steps


@pytest.mark.cpu_kind
@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf(arch: str, case: str, moe_model) -> None:  # type: ignore[no-untyped-def]
    path, hf = moe_model(arch)
    llm = LLM(str(path), **CASES[case])
    steps = check_greedy_case(llm, hf, case)
    # decode steps ran the experts in one C call wherever the kernel builds (AVX2/FMA)
    assert all((layer._c_experts is not None) == cpu_moe.available()
               for layer in llm.engine.runner.model.moe_layers)
    moe = llm.engine.runner.model.moe
    num_layers = len(llm.engine.runner.model.moe_layers)
    assert num_layers == (2 if arch == "qwen3_moe" else 3)
    assert all(c.shape == (num_layers, moe.num_experts) for c in steps)
    # every routed pair is counted once per MoE layer: tokens * top_k
    assert sum(int(c.sum()) for c in steps) == llm.engine.stats.computed_tokens * moe.top_k * num_layers
    if arch == "qwen2_moe":  # 16 experts, top-2: one-sequence decode steps leave most idle
        assert any(int((c == 0).sum()) >= num_layers * 8 for c in steps)
    summary = llm.engine.stats.as_dict()["tokens_per_expert"]
    assert summary["layer_steps"] == len(steps) * num_layers
    assert summary["min"] <= summary["mean"] <= summary["max"]
    total = sum(int(c.sum()) for c in steps)
    assert summary["mean"] == pytest.approx(total / moe.num_experts / (len(steps) * num_layers))


def check_torch_backend(path: Path, hf) -> None:  # type: ignore[no-untyped-def]
    """The torch-only layers (no C kernels) give HF's greedy tokens too."""
    prompts = prompts_with_shared_prefix(seed=3)[:4]
    outs = LLM(str(path), cpu_kernels=False).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(10), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in prompts]


def check_export_import(path: Path, include_kv: bool) -> None:
    """Sequences exported mid-generation (greedy and seeded sampling) and imported into an
    engine with another block size finish with the tokens of an unmoved run."""
    import pickle

    prompts = prompts_with_shared_prefix(seed=4)[:3]
    params = [greedy(14), SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=5,
                                          ignore_eos=True), greedy(9)]
    ref = LLM(str(path)).generate([{"prompt_token_ids": p} for p in prompts], params,
                                  use_tqdm=False)
    src, dst = LLM(str(path)).engine, LLM(str(path), block_size=8).engine
    rids = [src.submit(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(4):
        assert not src.step()
    states = [pickle.loads(pickle.dumps(src.export(r, include_kv=include_kv))) for r in rids]
    assert all(len(s["seqs"][0]["output_token_ids"]) > 0 for s in states)
    for st in states:
        dst.import_(st)
    done = {}
    while dst.has_unfinished():
        for o in dst.step():
            done[o.request_id] = o.outputs[0].token_ids
    assert [done[r] for r in rids] == [o.outputs[0].token_ids for o in ref]


def test_torch_only_backend_gives_the_same_tokens(moe_model) -> None:  # type: ignore[no-untyped-def]
    check_torch_backend(*moe_model("qwen2_moe"))


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_torch_experts_with_the_other_c_kernels_give_the_same_tokens(
        arch: str, moe_model, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(cpu_moe, "available", lambda: False)  # experts on torch's matmuls
    path, hf = moe_model(arch)
    llm = LLM(str(path), **CASES["tiny_chunks"])
    assert all(layer._c_experts is None for layer in llm.engine.runner.model.moe_layers)
    check_greedy_case(llm, hf, "tiny_chunks")


@pytest.mark.parametrize("include_kv", [False, True])
def test_export_import_mid_generation(moe_model, include_kv: bool) -> None:  # type: ignore[no-untyped-def]
    check_export_import(moe_model("qwen3_moe")[0], include_kv)


def test_per_expert_budget_bounds_the_step(moe_model, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:  # type: ignore[no-untyped-def]
    path, hf = moe_model("mixtral")  # 4 experts, top-2: 3 tokens per expert -> 6 per step
    llm = LLM(str(path), max_tokens_per_expert=3, block_size=4)
    assert llm.engine.scheduler.token_budget == 6
    shapes = watch_steps(llm.engine, monkeypatch)
    prompts = prompts_with_shared_prefix(seed=6)[:3]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6), use_tqdm=False)
    assert 0 < max(s.num_new_tokens for s in shapes) <= 6
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_attention_micro_batches_keep_tokens(moe_model, monkeypatch: pytest.MonkeyPatch,
                                             cpu_kernels: bool) -> None:  # type: ignore[no-untyped-def]
    from batchgen_data.layers import micro_batch
    from batchgen_data.worker import model_runner

    path, hf = moe_model("qwen3_moe")
    groups: list[list[int]] = []
    split = micro_batch.split_by_sequences

    def spy(meta, max_seqs):  # type: ignore[no-untyped-def]
        parts = split(meta, max_seqs)
        groups.append([len(p.meta.query_lens_host) for p in parts])
        return parts

    monkeypatch.setattr(model_runner, "split_by_sequences", spy)  # the runner lays them out
    # small chunks: steps mix decodes and prefill chunks, cut into groups of two sequences
    llm = LLM(str(path), attention_micro_batch_seqs=2, max_num_batched_tokens=9, block_size=4,
              cpu_kernels=cpu_kernels)
    prompts = prompts_with_shared_prefix(seed=8)
    max_tokens = [random.Random(i).randint(4, 12) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [greedy(m) for m in max_tokens], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, m)
                                                      for p, m in zip(prompts, max_tokens)]
    assert any(len(g) >= 2 for g in groups) and all(max(g) <= 2 for g in groups)


def test_micro_batches_are_for_moe_models_only(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="MoE models only"):
        LLM(str(tiny_model_dir("llama")), attention_micro_batch_seqs=2)


def test_graph_padding_rows_are_not_counted(moe_model) -> None:  # type: ignore[no-untyped-def]
    """Pure-decode steps through the CUDA-graph fast path (its static buffers, replayed eagerly
    here: the capture seam) pad the batch to a captured size; the padded rows are routed but
    the engine's tokens per expert count only the real ones: each step's counts equal those of
    the plain engine on the same prompts."""
    pytest.importorskip("triton")
    from batchgen_data.worker.fast_paths.cuda_graphs import DecodeGraphs, eager_capture
    from engine_seams import triton_llm

    path, _ = moe_model("qwen3_moe")
    kw = dict(block_size=4, max_num_seqs=5, max_model_len=64, dtype="float32")
    prompts = [[random.Random(i).randrange(3, 290) for _ in range(3 + i)] for i in range(5)]
    max_tokens = [2, 6, 3, 5, 4]  # 5, 4, 3, 2 then 1 decoding: 3 pads to 4

    def per_step(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
        steps: list[list[int]] = []
        load = llm.engine.stats.tokens_per_expert
        record = load.record
        load.record = lambda c: (steps.append(c.sum(0).tolist()), record(c))  # type: ignore
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [greedy(m) for m in max_tokens], use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], steps

    want_tokens, want = per_step(LLM(str(path), **kw))
    llm = triton_llm(str(path), **kw)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, 5, 64, 4, runner.device,
                          capture=eager_capture)
    runner.fast_paths = [graphs]
    runner.take_expert_tokens()  # the captures' own forwards
    padded = []
    run = graphs.run
    graphs.run = lambda inp: (padded.append(inp.input_ids.shape[0]), run(inp))[1]  # type: ignore
    got_tokens, got = per_step(llm)
    assert 3 in padded, padded  # a step of 3 ran as a graph of 4
    assert got_tokens == want_tokens
    assert got == want


def test_overlapped_steps_count_every_routed_row_once(moe_model) -> None:  # type: ignore[no-untyped-def]
    """With `async_scheduling` a step's expert counts are taken on the device thread right
    after its launch, so the next step's layers (running while this step's results are read)
    add to the next step's counts: over the job, the counts are exactly top_k x MoE layers x
    the rows the model ran (rows of sequences that stopped a step earlier included: they run),
    and the tokens equal the synchronous engine's."""
    path, _ = moe_model("qwen3_moe")
    prompts = prompts_with_shared_prefix(seed=3)
    params = [greedy(random.Random(i).randint(4, 12)) for i in range(len(prompts))]
    items = [{"prompt_token_ids": p} for p in prompts]
    want = [o.outputs[0].token_ids for o in LLM(str(path), block_size=4).generate(
        items, params, use_tqdm=False)]
    llm = LLM(str(path), block_size=4, async_scheduling=True)
    runner, rows = llm.engine.runner, [0]
    run = runner.run
    runner.run = lambda inp: (rows.__setitem__(0, rows[0] + inp.input_ids.shape[0]),  # type: ignore
                              run(inp))[1]
    counted = [0]
    load = llm.engine.stats.tokens_per_expert
    record = load.record
    load.record = lambda c: (counted.__setitem__(0, counted[0] + int(c.sum())), record(c))  # type: ignore
    got = [o.outputs[0].token_ids for o in llm.generate(items, params, use_tqdm=False)]
    assert got == want
    llm.close()  # the step launched past the last output ends (its rows dropped)
    model = runner.model
    assert llm.engine.stats.overlapped_steps > 0
    assert counted[0] == rows[0] * model.moe.top_k * len(model.moe_layers)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_piecewise_graphs_route_and_count_real_rows(arch: str, moe_model) -> None:  # type: ignore[no-untyped-def]
    """Every step (prefill chunks and decodes mixed, padded to 8 or 16 tokens) through piecewise
    graphs on the recording capture seam (tests/recording_capture.py: a piece's aten ops replayed
    on the same tensors, a host read inside a piece refused): HF's greedy tokens, and the expert
    counts of each step are top_k x MoE layers x the step's real rows (padding routed, not
    counted)."""
    from recording_capture import RecordingPieces

    from batchgen_data.worker.fast_paths.piecewise_graphs import MixedGraphs

    path, hf = moe_model(arch)
    llm = LLM(str(path), block_size=4, max_num_seqs=5, max_model_len=64, dtype="float32",
              max_num_batched_tokens=16, cpu_kernels=False)
    runner = llm.engine.runner
    graphs = MixedGraphs(runner.model, runner.kv_caches, 16, runner.device, RecordingPieces())
    runner.fast_paths = [graphs]
    runner.take_expert_tokens()  # the captures' own forwards
    rows: list[int] = []
    run = graphs.run
    graphs.run = lambda inp: (rows.append(inp.input_ids.shape[0]), run(inp))[1]  # type: ignore
    counts: list[int] = []
    load = llm.engine.stats.tokens_per_expert
    record = load.record
    load.record = lambda c: (counts.append(int(c.sum())), record(c))  # type: ignore
    prompts = [[random.Random(i).randrange(3, 290) for _ in range(3 + 4 * i)] for i in range(5)]
    max_tokens = [2, 6, 3, 5, 4]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [greedy(m) for m in max_tokens], use_tqdm=False)
    for p, m, o in zip(prompts, max_tokens, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(hf, p, m)
    model = runner.model
    assert any(n not in graphs.sizes for n in rows), rows  # some steps padded
    assert counts == [n * model.moe.top_k * len(model.moe_layers) for n in rows]
