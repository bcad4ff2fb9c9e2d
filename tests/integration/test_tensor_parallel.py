"""Tensor parallelism at TP=2 on the CPU (gloo, two processes): greedy tokens equal HF `generate`
(fp32) for Llama (2 KV heads, a vocabulary not divisible by 2), Qwen2 with one KV head
(replicated, tied and odd vocabulary), Qwen3 and the MoE models (experts split), with chunked prefill, preemption (KV swapped
out and in through the ranks) and prefix-cache hits; export from TP=1 and import at TP=2 (and
back); a killed rank fails the engine fast; a TP size the heads do not allow is refused before
anything starts or loads.

Each engine starts a second process (~10-20 s on a busy 2-core box), so one engine per model
serves several checks. Every collective waits at most `collective_timeout_s`.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from batchgen_data import SamplingParams
from batchgen_data.engine.driver import EngineDeadError
from batchgen_data.engine.engine import Engine

from tests.conftest import build_tiny_model, build_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [40, 41, 42],
           list(range(60, 90)), [7, 300, 12, 99, 5, 64, 2 + 100, 31], list(range(100, 113))]
MAX_TOKENS = 14
# arch -> (overrides of the tiny config, vocabulary size past the tokenizer's)
MODELS = {"llama": (dict(num_key_value_heads=2), 1),  # 401: not divisible by 2
          "qwen2": (dict(num_key_value_heads=1), 3),  # one KV head: replicated; tied, 403
          "qwen3": (dict(num_key_value_heads=2), 0)}
ENGINE_KW = dict(tensor_parallel_size=2, num_threads=1, device="cpu", block_size=4,
                 max_num_batched_tokens=16, collective_timeout_s=60.0)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for arch, (overrides, extra_vocab) in MODELS.items():
        path = tmp_path_factory.mktemp(f"tp-{arch}")
        tok = build_tokenizer(path)
        build_tiny_model(arch, path, vocab_size=len(tok) + extra_vocab, **overrides)
        out[arch] = path
    return out


def hf_greedy(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                            do_sample=False, eos_token_id=None, pad_token_id=0)  # ignore_eos
            out.append(g[0, len(p):].tolist())
    return out


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_all(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    ids = [engine.submit(p, greedy()) for p in prompts]
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    return ([list(outs[i].outputs[0].token_ids) for i in ids],
            [outs[i].num_cached_tokens for i in ids])


@pytest.mark.parametrize("arch", list(MODELS))
def test_tp2_greedy_matches_hf(arch: str, model_dirs: dict[str, Path]) -> None:
    torch.set_num_threads(1)
    path = model_dirs[arch]
    want = hf_greedy(path, PROMPTS, MAX_TOKENS)
    # 24 blocks of 4 tokens hold ~2 of the 5 sequences at full length: some are preempted,
    # their KV read from both ranks and written back; prompts are chunked by the 16-token budget
    engine = Engine.from_kwargs(str(path), num_kv_blocks=24, **ENGINE_KW)
    try:
        assert engine.runner.model.shape.num_kv_heads == 1  # each rank's share (or replica)
        got, _ = run_all(engine, PROMPTS)
        assert got == want
        assert engine.stats.num_preemptions > 0
        again, cached = run_all(engine, PROMPTS)  # the same prompts: prefix-cache hits
        assert again == want
        assert sum(cached) > 0
    finally:
        engine.runner.close()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_tp2_moe_greedy_matches_hf(arch: str, expert_parallel: bool, tmp_path: Path) -> None:
    """Experts split over the ranks like dense MLPs (Qwen2-MoE's shared expert too), or whole
    experts per rank (`enable_expert_parallel`); Qwen3-MoE with a dense layer mixed in; chunked
    prefill and preemption as above."""
    from tests.integration.test_moe_vs_hf import build_moe_model

    torch.set_num_threads(1)
    tok = build_tokenizer(tmp_path)
    build_moe_model(arch, tmp_path, vocab=len(tok) + 1)
    want = hf_greedy(tmp_path, PROMPTS, MAX_TOKENS)
    engine = Engine.from_kwargs(str(tmp_path), num_kv_blocks=24,
                                enable_expert_parallel=expert_parallel, **ENGINE_KW)
    try:
        layer, moe = engine.runner.model.moe_layers[0], engine.runner.model.moe
        if expert_parallel:  # half the experts, whole
            assert layer.w13.shape[:2] == (moe.num_experts // 2, 2 * moe.intermediate)
        else:  # every expert, half its width
            assert layer.w13.shape[:2] == (moe.num_experts, moe.intermediate)
        got, _ = run_all(engine, PROMPTS)
        assert got == want
        assert engine.stats.num_preemptions > 0
        # every routed (token, expert) pair counted once, whichever rank ran the expert
        load = engine.stats.tokens_per_expert.summary()
        pairs = engine.stats.computed_tokens * moe.top_k * len(engine.runner.model.moe_layers)
        assert load["mean"] * load["layer_steps"] * moe.num_experts == pytest.approx(pairs)
        if expert_parallel:  # each rank's share: the pairs its half of the experts received
            per_rank = load["per_rank"]
            assert len(per_rank) == 2 and min(per_rank) > 0
            assert sum(per_rank) * load["layer_steps"] == pytest.approx(pairs)
        else:
            assert "per_rank" not in load
    finally:
        engine.runner.close()


def test_export_from_tp1_continues_at_tp2_and_back(model_dirs: dict[str, Path]) -> None:
    torch.set_num_threads(1)
    path = model_dirs["llama"]
    prompt = PROMPTS[0]
    want = hf_greedy(path, [prompt], 24)[0]
    one = Engine.from_kwargs(str(path), num_threads=1, device="cpu", block_size=4)
    two = Engine.from_kwargs(str(path), **ENGINE_KW)
    try:
        rid = one.submit(prompt, greedy(24))
        for _ in range(6):
            one.step()
        state = one.export(rid, include_kv=True)  # KV with every head
        assert state["seqs"][0]["kv"][0][0].shape[1] == 2
        two.import_(state)
        for _ in range(6):
            two.step()
        state = two.export(rid, include_kv=True)  # gathered from both ranks
        assert state["seqs"][0]["kv"][0][0].shape[1] == 2
        one.import_(state)
        outs = []
        while one.has_unfinished():
            outs += one.step()
        assert list(outs[0].outputs[0].token_ids) == want
        # prompt logprobs: the other ranks join the extra logits' gathers (a chunked prompt)
        asks = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
        got = []
        for engine in (one, two):
            engine.reset_prefix_cache()
            rid = engine.submit(PROMPTS[2], asks)
            while engine.has_unfinished():
                got += [o for o in engine.step() if o.request_id == rid]
        ref, tp = (o.prompt_logprobs for o in got)
        assert ref[0] is None and tp[0] is None and len(ref) == len(tp) == len(PROMPTS[2])
        for a, b in zip(ref[1:], tp[1:]):
            assert a.keys() == b.keys()
            assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
    finally:
        two.runner.close()


def test_llm_front_door_then_a_killed_rank_fails_the_engine_fast(
        model_dirs: dict[str, Path]) -> None:
    from batchgen_data import LLM

    torch.set_num_threads(1)
    path = model_dirs["qwen3"]
    llm = LLM(str(path), **ENGINE_KW)  # spawns rank 1
    engine = llm.engine
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], greedy(),
                            use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(path, PROMPTS[:2],
                                                                         MAX_TOKENS)
        engine.submit(PROMPTS[1], greedy(50))
        engine.step()
        engine.runner.ranks.procs[0].kill()
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1 exited"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - t0 < 10.0
        with pytest.raises(EngineDeadError):  # and stays dead
            engine.step()
    finally:
        engine.runner.close()


def test_stalled_rank_fails_the_engine_within_the_collective_timeout(
        model_dirs: dict[str, Path]) -> None:
    import os
    import signal

    torch.set_num_threads(1)
    kw = dict(ENGINE_KW, collective_timeout_s=3.0)
    engine = Engine.from_kwargs(str(model_dirs["llama"]), **kw)
    proc = engine.runner.ranks.procs[0]
    try:
        engine.submit(PROMPTS[1], greedy(50))
        engine.step()
        os.kill(proc.pid, signal.SIGSTOP)  # alive but silent: only the timeout can tell
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="stalled"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - t0 < 3.0 + 10.0
        assert proc.poll() is not None  # a dead engine stops (kills) its stalled rank
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        engine.runner.close()


def test_tp_size_the_heads_refuse_is_named_before_anything_starts(
        model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen_data.worker.tp import launch
    from batchgen_data.models import loader

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("started ranks or loaded weights before checking")

    monkeypatch.setattr(launch, "start", never)
    monkeypatch.setattr(loader, "load_weights", never)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's "
                                         "num_attention_heads=4"):
        Engine.from_kwargs(str(model_dirs["llama"]), tensor_parallel_size=3, device="cpu")
