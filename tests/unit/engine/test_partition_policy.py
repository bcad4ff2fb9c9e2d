"""The re-partition policy from load reports alone, and what an engine group refuses before any
process starts (engine/group/group.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchgen_data.config import make_engine_config
from batchgen_data.worker.tp import launch
from batchgen_data.engine.group.group import EngineGroup, PartitionPolicy
from batchgen_data.engine.group.policy import spread as _spread
from batchgen_data.placement import EngineLoad


def load(running: int, remaining: int, step_s: float = 0.05, waiting: int = 0) -> EngineLoad:
    return EngineLoad(0, waiting, running, 0, remaining, 100, 100, 256, 16,
                      decode_step_s=step_s)


def test_join_needs_a_short_tail_nothing_queued_and_a_saving_that_pays() -> None:
    p = PartitionPolicy(join_below_seqs=4, wide_step_ratio=0.6, switch_s=2.0)
    # 2 + 1 sequences, ~200 tokens left each: 200 x 0.05 s x 0.4 = 4 s saved > 2 s
    assert p.should_join([load(2, 400), load(1, 200)])
    assert not p.should_join([load(4, 800), load(1, 200)])  # 5 live: not the tail yet
    assert not p.should_join([load(2, 400, waiting=1), load(1, 200)])  # rows still queued
    assert not p.should_join([load(2, 100), load(1, 50)])  # 50 steps x 0.02 s = 1 s < 2 s
    assert p.should_join([load(2, 400, step_s=0.0), load(1, 200)])  # the slowest measured
    assert not p.should_join([load(2, 400, step_s=0.0), load(1, 200, step_s=0.0)])  # none yet
    assert not p.should_join([load(0, 0), load(0, 0)])  # nothing left
    assert not PartitionPolicy(wide_step_ratio=1.1).should_join([load(1, 9999)])  # not faster


def test_split_when_work_queues_behind_the_wide_engine() -> None:
    p = PartitionPolicy(split_above_seqs=8)
    assert p.should_split(load(8, 800, waiting=4))
    assert not p.should_split(load(12, 800))  # nothing waiting
    assert not p.should_split(load(2, 800, waiting=3))  # few: the wide engine serves them


def test_split_spreads_requests_by_kv_tokens() -> None:
    def state(rid: str, n: int) -> dict:
        return {"request_id": rid, "prompt_token_ids": [1] * n,
                "seqs": [{"output_token_ids": []}]}

    share = _spread([state("a", 100), state("b", 60), state("c", 50), state("d", 5)], 2)
    assert [[s["request_id"] for s in part] for part in share] == [["a", "d"], ["b", "c"]]


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor_parallel_size=2), "start with one device each"),
    (dict(distributed_executor_backend="ray"), "distributed_executor_backend='ray'"),
])
def test_group_refusals_come_before_any_process(kwargs: dict, match: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object, **kw: object) -> None:
        raise AssertionError("started a process before checking")

    monkeypatch.setattr(launch, "start", never)
    with pytest.raises(ValueError, match=match):
        EngineGroup(make_engine_config("unused-model-path", device="cpu", **kwargs))
    with pytest.raises(ValueError, match="at least 2 engines"):
        EngineGroup(make_engine_config("unused-model-path", device="cpu"), size=1)


def test_a_moe_model_passes_the_group_checks(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """MoE groups re-shard their experts (the refusal went): the checks give the TP config."""
    from transformers import Qwen3MoeConfig

    from batchgen_data.engine.group.policy import check_group

    Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                   num_experts=4, num_experts_per_tok=2, vocab_size=100).save_pretrained(tmp_path)
    monkeypatch.setattr(launch, "start", lambda *a, **k: pytest.fail("started a process"))
    wide = check_group(make_engine_config(str(tmp_path), device="cpu"), 4, 2)
    assert wide.tensor_parallel_size == 2


@pytest.mark.parametrize("size,width", [(4, 3), (4, 1), (4, 8), (6, 4), (4, True), (4, 2.0)])
def test_a_width_that_does_not_divide_the_group_is_refused_by_name(
        size: int, width: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "start", lambda *a, **k: pytest.fail("started a process"))
    with pytest.raises(ValueError, match=f"width={width!r}"):
        EngineGroup(make_engine_config("unused-model-path", device="cpu"), size=size,
                    width=width)  # type: ignore[arg-type]


def test_the_front_door_refuses_a_bad_width_before_any_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaConfig

    from batchgen_data import LLM

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2,
                vocab_size=100).save_pretrained(tmp_path)
    monkeypatch.setattr(launch, "start", lambda *a, **k: pytest.fail("started a process"))
    with pytest.raises(ValueError, match="width=3"):
        LLM(str(tmp_path), data_parallel_size=4, repartition=True, repartition_width=3,
            device="cpu")
    with pytest.raises(ValueError, match="repartition_width=2: .*data_parallel_size"):
        LLM("unused-model-path", repartition_width=2, device="cpu")


def test_each_engine_of_a_group_on_cuda_gets_its_own_gpu(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A group's one-device engines: process r on cuda:(first + r), the GPU it keeps as rank r
    of the TP engine; on the CPU every engine keeps the config as it is."""
    import torch

    from batchgen_data.worker import devices
    from batchgen_data.config import make_engine_config
    from batchgen_data.engine.group.member import own_device

    monkeypatch.setattr(devices, "resolve_device", lambda name: torch.device(
        "cuda", 0) if name == "cuda" else torch.device(name))
    monkeypatch.setattr(devices, "pick_device", lambda requested: requested)
    cfg = make_engine_config("m", device="cuda")
    assert [own_device(cfg, r, "cuda").device for r in range(3)] == ["cuda:0", "cuda:1",
                                                                     "cuda:2"]
    named = make_engine_config("m", device="cuda:4")
    assert own_device(named, 1, "cuda").device == "cuda:5"
    cpu = make_engine_config("m", device="cpu")
    assert own_device(cpu, 1, "cpu") is cpu


def test_quantized_experts_under_expert_parallel_are_refused_by_name() -> None:
    """`check_tp`: quantized checkpoints shard (their stored form), but the expert-parallel
    block runs dense experts, so quantized experts with enable_expert_parallel are refused."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    from batchgen_data.config import make_engine_config
    from batchgen_data.worker.tp.runner import check_tp

    moe = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         num_experts=4, num_experts_per_tok=2, vocab_size=100)
    cpu = torch.device("cpu")
    ep = make_engine_config("m", tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="quantized experts are split in width only"):
        check_tp(ep, moe, True, cpu, 2)
    check_tp(ep, moe, False, cpu, 2)  # dense experts: fine
    check_tp(make_engine_config("m", tensor_parallel_size=2), moe, True, cpu, 2)
    dense = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=100, num_hidden_layers=1)
    check_tp(ep, dense, True, cpu, 2)  # the flag means nothing to a dense model
