"""Expert-granular streaming (issue 16) on the CPU "device": an offloaded MoE layer copies in only
the experts its tokens were routed to. Outputs are bit-identical to the resident layer's; the
bytes moved are the routed experts' exactly; per generated token they fall as the batch grows and
stay below whole-layer streaming when a batch activates few experts."""
from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from batchgen_data.layers.backend import LayerBackend, building
from batchgen_data.layers.moe import FusedMoE
from batchgen_data.worker.offload import GIB, weight_bytes
from batchgen_data.worker.offload.experts import ExpertStreamer, _runs

EXPERTS, TOP_K = 16, 2


def _moe(seed: int = 0, triton: bool = False) -> FusedMoE:
    torch.manual_seed(seed)
    with building(LayerBackend(torch.device("cpu"), torch.float32, triton=triton)):
        layer = FusedMoE(24, 16, num_experts=EXPERTS, top_k=TOP_K, norm_topk_prob=True)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer.eval()


def test_runs_group_consecutive_experts() -> None:
    assert _runs([1, 2, 3, 7, 9, 10]) == [((1, 0), 3), ((7, 3), 1), ((9, 4), 2)]
    assert _runs([]) == []


@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_streamed_experts_match_resident_bit_for_bit(tokens: int) -> None:
    ref = _moe()
    layer = _moe()
    x = torch.randn(tokens, 24, generator=torch.Generator().manual_seed(tokens))
    want = ref(x)
    streamer = ExpertStreamer([layer], num_sets=2, device=torch.device("cpu"))
    layer.stream_experts_from(streamer)
    assert layer.w13.numel() == 0 and layer.w2.numel() == 0  # the bytes left the layer
    per_expert = (2 * 16 * 24 + 24 * 16) * 4
    for step in range(2):  # both expert sets, the second call reusing the first's slots
        got = layer(x)
        assert torch.equal(got, want)
        _, ids = torch.topk(ref.gate(x), TOP_K, dim=-1)
        active = len(torch.unique(ids))
        assert streamer.held[step] == active * per_expert
    assert streamer.bytes_moved == 2 * active * per_expert
    assert torch.equal(layer.take_expert_tokens(), 2 * ref.take_expert_tokens())
    if tokens == 1:
        assert streamer.bytes_moved == 2 * TOP_K * per_expert  # k of E experts, not E


def test_streamed_experts_on_the_triton_path() -> None:
    """The GPU's expert kernel (under the Triton interpreter) takes the n routed experts and
    the remapped ids as it takes the layer's own."""
    pytest.importorskip("triton")
    ref, layer = _moe(triton=True), _moe(triton=True)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(1))
    want = ref(x)
    streamer = ExpertStreamer([layer], num_sets=1, device=torch.device("cpu"))
    layer.stream_experts_from(streamer)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    assert 0 < streamer.bytes_moved < EXPERTS * (3 * 16 * 24) * 4


@pytest.fixture(scope="module")
def wide_moe(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
             ) -> Path:
    """A tiny Qwen3-MoE with many experts and narrow attention: the experts are most of each
    layer's bytes, and one sequence routes to few of them."""
    import transformers as tf

    base = tiny_model_dir("qwen3")
    path = tmp_path_factory.mktemp("wide-moe")
    for f in base.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, path / f.name)
    cfg = tf.Qwen3MoeConfig(
        vocab_size=tf.AutoConfig.from_pretrained(base).vocab_size, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=64, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        eos_token_id=2, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(5)
    model = tf.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # wider logits: greedy ties vanishingly rare (as in conftest)
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    return path


def _prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randint(3, 8))]}
            for _ in range(n)]


def _run(llm: LLM, prompts: list[dict], max_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy tokens and offloaded bytes moved per generated token."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    return out, llm.engine.stats.offload_bytes_moved / sum(map(len, out))


def test_expert_streaming_matches_resident_and_beats_whole_layers(wide_moe: Path) -> None:
    prompts = _prompts(3, seed=4)
    resident = LLM(str(wide_moe))
    total = weight_bytes(resident.engine.runner.model)
    want, _ = _run(resident, prompts, 8)
    offload_gb = 0.75 * total / GIB
    per_token = {}
    for granular in (True, False):
        llm = LLM(str(wide_moe), cpu_offload_gb=offload_gb, stream_experts=granular,
                  max_num_seqs=1)  # one sequence a step: few experts routed
        store = llm.engine.runner.weight_store
        assert store is not None and len(store.layers) >= 4
        assert (store.experts is not None) == granular
        got, per_token[granular] = _run(llm, prompts, 8)
        assert got == want
        assert 0 < llm.engine.stats.offload_peak_resident_bytes <= total - int(offload_gb * GIB)
    # a decode step of one sequence routes to k = 2 of 16 experts per layer
    assert per_token[True] < 0.5 * per_token[False], per_token


def test_expert_bytes_per_token_fall_with_batch(wide_moe: Path) -> None:
    resident = LLM(str(wide_moe))
    offload_gb = 0.75 * weight_bytes(resident.engine.runner.model) / GIB
    prompts = _prompts(16, seed=6)
    per_token = []
    for batch in (1, 4, 16):
        llm = LLM(str(wide_moe), cpu_offload_gb=offload_gb, max_num_seqs=batch)
        assert llm.engine.runner.weight_store.experts is not None
        per_token.append(_run(llm, prompts, 6)[1])
    assert per_token[0] > 1.5 * per_token[1] > 2.25 * per_token[2] > 0, per_token


def test_stream_experts_validated() -> None:
    with pytest.raises(TypeError, match="stream_experts"):
        LLM(stream_experts="yes")
