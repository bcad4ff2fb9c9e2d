"""The FP8 KV cache (`kv_cache_dtype="fp8"`, layers/kv_quant.py) end to end on tiny random
models (CPU, fp32 weights).

The oracle is HF `generate` with a cache that rounds every K and V it stores through e4m3 with
the same per-layer scales (`E4M3Cache`): the engine's greedy tokens equal it on every CPU path
(the C decode kernel, torch only, tiny prefill chunks, preemption with the KV swapped out and
back) and with a checkpoint's own k/v scales. Against the fp32 cache the drift is measured and
bounded (teacher-forced prompt logprobs; greedy runs agree but at near ties). Exported FP8 KV
continues identically in another FP8 engine and is converted for a float one; prefix-cache
hits, hold/resume, the host KV tier and MLA carry the codes; the block count for a memory
budget is 2x bf16's and 4x fp32's; bad values are refused before anything is allocated.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from batchgen_data.config import make_engine_config
from batchgen_data.engine.engine import Engine
from batchgen_data.layers.attention import Attention
from batchgen_data.layers.backend import LayerBackend
from batchgen_data.layers.kv_quant import FP8, KVScales, quantize

STEPS = 12
_ORACLE: dict[tuple, list[int]] = {}  # HF runs, shared by the cases


def _rt(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x rounded through e4m3 with `scale` as the engine stores it (an independent copy of
    the rule: times the fp32 reciprocal, clamp, cast; back times the scale)."""
    inv = float(torch.tensor(1.0 / scale, dtype=torch.float32))
    codes = (x.float() * inv).clamp(-448, 448).to(FP8)
    return (codes.float() * scale).to(x.dtype)


def _e4m3_cache(config: Any, scales: list[tuple[float, float]] | None = None):  # type: ignore[no-untyped-def]
    from transformers import DynamicCache

    class E4M3Cache(DynamicCache):
        def update(self, key, value, layer_idx, cache_kwargs=None):  # type: ignore[no-untyped-def]
            ks, vs = scales[layer_idx] if scales else (1.0, 1.0)
            return super().update(_rt(key, ks), _rt(value, vs), layer_idx, cache_kwargs)

    return E4M3Cache(config=config)


def hf_greedy(hf, prompt: list[int], n: int, fp8: bool = True,  # type: ignore[no-untyped-def]
              scales: list[tuple[float, float]] | None = None) -> list[int]:
    key = (id(hf), tuple(prompt), n, fp8, None if scales is None else tuple(scales))
    if key not in _ORACLE:
        _ORACLE[key] = _hf_greedy(hf, prompt, n, fp8, scales)
    return _ORACLE[key]


def _hf_greedy(hf, prompt: list[int], n: int, fp8: bool,  # type: ignore[no-untyped-def]
               scales: list[tuple[float, float]] | None) -> list[int]:
    ids = torch.tensor([prompt])
    kw = {"past_key_values": _e4m3_cache(hf.config, scales)} if fp8 else {}
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 17, 40)]


