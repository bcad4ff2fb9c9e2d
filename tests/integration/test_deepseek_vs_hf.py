"""DeepSeek-V3 gives HF `generate`'s greedy tokens (fp32, CPU): MLA attention (with and without
`q_lora_rank`, rope interleaved or not) over the latent KV cache, grouped sigmoid routing with
a non-zero correction bias, shared experts and dense first layers; mixed prompt lengths, small
prefill chunks, forced preemption, prefix-cache hits, and a running sequence exported from one
engine and imported into another; DeepSeek's yarn rope."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen_data import LLM
from test_moe_vs_hf import (check_export_import, check_greedy_case, check_torch_backend, greedy,
                             hf_greedy, prompts_with_shared_prefix)

_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
    qk_nope_head_dim=16, v_head_dim=24, routed_scaling_factor=2.5, first_k_dense_replace=1,
    eos_token_id=2, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
CONFIGS: dict[str, dict[str, Any]] = {
    # q through its low-rank path; 16 experts in 4 groups, 2 groups kept, top-3; the cached
    # latent head is 48 + 16 = 64 wide (the C decode kernel's width)
    "q_lora": dict(q_lora_rank=24, kv_lora_rank=48, qk_rope_head_dim=16, n_routed_experts=16,
                   n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=1,
                   norm_topk_prob=True),
    # plain q_proj, rope not interleaved, weights not renormalised, two shared experts; a
    # 40 + 8 = 48-wide latent head (torch decode attention)
    "plain_q": dict(q_lora_rank=None, kv_lora_rank=40, qk_rope_head_dim=8, n_routed_experts=8,
                    n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=2,
                    norm_topk_prob=False, rope_interleave=False),
}
# DeepSeek's yarn: cos/sin scaled by mscale(4, 1) / mscale(4, 0.8), softmax by mscale(4, 0.8)^2
CONFIGS["yarn"] = dict(CONFIGS["q_lora"], rope_parameters=dict(
    rope_type="yarn", factor=4.0, original_max_position_embeddings=128, mscale=1.0,
    mscale_all_dim=0.8, rope_theta=10000.0))


def build_deepseek_model(name: str, path: Path, vocab: int) -> Path:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(sorted(CONFIGS).index(name) + 20)
    config = DeepseekV3Config(vocab_size=vocab, **_COMMON, **CONFIGS[name])
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        # random init gives near-flat logits and router scores: widen them so greedy and
        # top-k ties are vanishingly rare
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
        # HF initialises the correction bias to zero: make it steer the choice of experts
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def deepseek_model(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Factory: config name -> (model dir, HF model), built once per module."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple[Path, Any]] = {}

    def make(name: str) -> tuple[Path, Any]:
        if name not in cache:
            path = tmp_path_factory.mktemp(f"tiny-deepseek-{name}")
            for f in tiny_model_dir("llama").glob("*token*"):  # the session's tiny tokenizer
                shutil.copy(f, path / f.name)
            build_deepseek_model(name, path, vocab=300)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[name] = (path, hf)
        return cache[name]

    return make


CASES = {
    "plain": dict(block_size=4),
    "tiny_chunks": dict(max_num_batched_tokens=7, block_size=4),
    "preemption": dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("name, case", [(n, c) for n in ("q_lora", "plain_q") for c in CASES]
                         + [("yarn", "tiny_chunks")])
def test_greedy_matches_hf(name: str, case: str, deepseek_model) -> None:  # type: ignore[no-untyped-def]
    path, hf = deepseek_model(name)
    llm = LLM(str(path), **CASES[case])
    model = llm.engine.runner.model
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    steps = check_greedy_case(llm, hf, case)
    # first_k_dense_replace=1: layers 1 and 2 route, each token to top_k experts
    assert len(model.moe_layers) == 2
    assert all(c.shape == (2, model.moe.num_experts) for c in steps)
    routed = sum(int(c.sum()) for c in steps)
    assert routed == llm.engine.stats.computed_tokens * model.moe.top_k * 2
    assert llm.engine.stats.as_dict()["tokens_per_expert"]["layer_steps"] == 2 * len(steps)


def test_kv_cache_holds_the_latent(deepseek_model) -> None:  # type: ignore[no-untyped-def]
    path, _ = deepseek_model("q_lora")
    runner = LLM(str(path), block_size=4).engine.runner
    # [layers, one plane, blocks, block_size, one latent head, kv_lora_rank + qk_rope_head_dim]
    assert runner.kv.shape[1] == 1 and runner.kv.shape[4:] == (1, 48 + 16)
    k, v = runner.kv_caches[0]
    assert v.data_ptr() == k.data_ptr()  # the values are read from the key rows
    # 3 layers x 64 floats, where per-head K and V would take 4 x (16 + 16 + 24)
    assert runner.kv_bytes_per_token(runner.model, torch.float32) == 3 * 64 * 4


def test_torch_only_backend_gives_the_same_tokens(deepseek_model) -> None:  # type: ignore[no-untyped-def]
    check_torch_backend(*deepseek_model("q_lora"))


@pytest.mark.parametrize("include_kv", [False, True])
def test_export_import_mid_generation(deepseek_model, include_kv: bool) -> None:  # type: ignore[no-untyped-def]
    check_export_import(deepseek_model("q_lora")[0], include_kv)


def test_attention_micro_batches_and_streamed_experts(deepseek_model) -> None:  # type: ignore[no-untyped-def]
    """The MoE-side engine features reach DeepSeek-V3 too: attention in micro-batches of two
    sequences with the experts once per step, and weights offloaded with per-expert streaming."""
    from batchgen_data.worker.offload import weight_bytes

    path, hf = deepseek_model("q_lora")
    prompts = prompts_with_shared_prefix(seed=8)[:4]
    want = [hf_greedy(hf, p, 8) for p in prompts]
    micro = LLM(str(path), attention_micro_batch_seqs=2, max_num_batched_tokens=9, block_size=4)
    got = micro.generate([{"prompt_token_ids": p} for p in prompts], greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    total = weight_bytes(micro.engine.runner.model)
    streamed = LLM(str(path), cpu_offload_gb=0.4 * total / 2**30, stream_experts=True)
    assert streamed.engine.runner.weight_store is not None
    got = streamed.generate([{"prompt_token_ids": p} for p in prompts], greedy(8),
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert streamed.engine.stats.offload_bytes_moved > 0


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_kv_host_tier_holds_latent_blocks(deepseek_model, cpu_kernels: bool) -> None:  # type: ignore[no-untyped-def]
    """The KV host tier (issue 16) with MLA's latent cache: a device KV of 12 blocks cannot hold
    the batch, the rest runs from host blocks, and the tokens are still HF's."""
    path, hf = deepseek_model("q_lora")
    prompts = prompts_with_shared_prefix(seed=9)[:6]
    want = [hf_greedy(hf, p, 8) for p in prompts]
    llm = LLM(str(path), block_size=4, num_kv_blocks=12, host_kv_tier_bytes=1 << 20,
              cpu_kernels=cpu_kernels)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    stats = llm.engine.stats
    assert stats.kv_host_seqs_peak >= 2 and stats.kv_host_bytes_moved > 0
    assert stats.max_batch_seqs > 2  # more sequences in a step than the device KV holds


def test_piecewise_graphs_give_hf_tokens(deepseek_model) -> None:  # type: ignore[no-untyped-def]
    """MLA (one latent plane read as K and V) and grouped routing through piecewise graphs on the
    recording capture seam (tests/recording_capture.py): every step of up to 16 tokens replayed
    in pieces around the attention gives HF's greedy tokens."""
    from recording_capture import RecordingPieces

    from batchgen_data.worker.fast_paths.piecewise_graphs import MixedGraphs

    path, hf = deepseek_model("q_lora")
    llm = LLM(str(path), block_size=4, max_num_seqs=4, max_model_len=64,
              max_num_batched_tokens=16, cpu_kernels=False)
    runner = llm.engine.runner
    graphs = MixedGraphs(runner.model, runner.kv_caches, 16, runner.device, RecordingPieces())
    runner.fast_paths = [graphs]
    check_greedy_case(llm, hf, "tiny_chunks")
    assert graphs.steps_run == llm.engine.stats.num_steps
