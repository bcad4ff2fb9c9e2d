"""Module-based batching with KV partly in host memory (issue 16), on a tiny dense and a tiny MoE
decoder: a prefill step and two decode steps where some micro-batches' KV lives in the host tier
(one swapped into device staging, one attended on the host) give the hidden states of the same
schedule with every micro-batch's KV on the device, bit for bit, and the model's own one-batch
forward up to float rounding."""
from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from batchgen_data.layers.backend import LayerBackend
from batchgen_data.models import loader
from batchgen_data.layers.attention import AttentionMetadata
from batchgen_data.worker.kv_tier.batch import MicroBatch, metadata
from batchgen_data.worker.kv_tier.caches import HostKVCaches
from batchgen_data.worker.kv_tier.tier import Placed, micro_batches

BLOCK = 4
PROMPT_LENS = [5, 9, 6, 11, 3]
STEPS = 3  # a prefill, then two decodes
# micro-batches of sequence indices and where their KV is in the tiered run
SCHEDULE = [([0, 1], None), ([2], "swap"), ([3, 4], "host")]


@pytest.fixture(scope="module")
def tiny_moe_dir(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> Path:
    import transformers as tf

    base = tiny_model_dir("qwen3")
    path = tmp_path_factory.mktemp("tiny-moe")
    for f in base.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, path / f.name)
    cfg = tf.Qwen3MoeConfig(
        vocab_size=tf.AutoConfig.from_pretrained(base).vocab_size, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(3)
    tf.Qwen3MoeForCausalLM(cfg).eval().save_pretrained(path)
    return path


def _load(path: Path) -> tuple[torch.nn.Module, LayerBackend]:
    cfg = loader.load_config(path, False)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    backend = LayerBackend.choose(torch.device("cpu"), torch.float32, False, head_dim)
    model = loader.build_model(cfg, torch.float32, torch.device("cpu"), backend)
    loader.load_weights(model, path)
    return model.eval(), backend


def _caches(model: torch.nn.Module, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    s = model.shape
    return [(torch.zeros(num_blocks, BLOCK, s.num_kv_heads, s.head_dim),
             torch.zeros(num_blocks, BLOCK, s.num_kv_heads, s.head_dim))
            for _ in range(s.num_layers)]


def _tables(first: int, lens: list[int], reverse: bool = False) -> list[list[int]]:
    out, nxt = [], first
    for n in lens:
        need = -(-(n + STEPS) // BLOCK)
        blocks = list(range(nxt, nxt + need))
        out.append(blocks[::-1] if reverse else blocks)  # host blocks need not be in order
        nxt += need
    return out


@torch.inference_mode()
def _run(model: torch.nn.Module, backend: LayerBackend, tiered: bool
         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Hidden states of each step under SCHEDULE (tiered: host micro-batches in the host tier),
    and (resident only) of the model's own forward over the same step as one batch."""
    rng = random.Random(0)
    tokens = [[rng.randrange(3, 300) for _ in range(n)] for n in PROMPT_LENS]
    dev_tables = _tables(0, PROMPT_LENS)
    host_tables = _tables(1, PROMPT_LENS, reverse=True)
    nblocks = 2 + sum(map(len, dev_tables))
    dev, host = _caches(model, nblocks), _caches(model, nblocks)
    tier = HostKVCaches(host, 16, torch.device("cpu"), backend, model.shape.num_heads)
    outs: list[torch.Tensor] = []
    refs: list[torch.Tensor] = []
    done = [0] * len(tokens)
    for step in range(STEPS):
        placed, ids, pos = [], [], []
        for seqs, mode in SCHEDULE:
            on_host = tiered and mode is not None
            tables = host_tables if on_host else dev_tables
            new = [len(tokens[i]) - done[i] for i in seqs]
            placed.append(Placed(MicroBatch([tables[i] for i in seqs],
                                            [len(tokens[i]) for i in seqs], new),
                                 mode if on_host else None))
            for i in seqs:
                ids += tokens[i][done[i]:]
                pos += range(done[i], len(tokens[i]))
        parts = micro_batches(placed, tier, BLOCK, torch.device("cpu"),
                              backend.torch_decode_attention)
        if not tiered:  # the same step as one batch through the model's own forward
            whole = MicroBatch(dev_tables, [len(t) for t in tokens],
                               [len(t) - d for t, d in zip(tokens, done)])
            meta = metadata(whole, BLOCK, torch.device("cpu"), backend.torch_decode_attention)
            refs.append(model(torch.tensor(ids), torch.tensor(pos), _copy(dev), meta))
        # the model sees one metadata; the tier's last swapped rows go home after the forward
        x = model(torch.tensor(ids), torch.tensor(pos), dev,
                  AttentionMetadata.in_micro_batches(parts))
        tier.flush()
        outs.append(x)
        for i, t in enumerate(tokens):
            done[i] = len(t)
            t.append(rng.randrange(3, 300))
    return outs, refs


def _copy(caches: list[tuple[torch.Tensor, torch.Tensor]]
          ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.clone(), v.clone()) for k, v in caches]


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_host_tier_micro_batches_match_the_resident_schedule(
        which: str, tiny_model_dir: Callable[..., Path], tiny_moe_dir: Path) -> None:
    path = tiny_model_dir("llama") if which == "dense" else tiny_moe_dir
    model, backend = _load(path)
    resident, whole = _run(model, backend, tiered=False)
    tiered, _ = _run(model, backend, tiered=True)
    assert len(tiered) == STEPS
    for step, (want, got, one_batch) in enumerate(zip(resident, tiered, whole)):
        assert torch.equal(got, want), f"step {step}: max diff {(got - want).abs().max()}"
        # attention per micro-batch may round differently from one batch: close, not equal
        torch.testing.assert_close(got, one_batch, rtol=1e-4, atol=1e-4)
