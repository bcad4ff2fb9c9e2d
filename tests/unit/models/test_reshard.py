"""Re-sharding in memory (models/reshard.py), without processes: a full model narrowed to rank
r's shard equals the shard the loader cuts from the checkpoint, and the ranks' shards gathered
back (two threads standing for the ranks) give the full weights bit for bit, for the packed
CPU layouts and the plain one, split and replicated KV heads, tied and odd vocabularies, and
MoE models' stacked experts (sliced in width, or whole per rank under expert parallelism)
with a shared expert and a dense layer mixed in."""
from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch

from batchgen_data.kernels.cpu import linear as cpu_linear
from batchgen_data.layers import parallel
from batchgen_data.layers.backend import LayerBackend
from batchgen_data.models import loader, reshard

from tests.conftest import build_tiny_model, build_tokenizer

CASES = {"llama": dict(num_key_value_heads=2), "qwen2": dict(num_key_value_heads=1),
         "qwen3": dict(num_key_value_heads=2)}
MOE = ("qwen3_moe", "qwen2_moe")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for arch, overrides in CASES.items():
        path = tmp_path_factory.mktemp(f"reshard-{arch}")
        tok = build_tokenizer(path)
        build_tiny_model(arch, path, vocab_size=len(tok) + 1, **overrides)  # odd vocabulary
        out[arch] = path
    from tests.integration.test_moe_vs_hf import build_moe_model

    for arch in MOE:
        path = tmp_path_factory.mktemp(f"reshard-{arch}")
        tok = build_tokenizer(path)
        build_moe_model(arch, path, vocab=len(tok) + 1)
        out[arch] = path
    return out


def _model(path: Path, layout: str, tp: parallel.TensorParallel | None = None,
           load: bool = True) -> torch.nn.Module:
    cfg = loader.load_config(path, False)
    backend = LayerBackend.choose(torch.device("cpu"), torch.float32, layout != "plain", 16)
    if layout != "plain":
        if layout == "onednn" and not cpu_linear.onednn_available():
            pytest.skip("oneDNN's linear is not available here")
        backend = dataclasses.replace(backend, linear=layout)
    with parallel.sharding(tp or parallel.SINGLE):
        model = loader.build_model(cfg, torch.float32, torch.device("cpu"), backend)
    if load:
        loader.load_weights(model, path)
    return model


def _plain(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, module in model.named_modules():
        for leaf in ("weight", "bias"):
            if getattr(module, leaf, None) is not None or (
                    leaf == "weight" and getattr(module, "packed", None) is not None):
                out[f"{name}.{leaf}"] = reshard.plain_weight(module, leaf).clone()
        for leaf in ("w13", "w2"):  # a MoE block's stacked experts
            if isinstance(getattr(module, leaf, None), torch.Tensor):
                out[f"{name}.{leaf}"] = getattr(module, leaf).detach().clone()
    return out


@pytest.mark.parametrize("arch,layout,ep", [
    ("llama", "panels", False), ("llama", "onednn", False), ("llama", "plain", False),
    ("qwen2", "panels", False), ("qwen3", "plain", False), ("qwen3_moe", "panels", False),
    ("qwen3_moe", "plain", True), ("qwen2_moe", "plain", False), ("qwen2_moe", "panels", True)])
def test_narrow_then_gather_is_exact(arch: str, layout: str, ep: bool,
                                     dirs: dict[str, Path]) -> None:
    if layout == "panels" and not cpu_linear.panel_gemm_available():
        pytest.skip("the panel kernel does not run here")
    kernels = layout
    path = dirs[arch]
    want = _plain(_model(path, kernels))
    if arch in MOE:
        assert any(k.endswith(".w13") for k in want) and any(k.endswith(".w2") for k in want)
    shards = []
    for rank in range(2):
        tp = parallel.TensorParallel(rank, 2, expert_parallel=ep)
        shard = _model(path, kernels, tp, load=False)
        reshard.narrow_into(shard, _model(path, kernels))
        loader.finalize(shard)
        ref = _plain(_model(path, kernels, tp))  # what the loader cuts for this rank
        got = _plain(shard)
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), k
        shards.append(shard)

    fulls = [_model(path, kernels, load=False) for _ in range(2)]
    barrier = threading.Barrier(2)
    slots: list[torch.Tensor | None] = [None, None]

    def all_gather_of(rank: int):  # type: ignore[no-untyped-def]
        def all_gather(local: torch.Tensor) -> list[torch.Tensor]:
            slots[rank] = local.clone()
            barrier.wait()
            out = [t.clone() for t in slots]  # type: ignore[union-attr]
            barrier.wait()
            return out
        return all_gather

    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            reshard.gather_into(fulls[rank], shards[rank], all_gather_of(rank))
            loader.finalize(fulls[rank])
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for full in fulls:
        got = _plain(full)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