def greedy(n: int = STEPS, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def generate(llm: LLM, prompts: list[list[int]], n: int = STEPS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


CASES = {
    "c_kernels": dict(),
    "torch_only": dict(cpu_kernels=False),
    "tiny_chunks": dict(max_num_batched_tokens=7, block_size=4),
    "swap_preemption": dict(num_kv_blocks=18, block_size=4, max_num_batched_tokens=64,
                            preemption_mode="swap"),
}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf_with_an_e4m3_cache(arch: str, case: str, tiny_model_dir,
                                              hf_model) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model_dir(arch)
    hf = hf_model(path)
    llm = LLM(str(path), kv_cache_dtype="fp8", **CASES[case])
    runner = llm.engine.runner
    assert runner.kv.dtype == FP8
    if case == "c_kernels":
        assert runner.backend.c_attention  # the C kernel decodes over the codes
    prompts = prompts_for(hf.config.vocab_size)
    assert generate(llm, prompts) == [hf_greedy(hf, p, STEPS) for p in prompts]
    if case == "swap_preemption":
        assert llm.engine.scheduler.num_preemptions > 0


def test_triton_path_over_fp8_matches_the_cpu_path(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    from engine_seams import triton_llm

    torch.set_num_threads(1)
    path = str(tiny_model_dir("llama"))
    kw = dict(kv_cache_dtype="fp8", block_size=4, max_num_batched_tokens=12, max_num_seqs=8)
    prompts = prompts_for(300, seed=1)[:2]
    sp = greedy(3, logprobs=0)
    got = {}
    for forced in (False, True):
        llm = triton_llm(path, **kw) if forced else LLM(path, **kw)
        assert llm.engine.runner.backend.triton == forced
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        got[forced] = ([list(o.outputs[0].token_ids) for o in outs],
                       [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                        for o in outs])
    assert got[True][0] == got[False][0]
    for a, b in zip(got[True][1], got[False][1]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=1e-3)


# measured on these tiny models (docs/quantization.md): teacher-forced prompt logprobs of 279
# tokens drift by at most 0.072 (Llama) / 0.081 (Qwen3), 0.019 / 0.022 on average
MAX_DRIFT, MEAN_DRIFT = 0.15, 0.04


def _prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate([{"prompt_token_ids": ids}], greedy(1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([lp[t] for lp, t in zip(out.prompt_logprobs[1:], ids[1:])])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logprob_drift_against_the_fp32_cache_is_bounded(arch: str, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    path = str(tiny_model_dir(arch))
    kw = dict(max_num_batched_tokens=64, block_size=16)  # later chunks read the cached prefix
    ref, fp8 = LLM(path, **kw), LLM(path, kv_cache_dtype="fp8", **kw)
    rng = random.Random(5)
    ids = [rng.randrange(3, 300) for _ in range(160)]
    drift = (_prompt_logprobs(ref, ids) - _prompt_logprobs(fp8, ids)).abs()
    assert drift.max() < MAX_DRIFT and drift.mean() < MEAN_DRIFT, (drift.max(), drift.mean())
    # greedy decodes: the chosen tokens' logprobs agree within the bound until the runs part,
    # and they part only where the fp32 run's top two were nearer than twice the bound
    sp = greedy(16, logprobs=3)
    for p in prompts_for(300, seed=6)[1:]:
        a, b = (llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0]
                for llm in (ref, fp8))
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                assert a.logprobs[i][ta] - a.logprobs[i][tb] < 2 * MAX_DRIFT
                break
            assert abs(a.logprobs[i][ta] - b.logprobs[i][tb]) < MAX_DRIFT


def test_export_import_between_fp8_engines_continues_identically(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    path = str(tiny_model_dir("llama"))
    kw = dict(kv_cache_dtype="fp8", block_size=4)
    prompt = prompts_for(300, seed=2)[2]
    whole = Engine.from_kwargs(path, **kw)
    rid = whole.submit(prompt, greedy(20))
    want = []
    while whole.has_unfinished():
        want += whole.step()
    src, dst = Engine.from_kwargs(path, **kw), Engine.from_kwargs(path, **kw)
    rid = src.submit(prompt, greedy(20))
    for _ in range(6):
        src.step()
    state = src.export(rid, include_kv=True)
    seq = state["seqs"][0]
    assert seq["kv"][0][0].dtype == FP8  # the codes travel as they are, with their scales
    assert seq["kv_format"] == {"dtype": "float8_e4m3fn", "scales": [[1.0, 1.0], [1.0, 1.0]]}
    kv_bytes = sum(k.numel() + v.numel() for k, v in seq["kv"])
    dst.import_(state)
    assert dst.live.requests[rid].seqs[0].held_kv[0][0].dtype == FP8
    assert dst.held_kv.used_bytes == kv_bytes  # one byte an element
    got = []
    while dst.has_unfinished():
        got += dst.step()
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_import_converts_between_fp8_and_float_caches(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    path = str(tiny_model_dir("llama"))
    prompt = prompts_for(300, seed=3)[1]

    def exported(engine: Engine) -> dict:
        rid = engine.submit(prompt, greedy(12))
        for _ in range(3):
            engine.step()
        return engine.export(rid, include_kv=True)

    fp8, fp32 = (Engine.from_kwargs(path, block_size=4, kv_cache_dtype=d) for d in ("fp8", "auto"))
    # FP8 into an fp32 engine: dequantized (code * scale)
    state = exported(fp8)
    codes = state["seqs"][0]["kv"]
    fp32.import_(state)
    held = fp32.live.requests[state["request_id"]].seqs[0].held_kv
    assert held[0][0].dtype == torch.float32 and torch.equal(held[0][0], codes[0][0].float())
    # fp32 into an FP8 engine: quantized as a write there would
    other = Engine.from_kwargs(path, block_size=4, kv_cache_dtype="fp8")
    state = exported(Engine.from_kwargs(path, block_size=4))
    floats = state["seqs"][0]["kv"]
    assert state["seqs"][0]["kv_format"] == {"dtype": "float32"}
    other.import_(state)
    held = other.live.requests[state["request_id"]].seqs[0].held_kv
    assert torch.equal(held[1][1].view(torch.uint8), quantize(floats[1][1], 1.0).view(torch.uint8))
    # FP8 with other scales: requantized to this engine's
    scaled = Engine.from_kwargs(path, block_size=4, kv_cache_dtype="fp8")
    for m in scaled.runner.model.modules():
        if isinstance(m, Attention):
            m.kv_scales = KVScales(0.5, 2.0)
    state = exported(Engine.from_kwargs(path, block_size=4, kv_cache_dtype="fp8"))
    src = state["seqs"][0]["kv"]
    scaled.import_(state)
    held = scaled.live.requests[state["request_id"]].seqs[0].held_kv
    assert torch.equal(held[0][0].view(torch.uint8), quantize(src[0][0].float(), 2.0).view(torch.uint8))
    assert torch.equal(held[0][1].view(torch.uint8), quantize(src[0][1].float(), 0.5).view(torch.uint8))
    for engine in (fp32, other, scaled):  # each continues to the end
        while engine.has_unfinished():
            engine.step()
    # FP8 codes without their scales cannot be read
    state = exported(Engine.from_kwargs(path, block_size=4, kv_cache_dtype="fp8"))
    del state["seqs"][0]["kv_format"]
    with pytest.raises(ValueError, match="no kv_format"):
        other.import_(state)


def test_prefix_cache_hit_and_hold_resume_with_fp8(tiny_model_dir, hf_model) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model_dir("qwen3")
    hf = hf_model(path)
    rng = random.Random(4)
    shared = [rng.randrange(3, 300) for _ in range(24)]
    tails = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 9)]
    llm = LLM(str(path), kv_cache_dtype="fp8", block_size=4, max_num_batched_tokens=16)
    generate(llm, [shared + tails[0]], 2)  # warms the prefix cache
    hits = llm.engine.pool.hits
    out = llm.generate([{"prompt_token_ids": shared + tails[1]}], greedy(), use_tqdm=False)[0]
    assert llm.engine.pool.hits > hits and out.num_cached_tokens >= 20
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, shared + tails[1], STEPS)
    # hold with the KV kept in host memory (codes), resume: the same tokens
    engine = llm.engine
    engine.reset_prefix_cache()
    rid = engine.submit(tails[1] + shared, greedy())
    for _ in range(5):
        engine.step()
    engine.hold(rid, keep_kv=True)
    held = engine.live.held[rid].seqs[0].held_kv
    assert held is not None and held[0][0].dtype == FP8
    engine.reset_prefix_cache()  # the resume reads the held copy, not cached blocks
    engine.resume(rid)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert list(outs[0].outputs[0].token_ids) == hf_greedy(hf, tails[1] + shared, STEPS)


def test_host_kv_tier_holds_fp8_blocks(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    path = str(tiny_model_dir("llama"))
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 12, 5, 9, 7, 11, 4, 8)]
    want = generate(LLM(path, kv_cache_dtype="fp8", cpu_kernels=False), prompts, 8)
    llm = LLM(path, kv_cache_dtype="fp8", cpu_kernels=False, block_size=4, num_kv_blocks=12,
              host_kv_tier_bytes=1 << 20)
    tier = llm.engine.runner.kv_tier
    assert tier is not None and tier.kv.dtype == FP8
    assert generate(llm, prompts, 8) == want
    assert llm.engine.stats.kv_host_seqs_peak > 0 and llm.engine.stats.kv_host_bytes_moved > 0


@pytest.mark.cpu_kind
def test_block_count_for_a_budget_follows_the_bytes_per_element(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    path = str(tiny_model_dir("llama"))
    budget = 3 << 20
    blocks, per_token = {}, {}
    for name, kw in {"fp32": {}, "bf16": dict(dtype="bfloat16"),
                     "fp8": dict(kv_cache_dtype="fp8")}.items():
        engine = Engine.from_kwargs(path, kv_cache_memory_bytes=budget, max_num_seqs=256, **kw)
        blocks[name] = engine.pool.num_blocks
        load = engine.load()
        per_token[name] = load.kv_bytes_per_token
        assert load.total_blocks == blocks[name]
        assert engine.runner.kv.numel() * engine.runner.kv.element_size() <= budget
    # 2 layers x K,V x 2 KV heads x 16 dims: 128 elements a token
    assert per_token == {"fp32": 512, "bf16": 256, "fp8": 128}
    assert blocks["fp8"] == 2 * blocks["bf16"] == 4 * blocks["fp32"]


def test_mla_cache_in_fp8(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from test_deepseek_vs_hf import build_deepseek_model

    path = tmp_path / "ds"
    path.mkdir()
    for f in tiny_model_dir("llama").glob("*token*"):
        shutil.copy(f, path / f.name)
    build_deepseek_model("q_lora", path, vocab=300)
    kw = dict(block_size=4, max_num_batched_tokens=32)
    ref, fp8 = LLM(str(path), **kw), LLM(str(path), kv_cache_dtype="fp8", **kw)
    assert fp8.engine.runner.kv.dtype == FP8  # the latent and the rope key, one byte each
    assert fp8.engine.load().kv_bytes_per_token * 4 == ref.engine.load().kv_bytes_per_token
    rng = random.Random(8)
    ids = [rng.randrange(3, 300) for _ in range(64)]
    drift = (_prompt_logprobs(ref, ids) - _prompt_logprobs(fp8, ids)).abs()
    assert drift.max() < MAX_DRIFT and drift.mean() < MEAN_DRIFT, (drift.max(), drift.mean())
    # the C decode kernel (64-wide latent head) and the torch path read the same codes
    torch_only = LLM(str(path), kv_cache_dtype="fp8", cpu_kernels=False, **kw)
    prompts = prompts_for(300, seed=9)[:2]
    assert generate(fp8, prompts, 6) == generate(torch_only, prompts, 6)


def _with_kv_scales(src: Path, dst: Path, scales: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    save_file(scales, str(dst / "kv_scales.safetensors"))
    return dst


def test_checkpoint_kv_scales_are_loaded_and_used(tiny_model_dir, hf_model,
                                                  tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    base = tiny_model_dir("llama")
    hf = hf_model(base)
    # compressed-tensors' names for layer 0, the older kv_scale for layer 1
    path = _with_kv_scales(base, tmp_path / "scaled", {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.0125),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.02]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(0.004)})
    llm = LLM(str(path), kv_cache_dtype="fp8", block_size=4)
    got = [m.kv_scales for m in llm.engine.runner.model.modules() if isinstance(m, Attention)]
    assert got == [KVScales(0.0125, 0.02), KVScales(0.004, 0.004)]
    scales = [(s.k, s.v) for s in got]
    prompts = prompts_for(hf.config.vocab_size, seed=10)
    assert generate(llm, prompts) == [hf_greedy(hf, p, STEPS, scales=scales) for p in prompts]
    # kv_cache_dtype="auto": the scales load and change nothing
    assert generate(LLM(str(path)), prompts) == generate(LLM(str(base)), prompts)
    bad = _with_kv_scales(base, tmp_path / "bad",
                          {"model.layers.0.self_attn.v_proj.output_scale": torch.tensor(0.0)})
    with pytest.raises(ValueError, match="v_proj.output_scale.*finite number > 0"):
        LLM(str(bad), kv_cache_dtype="fp8")


@pytest.mark.parametrize("value", ["fp16", "int8", "fp8_e5m2", "FP8", 8])
def test_unknown_kv_cache_dtype_is_named(value: Any) -> None:
    with pytest.raises(ValueError, match=f"kv_cache_dtype={value!r}"):
        make_engine_config(None, kv_cache_dtype=value)
    with pytest.raises(ValueError, match=f"kv_cache_dtype={value!r}"):
        LayerBackend.choose(torch.device("cpu"), torch.float32, kv_cache_dtype=value)


def test_accepted_names_and_vllm_calculate_kv_scales() -> None:
    for name in ("auto", "fp8", "fp8_e4m3"):
        assert make_engine_config(None, kv_cache_dtype=name).cache.kv_cache_dtype == name
    assert make_engine_config(None, kv_cache_dtype=None).cache.kv_cache_dtype == "auto"
    assert make_engine_config(None, calculate_kv_scales=False).cache.kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="calculate_kv_scales=True.*never computed"):
        make_engine_config(None, calculate_kv_scales=True)


def test_bad_value_is_refused_before_the_model_loads(tiny_model_dir,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from batchgen_data.models import loader

    def no_build(*a: Any, **k: Any) -> None:
        raise AssertionError("the model was built")

    monkeypatch.setattr(loader, "build_model", no_build)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2'.*only e4m3"):
        LLM(str(tiny_model_dir("llama")), kv_cache_dtype="fp8_e5m2")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tensor_parallel_fp8_cache_and_kv_through_the_ranks(tiny_model_dir, hf_model) -> None:  # type: ignore[no-untyped-def]
    """TP=2 (gloo, two processes): every rank writes its heads' codes with the same scales;
    KV read and written through the ranks (preemption swaps, export / import) crosses as
    bytes. Greedy tokens equal the e4m3-cache oracle; an export from TP=2 continues at TP=1."""
    torch.set_num_threads(1)
    path = tiny_model_dir("llama")
    hf = hf_model(path)
    prompts = prompts_for(hf.config.vocab_size, seed=11)
    want = [hf_greedy(hf, p, STEPS) for p in prompts]
    two = Engine.from_kwargs(str(path), kv_cache_dtype="fp8", tensor_parallel_size=2,
                             num_threads=1, device="cpu", block_size=4, num_kv_blocks=18,
                             max_num_batched_tokens=16, preemption_mode="swap",
                             collective_timeout_s=60.0)
    try:
        assert two.runner.kv.dtype == FP8
        ids = [two.submit(p, greedy()) for p in prompts]
        outs = {}
        while two.has_unfinished():
            outs.update({o.request_id: o for o in two.step()})
        assert [list(outs[i].outputs[0].token_ids) for i in ids] == want
        assert two.scheduler.num_preemptions > 0  # codes swapped out and back in
        rid = two.submit(prompts[1], greedy())
        for _ in range(4):
            two.step()
        state = two.export(rid, include_kv=True)  # gathered from both ranks, as bytes
        assert state["seqs"][0]["kv"][0][0].dtype == FP8
        one = Engine.from_kwargs(str(path), kv_cache_dtype="fp8", block_size=4)
        one.import_(state)
        done = []
        while one.has_unfinished():
            done += one.step()
        assert list(done[0].outputs[0].token_ids) == want[1]
    finally:
        two.runner.close()
