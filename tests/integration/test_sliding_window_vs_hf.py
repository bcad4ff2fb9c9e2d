"""Sliding-window models give HF `generate`'s greedy tokens (fp32, CPU): a windowed Mistral
(every layer windowed) and a Qwen2 whose later layers are windowed (`max_window_layers`), with
prompts that cross the window several times, small prefill chunks, prefix-cache hits,
preemption, the C decode kernel and the torch path (the Triton path: tests/kernels/
test_window_sink_kernels.py)."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from tests.conftest import build_tiny_model, build_tokenizer

WINDOW = 8


def _prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_greedy(hf: Any, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Mistral windowed on every layer and a Qwen2 with layer 0 global, layer 1 windowed."""
    dirs = {}
    for arch, extra in (("mistral", dict(sliding_window=WINDOW)),
                        ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW,
                                       max_window_layers=1))):
        path = tmp_path_factory.mktemp(f"windowed-{arch}")
        build_tiny_model(arch, path, vocab_size=len(build_tokenizer(path)), **extra)
        dirs[arch] = path
    return dirs


@pytest.fixture(scope="module")
def expected(windowed_dirs: dict[str, Path], hf_model: Callable[[Path], Any]
             ) -> Callable[[str, list[list[int]], int], list[list[int]]]:
    cache: dict[tuple, list[list[int]]] = {}

    def want(arch: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        key = (arch, tuple(map(tuple, prompts)), max_tokens)
        if key not in cache:
            hf = hf_model(windowed_dirs[arch])
            cache[key] = [hf_greedy(hf, p, max_tokens) for p in prompts]
        return cache[key]

    return want


CASES = {
    "tiny_chunks": dict(max_num_batched_tokens=7, block_size=4),
    "preemption": dict(num_kv_blocks=30, block_size=4, max_num_batched_tokens=64),
    "torch_path": dict(block_size=4, cpu_kernels=False),
    # step n+1 scheduled while step n runs: blocks freed after step n are not read by n+1
    "async": dict(async_scheduling=True, max_num_seqs=4, block_size=4,
                  max_num_batched_tokens=16),
}


def test_configs_are_windowed_as_hf_reads_them(windowed_dirs: dict[str, Path],
                                               hf_model: Callable[[Path], Any]) -> None:
    hf = hf_model(windowed_dirs["qwen2"])
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    for arch, windows in (("mistral", [WINDOW, WINDOW]), ("qwen2", [None, WINDOW])):
        model = LLM(str(windowed_dirs[arch]), block_size=4).engine.runner.model
        assert [layer.self_attn.attn.sliding_window for layer in model.layers] == windows


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_windowed_greedy_matches_hf(arch: str, case: str, windowed_dirs, expected) -> None:  # type: ignore[no-untyped-def]
    prompts = _prompts(4, 300, 20, 45, seed=3)  # 2.5 to 5.6 windows long, then 12 more tokens
    llm = LLM(str(windowed_dirs[arch]), **CASES[case])
    assert run(llm, prompts, 12) == expected(arch, prompts, 12)
    # Mistral's rows keep only their windows' blocks (the rest freed), so it never runs out
    if case == "async":
        assert llm.engine.stats.overlapped_steps > 0
    if case == "preemption" and arch == "qwen2":
        assert llm.engine.stats.num_preemptions > 0


def test_windowed_prefix_cache_hits_keep_outputs_exact(windowed_dirs, expected) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(windowed_dirs["mistral"]), block_size=4, max_num_batched_tokens=16)
    system = _prompts(1, 300, 26, 26, seed=5)[0]  # three windows: cached blocks outside it too
    prompts = [system + tail for tail in _prompts(4, 300, 1, 9, seed=6)]
    first = run(llm, prompts[:1], 12)
    rest = run(llm, prompts[1:], 12)
    assert llm.engine.pool.hits >= 3 * 6
    assert first + rest == expected("mistral", prompts, 12)



def test_blocks_outside_every_window_are_freed(windowed_dirs, expected, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from batchgen_data.core.kv import room

    prompts = _prompts(2, 300, 60, 70, seed=12)  # ~8 windows, then 16 decodes
    counts = {}
    for name, path in (("windowed", windowed_dirs["mistral"]), ("global",
                                                              tiny_model_dir("mistral"))):
        llm = LLM(str(path), block_size=4, max_num_batched_tokens=16)
        sched = llm.engine.scheduler
        real, peak = sched.after_step, [0]

        def spy(out, flat=None, _real=real, _peak=peak):  # type: ignore[no-untyped-def]
            _real(out, flat)
            seqs = out.seqs if flat is None else flat[0]
            _peak[0] = max([_peak[0]] + [len(room.live_blocks(s.block_ids)) for s in seqs])

        sched.after_step = spy
        got = run(llm, prompts, 16)
        if name == "windowed":
            assert got == expected("mistral", prompts, 16)
            assert llm.engine.pool.window == WINDOW
        counts[name] = peak[0]
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks  # all given back
    longest = max(map(len, prompts)) + 15  # the last token sampled is never computed
    assert counts["global"] == -(-longest // 4)
    # after each step a row on the windowed model holds the blocks of its window (window /
    # block_size, one more where the window starts inside a block): (window / context) x the
    # global model's count, where the global one holds the whole context
    assert counts["windowed"] <= WINDOW // 4 + 1
    assert counts["windowed"] * longest <= (WINDOW + 4) * counts["global"]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_windowed_moe_greedy_matches_hf(arch: str, tmp_path: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    # Mixtral with a window, Qwen3-MoE with use_sliding_window: every layer windowed, so
    # their blocks are freed early too
    import transformers as tf

    common = dict(vocab_size=len(build_tokenizer(tmp_path)), hidden_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, eos_token_id=2, bos_token_id=0, pad_token_id=0,
                  tie_word_embeddings=False, sliding_window=WINDOW)
    cfg = (tf.MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                            **common) if arch == "mixtral" else
           tf.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                             num_experts_per_tok=2, head_dim=16, use_sliding_window=True,
                             **common))
    torch.manual_seed(7)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(tmp_path)
    prompts = _prompts(3, 300, 20, 40, seed=21)
    llm = LLM(str(tmp_path), block_size=4, max_num_batched_tokens=7)
    assert llm.engine.pool.window == WINDOW
    hf = hf_model(tmp_path)
    assert run(llm, prompts, 10) == [hf_greedy(hf, p, 10) for p in prompts]
