"""LoRA adapters at tensor_parallel_size=2 (gloo, two processes, one thread each): each rank keeps
its part of every adapter (B's rows of q|k|v and gate|up, A's columns of o and down, whose
partial products the layer's all-reduce sums), rank 0 tells the other rank which adapter each
slot holds before the step that uses it, and each step carries every token row's slot. Greedy
tokens equal HF + peft (the adapter applied) for a batch mixing four adapters and the base
model, with more adapters than device slots (slots refilled mid-job), for Llama (two KV heads,
split) and Qwen2 (one KV head, replicated on both ranks)."""
from __future__ import annotations

import pytest
import torch

from batchgen_data import LLM
from lora_adapters import hf_greedy, hf_lora_model, write_adapter
from test_lora_vs_hf import SPECS, greedy, prompts_for, requests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize("arch,max_loras", [("llama", 4), ("qwen2", 2)])
def test_tp2_mixed_adapters_match_peft(arch: str, max_loras: int, tiny_model_dir, hf_model,
                                       tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.conftest import build_tiny_model, build_tokenizer

    torch.set_num_threads(1)
    if arch == "qwen2":  # one KV head: each rank holds it (and its adapter's k/v rows) whole
        path = tmp_path / "qwen2-kv1"
        build_tiny_model(arch, path, vocab_size=len(build_tokenizer(path)) + 1,
                         num_key_value_heads=1)
    else:
        path = tiny_model_dir(arch)
    base = hf_model(path)
    paths = [write_adapter(path, tmp_path / f"a{i}", seed=10 + i, rank=r, alpha=al,
                           targets=t, rslora=rs) for i, (r, al, t, rs) in enumerate(SPECS)]
    reqs = requests(paths)
    prompts = prompts_for(base.config.vocab_size, 10, seed=3)
    loras = [None if i % 5 == 4 else reqs[i % 4] for i in range(len(prompts))]
    llm = LLM(str(path), enable_lora=True, max_loras=max_loras, max_lora_rank=16,
              block_size=4, tensor_parallel_size=2, device="cpu", num_threads=1,
              collective_timeout_s=60.0)
    try:
        assert llm.engine.runner.ranks.size == 2
        got = greedy(llm, prompts, 12, loras)
        slot_loads = llm.engine.runner.lora.slot_loads
    finally:
        llm.engine.runner.close()
    models = {None: base, **{r.lora_int_id: hf_lora_model(base, paths[r.lora_int_id - 1],
                                                            False) for r in reqs}}
    want = [hf_greedy(models[None if lr is None else lr.lora_int_id], p, 12)
            for p, lr in zip(prompts, loras)]
    assert got == want
    assert slot_loads >= 4  # every adapter filled a slot (refills when slots are fewer)


def test_a_group_with_adapters_joins_and_splits(tiny_model_dir, hf_model,
                                                tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two one-device engines with enable_lora join into one TP=2 engine for the tail and split
    back: each request keeps its adapter (export / import carry it), the joined engine's
    ranks read their parts of the adapters, the split engines theirs whole again; greedy
    tokens equal HF + peft."""
    from batchgen_data.engine.group.group import EngineGroup, PartitionPolicy
    from tests.integration.test_partition import KW, ROWS, join_step_split_finish

    torch.set_num_threads(1)
    path = tiny_model_dir("llama")
    base = hf_model(path)
    paths = [write_adapter(path, tmp_path / f"a{i}", seed=20 + i, rank=r, alpha=al,
                           targets=t, rslora=rs) for i, (r, al, t, rs) in enumerate(SPECS)]
    reqs = requests(paths)
    loras = [reqs[i % 4] if i % 3 else None for i in range(len(ROWS))]
    policy = PartitionPolicy(join_below_seqs=3, wide_step_ratio=0.5, switch_s=0.0)
    group = EngineGroup.from_kwargs(str(path), policy=policy, enable_lora=True, max_loras=4,
                                    max_lora_rank=16, **KW)

    def joined(g: EngineGroup) -> None:
        assert g.engine.runner.ranks.size == 2 and g.engine.runner.lora is not None

    ids, outs = join_step_split_finish(group, ROWS, joined, loras=loras)
    models = {None: base, **{r.lora_int_id: hf_lora_model(base, paths[r.lora_int_id - 1],
                                                            False) for r in reqs}}
    want = [hf_greedy(models[None if lr is None else lr.lora_int_id], p, n)
            for (p, n), lr in zip(ROWS, loras)]
    assert [list(outs[i].outputs[0].token_ids) for i in ids] == want
