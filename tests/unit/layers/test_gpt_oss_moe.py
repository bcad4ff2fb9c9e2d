"""gpt-oss's MoE block with MXFP4 experts against HF's `GptOssMLP` running on the dequantized
weights (fp32): the biased router's top-4 softmax, the interleaved gate/up rows put in halves,
the clamped SwiGLU with alpha, both biases, tokens per expert counted (the Triton kernel's
path is checked against this one in tests/kernels/test_mxfp4_kernels.py)."""
from __future__ import annotations

import torch

from batchgen_data.kernels import reference
from batchgen_data.layers import mxfp4
from batchgen_data.layers.backend import LayerBackend, building
from batchgen_data.layers.gpt_oss_moe import GptOssMoE

H, I, E, K = 64, 96, 8, 4


def hf_block(seed: int):  # type: ignore[no-untyped-def]
    """HF's block with random weights whose experts are exactly MXFP4-representable, and the
    stored (blocks, scales) of gate_up and down in the checkpoint's layout."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(seed)
    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                       num_experts_per_tok=K, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, swiglu_limit=1.5)
    block = GptOssMLP(cfg).eval()
    stored = {}
    with torch.no_grad():
        ex = block.experts
        block.router.weight.normal_(0, 0.5)
        block.router.bias.normal_(0, 0.5)
        for name, rows, k in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            w = torch.randn(E, rows, k) * 0.3  # [E, out, in], as the checkpoint's rows
            blocks, scales = mxfp4.quantize(w)
            deq = reference.mxfp4_dequantize(blocks, scales)
            getattr(ex, name).copy_(deq.transpose(1, 2))  # HF multiplies x @ [in, out]
            getattr(ex, f"{name}_bias").normal_(0, 0.5)
            stored[name] = (blocks.view(E, rows, k // 32, 16), scales)
    return cfg, block, stored


def ours(cfg, block, stored) -> GptOssMoE:  # type: ignore[no-untyped-def]
    with building(LayerBackend(torch.device("cpu"), torch.float32)):
        moe = GptOssMoE(H, I, E, K, cfg.swiglu_alpha, cfg.swiglu_limit)
    with torch.no_grad():
        moe.router.weight.copy_(block.router.weight)
        moe.router.bias.copy_(block.router.bias)
        for name in ("gate_up_proj", "down_proj"):
            blocks, scales = stored[name]
            getattr(moe.experts, f"{name}_blocks").copy_(blocks)
            getattr(moe.experts, f"{name}_scales").copy_(scales)
            getattr(moe.experts, f"{name}_bias").copy_(getattr(block.experts, f"{name}_bias"))
    moe.experts.process_weights_after_loading()
    for m in moe.modules():
        if m is not moe.experts and hasattr(m, "process_weights_after_loading"):
            m.process_weights_after_loading()
    return moe


def test_matches_hf_on_the_dequantized_weights() -> None:
    cfg, block, stored = hf_block(0)
    moe = ours(cfg, block, stored)
    x = torch.randn(11, H) * 2  # wide enough that the clamp bites
    with torch.no_grad():
        want, _ = block(x.unsqueeze(0))
        got = moe(x)
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)
    counts = moe.take_expert_tokens()
    assert int(counts.sum()) == 11 * K and counts.shape == (E,)
    assert int(moe.take_expert_tokens().sum()) == 0


def test_clamp_and_alpha_matter() -> None:
    """The oracle sees the activation's constants: other ones give other outputs."""
    cfg, block, stored = hf_block(1)
    moe = ours(cfg, block, stored)
    x = torch.randn(7, H) * 2
    with torch.no_grad():
        want, _ = block(x.unsqueeze(0))
        moe.limit = 1e9
        assert not torch.allclose(moe(x), want[0], atol=1e-3)
        moe.limit, moe.alpha = cfg.swiglu_limit, 1.0
        assert not torch.allclose(moe(x), want[0], atol=1e-3)


def test_graph_safe_path_gives_the_routed_output_and_counts() -> None:
    """The path a CUDA graph captures (every expert, zero weights where unrouted) gives the
    routed path's output; padding rows marked 0 by `counted_rows` are not counted."""
    from batchgen_data.layers.moe import counted_rows

    cfg, block, stored = hf_block(3)
    moe = ours(cfg, block, stored)
    x = torch.randn(6, H)
    with torch.no_grad():
        weights, ids = moe.route(x)
        torch.testing.assert_close(moe.all_experts(x, weights, ids),
                                   moe.routed_experts(x, weights, ids), rtol=1e-5, atol=1e-5)
        moe.take_expert_tokens()
        with counted_rows(torch.tensor([1, 1, 1, 1, 0, 0])):
            moe(x)
    assert int(moe.take_expert_tokens().sum()) == 4 * K
