"""GLM-4.5 MoE (`Glm4MoeForCausalLM`) gives HF `generate`'s greedy tokens (fp32, CPU): a dense
first layer, grouped sigmoid routing with a non-zero correction bias (DeepSeek-V3's router),
a shared expert, q/k/v biases, q/k RMSNorm and a rotation of half of each head; mixed prompt
lengths, small prefill chunks, forced preemption, prefix-cache hits, the torch-only layers;
tensor parallelism (slow)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen_data import LLM
from test_moe_vs_hf import CASES, check_greedy_case, check_torch_backend

CONFIGS: dict[str, dict[str, Any]] = {
    # GLM-4.5's shape: q/k norm, biased q/k/v; 8 experts in 2 groups, 1 group kept, top-2
    "glm45": dict(use_qk_norm=True, attention_bias=True, n_routed_experts=8, n_group=2,
                  topk_group=1, num_experts_per_tok=2, norm_topk_prob=True),
    # GLM-4.5-Air's: no q/k norm, one group, weights not renormalised, two shared experts
    "air": dict(use_qk_norm=False, attention_bias=True, n_routed_experts=8, n_group=1,
                topk_group=1, num_experts_per_tok=3, norm_topk_prob=False, n_shared_experts=2),
}
_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    first_k_dense_replace=1, routed_scaling_factor=2.5, partial_rotary_factor=0.5,
    eos_token_id=2, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)


def build_glm_model(name: str, path: Path, vocab: int) -> Path:
    from transformers import AutoModelForCausalLM, Glm4MoeConfig

    torch.manual_seed(sorted(CONFIGS).index(name) + 40)
    config = Glm4MoeConfig(vocab_size=vocab, **{**_COMMON, **CONFIGS[name]})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        # wider logits and router scores: greedy and top-k ties become vanishingly rare
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            elif p.dim() == 1 and not torch.all(p == 1):  # biases (norm weights stay ones)
                p.copy_(torch.randn_like(p) * 0.5)
        for n, b in model.named_buffers():  # HF starts the correction bias at zero
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def glm_model(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Factory: config name -> (model dir, HF model), built once per module."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple[Path, Any]] = {}

    def make(name: str) -> tuple[Path, Any]:
        if name not in cache:
            path = tmp_path_factory.mktemp(f"tiny-glm-{name}")
            for f in tiny_model_dir("llama").glob("*token*"):  # the session's tiny tokenizer
                shutil.copy(f, path / f.name)
            build_glm_model(name, path, vocab=300)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[name] = (path, hf)
        return cache[name]

    return make


@pytest.mark.parametrize("name, case", [("glm45", "tiny_chunks"), ("glm45", "preemption"),
                                        ("air", "plain")])
def test_greedy_matches_hf(name: str, case: str, glm_model) -> None:  # type: ignore[no-untyped-def]
    path, hf = glm_model(name)
    llm = LLM(str(path), **CASES[case])
    model = llm.engine.runner.model
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    steps = check_greedy_case(llm, hf, case)
    assert len(model.moe_layers) == 2  # first_k_dense_replace=1 of 3 layers
    routed = sum(int(c.sum()) for c in steps)
    assert routed == llm.engine.stats.computed_tokens * model.moe.top_k * 2


def test_torch_only_backend_gives_the_same_tokens(glm_model) -> None:  # type: ignore[no-untyped-def]
    check_torch_backend(*glm_model("glm45"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_greedy_matches_hf(glm_model) -> None:  # type: ignore[no-untyped-def]
    """TP=2 (gloo, two processes): q/k/v heads and each expert's width split over the ranks,
    the grouped router replicated, the shared expert's partial sum reduced with the experts';
    chunked prefill and preemption."""
    from test_moe_vs_hf import greedy, hf_greedy, prompts_with_shared_prefix

    torch.set_num_threads(1)
    path, hf = glm_model("glm45")
    prompts = prompts_with_shared_prefix(seed=11)[:4]
    want = [hf_greedy(hf, p, 10) for p in prompts]
    llm = LLM(str(path), tensor_parallel_size=2, num_threads=1, device="cpu", block_size=4,
              num_kv_blocks=20, max_num_batched_tokens=16, collective_timeout_s=60.0)
    try:
        layer = llm.engine.runner.model.moe_layers[0]
        assert layer.w13.shape[:2] == (8, 2 * 16)  # every expert, gate|up of half its 32
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(10),
                           use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        assert llm.engine.stats.num_preemptions > 0
    finally:
        llm.engine.runner.close()
