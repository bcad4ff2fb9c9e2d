"""Re-partition on the CPU (engine/group/group.py; gloo, two processes, one thread each): two
one-device engines join into one TP=2 engine mid-job when the policy says so, split back, and
join again, every sequence kept and every greedy token equal to HF `generate` (fp32); a rank
killed during a switch fails the group with EngineDeadError within a bounded time.

Each group starts a second process holding a whole engine (~15-40 s on a busy 2-core box).
Rank 0 waits at most `collective_timeout_s` on every collective and handshake.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen_data import SamplingParams
from batchgen_data.engine.driver import EngineDeadError
from batchgen_data.engine.group.group import EngineGroup, PartitionPolicy
from batchgen_data.outputs import RequestOutput

from tests.conftest import build_tiny_model, build_tokenizer
from tests.integration.test_tensor_parallel import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# (prompt, max_tokens): three short rows and a tail of three long ones, spread over both
ROWS = [([5, 6, 7, 8, 9, 10, 11], 6), ([40, 41, 42], 8), (list(range(60, 90)), 7),
        ([7, 300, 12, 99, 5], 30), (list(range(100, 113)), 26), ([3, 1, 4, 1, 5, 9, 2], 34)]
LATE = [([11, 22, 33], 12), (list(range(200, 219)), 10)]  # submitted to the wide engine
KW = dict(num_threads=1, device="cpu", block_size=4, max_num_batched_tokens=32,
          collective_timeout_s=30.0)


def _model(tmp_path: Path, arch: str, **overrides: int) -> Path:
    tok = build_tokenizer(tmp_path)
    build_tiny_model(arch, tmp_path, vocab_size=len(tok) + 3, **overrides)
    return tmp_path


def _want(path: Path, rows: list[tuple[list[int], int]]) -> list[list[int]]:
    return [hf_greedy(path, [p], n)[0] for p, n in rows]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def dies_fast(group: EngineGroup, act: Callable[[], object], match: str, limit_s: float
              ) -> None:
    """`act()` ends the group with EngineDeadError matching `match` within `limit_s`, and
    the group stays dead."""
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=match):
        act()
    assert time.monotonic() - t0 < limit_s
    with pytest.raises(EngineDeadError):  # and stays dead
        group.step()


class Outputs(dict):
    """Finished requests by id; `collect` asserts none is emitted twice."""

    def collect(self, got: list[RequestOutput]) -> None:
        for o in got:
            assert o.request_id not in self  # never emitted twice
            self[o.request_id] = o


def join_step_split_finish(group: EngineGroup, rows: list[tuple[list[int], int]],
                           joined: Callable[[EngineGroup], None],
                           split: Callable[[EngineGroup], None] = lambda g: None,
                           loras: list | None = None) -> tuple[list[str], Outputs]:
    """Submit `rows` (row i under adapter `loras[i]`), step until the policy joins, check
    `joined`, step once, split, check `split`, step to the end; the group is closed either
    way."""
    outs = Outputs()
    loras = loras or [None] * len(rows)
    try:
        ids = [group.submit(p, greedy(n), lora_request=lr) for (p, n), lr in zip(rows, loras)]
        while group.width == 1:
            outs.collect(group.step())
        joined(group)
        outs.collect(group.step())
        group.split()
        split(group)
        while group.has_unfinished():
            outs.collect(group.step())
    finally:
        group.close()
    assert [s.direction for s in group.switches][:2] == ["join", "split"]
    return ids, outs


def test_join_split_and_join_again_keep_every_sequence_and_token(tmp_path: Path) -> None:
    """Qwen2 with one KV head (replicated at TP=2: the KV re-split writes it on both ranks),
    a tied head and an odd vocabulary (403: padded)."""
    torch.set_num_threads(1)
    path = _model(tmp_path, "qwen2", num_key_value_heads=1)
    want = _want(path, ROWS + LATE)
    policy = PartitionPolicy(join_below_seqs=3, wide_step_ratio=0.5, switch_s=0.0)
    group = EngineGroup.from_kwargs(str(path), policy=policy, **KW)
    outs = Outputs()
    collect = outs.collect
    try:
        ids = [group.submit(p, greedy(n)) for p, n in ROWS]
        assert sorted(group.where.values()) == [0, 0, 0, 1, 1, 1]  # both engines hold rows
        while group.width == 1:  # the policy joins once the tail is 3 sequences
            collect(group.step())
            assert group.has_unfinished()
        join = group.switches[0]
        assert join.direction == "join" and join.seqs == 3 and join.kv_bytes > 0
        model = group.engine.runner.model
        assert model.shape.tp.size == 2 and model.shape.num_kv_heads == 1
        assert model.layers[0].self_attn.qkv_proj.out_features == (2 + 1 + 1) * 16
        assert set(group.where.values()) == {0}
        for _ in range(3):
            collect(group.step())
        ids += [group.submit(p, greedy(n)) for p, n in LATE]  # new work for the wide engine
        split = group.split()
        assert split.seqs == 5 and group.width == 1
        assert set(group.where.values()) == {0, 1}  # spread over both engines again
        assert group.engine.runner.model.layers[0].self_attn.qkv_proj.out_features == \
            (4 + 1 + 1) * 16  # whole weights again (all-gathered)
        while group.has_unfinished():  # ... and the policy joins again for the tail
            collect(group.step())
        assert [s.direction for s in group.switches] == ["join", "split", "join"]
    finally:
        group.close()
    assert sorted(outs) == sorted(ids)  # no sequence lost
    assert [list(outs[i].outputs[0].token_ids) for i in ids] == want
    assert all(outs[i].outputs[0].finish_reason == "length" for i in ids)


@pytest.mark.parametrize("arch,ep", [("qwen2_moe", False), ("qwen3_moe", True)],
                         ids=["qwen2_moe-tp", "qwen3_moe-ep"])
def test_moe_engines_join_and_split_with_their_experts_resharded(
        arch: str, ep: bool, tmp_path: Path) -> None:
    """MoE engines join: every expert's width split over the ranks (Qwen2-MoE, with its shared
    expert), or whole experts per rank (Qwen3-MoE with `enable_expert_parallel`, a dense layer
    mixed in); then split back (each expert all-gathered whole). Greedy tokens equal HF
    `generate`."""
    from tests.integration.test_moe_vs_hf import build_moe_model

    torch.set_num_threads(1)
    tok = build_tokenizer(tmp_path)
    build_moe_model(arch, tmp_path, vocab=len(tok) + 3)
    want = _want(tmp_path, ROWS)
    policy = PartitionPolicy(join_below_seqs=3, wide_step_ratio=0.5, switch_s=0.0)
    group = EngineGroup.from_kwargs(str(tmp_path), policy=policy, enable_expert_parallel=ep,
                                    **KW)
    experts = group.engine.runner.model.moe

    def joined(g: EngineGroup) -> None:
        layer = g.engine.runner.model.moe_layers[0]
        if ep:  # half the experts each, whole
            assert layer.w13.shape[:2] == (experts.num_experts // 2, 2 * experts.intermediate)
        else:  # every expert, half its width
            assert layer.w13.shape[:2] == (experts.num_experts, experts.intermediate)

    def whole_again(g: EngineGroup) -> None:
        assert g.engine.runner.model.moe_layers[0].w13.shape[:2] == (
            experts.num_experts, 2 * experts.intermediate)

    ids, outs = join_step_split_finish(group, ROWS, joined, whole_again)
    assert [list(outs[i].outputs[0].token_ids) for i in ids] == want


def test_fp8_kv_engines_join_and_split_with_their_scales(tmp_path: Path) -> None:
    """FP8 KV caches (`kv_cache_dtype="fp8"`) with the checkpoint's own K/V scales: the KV
    moves as e4m3 codes and the scales go with the weights, so greedy tokens equal HF
    `generate` over a cache rounded through e4m3 with those scales (test_fp8_kv_cache.py's
    oracle), through a join and a split."""
    from safetensors.torch import save_file

    from tests.integration.test_fp8_kv_cache import hf_greedy as hf_e4m3

    torch.set_num_threads(1)
    path = _model(tmp_path, "llama", num_key_value_heads=2)
    scales = [(0.0125, 0.02), (0.004, 0.004)]
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(scales[0][0]),
               "model.layers.0.self_attn.v_scale": torch.tensor(scales[0][1]),
               "model.layers.1.self_attn.kv_scale": torch.tensor(scales[1][0])},
              str(path / "kv_scales.safetensors"))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = [hf_e4m3(hf, p, n, scales=scales) for p, n in ROWS]
    policy = PartitionPolicy(join_below_seqs=3, wide_step_ratio=0.5, switch_s=0.0)
    group = EngineGroup.from_kwargs(str(path), policy=policy, kv_cache_dtype="fp8", **KW)

    def joined(g: EngineGroup) -> None:
        assert g.engine.runner.kv.dtype == torch.float8_e4m3fn
        got = [(a.kv_scales.k, a.kv_scales.v) for a in g.engine.runner.model.modules()
               if hasattr(a, "kv_scales")]
        # the shard's, carried from the full model (fp32)
        assert [x for ks in got for x in ks] == pytest.approx([x for ks in scales for x in ks])

    ids, outs = join_step_split_finish(group, ROWS, joined)
    assert [list(outs[i].outputs[0].token_ids) for i in ids] == want


def test_a_rank_killed_during_the_switch_fails_the_group_fast(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    path = _model(tmp_path, "llama", num_key_value_heads=2)
    group = EngineGroup.from_kwargs(str(path), **KW)

    def kill_in_reshard(phase: str) -> None:
        if phase == "reshard":
            group.ranks.procs[0].kill()

    try:
        for p, n in ROWS[:4]:
            group.submit(p, greedy(n))
        for _ in range(3):
            group.step()
        group.on_phase = kill_in_reshard
        dies_fast(group, group.repartition, "rank 1 exited", 20.0)
    finally:
        group.close()


def test_llm_with_data_parallel_engines_and_repartition(tmp_path: Path) -> None:
    """The front door: `LLM(data_parallel_size=2)` runs two one-device engines as a group
    (rows spread over both); with `repartition` a policy joins them for the tail. Greedy tokens
    equal HF `generate` either way, in the order asked."""
    from batchgen_data import LLM

    torch.set_num_threads(1)
    path = _model(tmp_path, "llama")
    want = _want(path, ROWS)
    prompts = [{"prompt_token_ids": p} for p, _ in ROWS]
    params = [greedy(n) for _, n in ROWS]
    llm = LLM(str(path), data_parallel_size=2, **KW)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.switches == []  # no policy: the two engines only
        # abort reaches the engine that holds the request: rank 0's now, the other's with its
        # next step; both come back as aborted outputs and leave the group
        group = llm.engine
        ids = [group.submit(p, greedy(30)) for p, _ in ROWS[:2]]
        assert sorted(group.where[r] for r in ids) == [0, 1]
        assert all(group.abort(r) for r in ids) and not group.abort("not-here")
        outs = []
        while group.has_unfinished():
            outs += group.step()
        assert sorted(o.request_id for o in outs) == sorted(ids)
        assert all(o.outputs[0].finish_reason == "abort" for o in outs)
    finally:
        llm.close()
    assert [list(o.outputs[0].token_ids) for o in got] == want
    llm = LLM(str(path), data_parallel_size=2, **KW, repartition=PartitionPolicy(
        join_below_seqs=3, wide_step_ratio=0.5, switch_s=0.0))
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [s.direction for s in llm.engine.switches][:1] == ["join"]
        with pytest.raises(ValueError, match="programs need one engine"):
            llm.run([{"x": 1}], program=None)  # type: ignore[arg-type]
    finally:
        llm.close()
    assert [list(o.outputs[0].token_ids) for o in got] == want
