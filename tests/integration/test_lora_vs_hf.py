"""LoRA adapters chosen per prompt: greedy tokens identical to HF + peft (the adapter applied,
and merged into the weights) for tiny Llama and Qwen3 models, with four adapters and rows of
the base model mixed in one batch; more adapters than device slots; prefix KV never shared
across adapters; a moved row keeps its adapter and its tokens."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from batchgen_data import LLM, LoRARequest, SamplingParams
from lora_adapters import hf_greedy, hf_lora_model, write_adapter

# (rank, alpha, targets, rslora): ranks and scalings that differ, one adapter of q/v only
SPECS = [(8, 16, None, False), (4, 32, None, True), (16, 8, None, False),
         (8, 8, ["q_proj", "v_proj"], False)]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    cache: dict[str, list[Path]] = {}

    def make(arch: str) -> list[Path]:
        if arch not in cache:
            base = tiny_model_dir(arch)
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            cache[arch] = [write_adapter(base, root / f"a{i}", seed=10 + i, rank=r, alpha=al,
                                         targets=t, rslora=rs)
                           for i, (r, al, t, rs) in enumerate(SPECS)]
        return cache[arch]

    return make


def prompts_for(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 28))] for _ in range(n)]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int,
           loras: list[LoRARequest | None]) -> list[list[int]]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                        lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def requests(paths: list[Path]) -> list[LoRARequest]:
    return [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]


@pytest.mark.parametrize("arch, kernel", [("llama", None), ("qwen3", None), ("llama", "torch")])
def test_mixed_batch_matches_peft_applied_and_merged(arch: str, kernel: str | None,
                                                     tiny_model_dir, hf_model, adapters,
                                                     monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model_dir(arch)
    base = hf_model(path)
    paths = adapters(arch)
    reqs = requests(paths)
    prompts = prompts_for(base.config.vocab_size, 10, seed=3)
    loras = [None if i % 5 == 4 else reqs[i % 4] for i in range(len(prompts))]
    if kernel is not None:  # the layers' torch path (no C kernel): the C stack takes no LoRA step
        from batchgen_data.worker import lora_manager

        monkeypatch.setattr(lora_manager, "_kernel", lambda backend: kernel)
    llm = LLM(str(path), enable_lora=True, max_loras=4, max_lora_rank=16, block_size=4)
    got = greedy(llm, prompts, 12, loras)
    stack = llm.engine.runner.cpu_stack
    if stack is not None:  # its LoRA decode steps ran in the C stack, unless the layers' kernel
        assert (stack.lora_steps > 0) == (kernel is None)  # is not the stack's
    for merged in (False, True):
        models = {None: base, **{r.lora_int_id: hf_lora_model(base, paths[r.lora_int_id - 1],
                                                                merged) for r in reqs}}
        want = [hf_greedy(models[None if lr is None else lr.lora_int_id], p, 12)
                for p, lr in zip(prompts, loras)]
        assert got == want, f"merged={merged}"
    base_only = greedy(llm, prompts, 12, [None] * len(prompts))
    assert sum(a != b for a, b in zip(got, base_only)) >= 6  # the adapters matter


def test_more_adapters_than_slots_evict_while_rows_run(tiny_model_dir, hf_model, adapters
                                                       ) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model_dir("llama")
    base = hf_model(path)
    paths = adapters("llama")
    reqs = requests(paths)
    prompts = prompts_for(base.config.vocab_size, 12, seed=7)
    loras = [reqs[i % 4] for i in range(len(prompts))]
    # two device slots and two host copies for four adapters: slots change hands while rows
    # of other adapters run, and host copies are read again from disk
    llm = LLM(str(path), enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16)
    got = greedy(llm, prompts, 10, loras)
    models = {r.lora_int_id: hf_lora_model(base, paths[r.lora_int_id - 1], False) for r in reqs}
    assert got == [hf_greedy(models[lr.lora_int_id], p, 10) for p, lr in zip(prompts, loras)]
    manager = llm.engine.runner.lora
    assert manager.slot_evictions >= 2 and len(manager.device_resident()) == 2
    assert len(manager.host_resident()) <= 2 and manager.disk_loads > 4


def test_same_prompt_under_two_adapters_shares_no_prefix_kv(tiny_model_dir, adapters
                                                            ) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model_dir("llama")
    reqs = requests(adapters("llama"))
    llm = LLM(str(path), enable_lora=True, max_loras=2, block_size=4)
    prompt = [[5 + i % 50 for i in range(33)]]
    pool = llm.engine.pool
    first = greedy(llm, prompt, 6, [reqs[0]])
    hits = pool.hits
    again = greedy(llm, prompt, 6, [reqs[0]])  # same adapter: the prefix is reused
    assert again == first and pool.hits > hits
    hits = pool.hits
    other = greedy(llm, prompt, 6, [reqs[1]])
    none = greedy(llm, prompt, 6, [None])
    assert pool.hits == hits  # another adapter, or none: nothing of adapter 0's KV is hit
    fresh = LLM(str(path), enable_lora=True, max_loras=2, block_size=4,
                enable_prefix_caching=False)
    assert other == greedy(fresh, prompt, 6, [reqs[1]])
    assert none == greedy(fresh, prompt, 6, [None])


def test_exported_row_keeps_its_adapter_and_tokens(tiny_model_dir, adapters) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model_dir("qwen3")
    reqs = requests(adapters("qwen3"))
    kw = dict(enable_lora=True, max_loras=2, block_size=4)
    prompt = prompts_for(400, 1, seed=9)[0]
    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    whole = LLM(str(path), **kw).engine
    rid = whole.submit(prompt, sp, lora_request=reqs[2])
    while whole.has_unfinished():
        outs = whole.step()
    want = outs[0].outputs[0].token_ids
    for include_kv in (True, False):  # its KV moved with it, or recomputed there
        src, dst = LLM(str(path), **kw).engine, LLM(str(path), **kw).engine
        rid = src.submit(prompt, sp, lora_request=reqs[2])
        for _ in range(5):
            src.step()
        state = src.export(rid, include_kv=include_kv)
        assert state["lora"] == reqs[2].to_dict()
        dst.import_(state)
        done = []
        while dst.has_unfinished():
            done += dst.step()
        assert done[0].outputs[0].token_ids == want, f"include_kv={include_kv}"


def test_engine_without_enable_lora_refuses_a_request(tiny_model_dir, adapters) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_model_dir("llama")))
    with pytest.raises(ValueError, match="enable_lora"):
        greedy(llm, [[5, 6, 7]], 2, [requests(adapters("llama"))[0]])


def test_refused_adapters_say_why(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    llama, qwen3 = tiny_model_dir("llama"), tiny_model_dir("qwen3")
    llm = LLM(str(llama), enable_lora=True, max_lora_rank=8)
    cases = {
        "DoRA": write_adapter(llama, tmp_path / "dora", 1, use_dora=True),
        "rank 16, over max_lora_rank=8": write_adapter(llama, tmp_path / "big", 2, rank=16),
        "cannot be targeted|not a LoRA weight": write_adapter(llama, tmp_path / "head", 3,
                                                              targets=["lm_head"]),
        "another base model": write_adapter(qwen3, tmp_path / "qwen3", 4),
    }
    (tmp_path / "empty").mkdir()
    cases["no adapter_config.json"] = tmp_path / "empty"
    cases["not a directory"] = tmp_path / "missing"
    for i, (words, where) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=words):
            llm.engine.check_lora(LoRARequest(f"bad{i}", 100 + i, str(where)))
    good = write_adapter(llama, tmp_path / "good", 5)
    llm.engine.check_lora(LoRARequest("good", 1, str(good)))
    with pytest.raises(ValueError, match="already names adapter 'good'"):
        llm.engine.check_lora(LoRARequest("other", 1, str(good)))


def test_moe_model_attention_adapters(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from test_moe_vs_hf import build_moe_model

    path = tmp_path / "moe"
    path.mkdir()
    for f in tiny_model_dir("llama").glob("*token*"):
        shutil.copy(f, path / f.name)
    build_moe_model("qwen3_moe", path, vocab=300)  # layer 1 dense, layers 0 and 2 MoE
    base = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    # attention only: peft turns gate/up/down targets of an MoE model into expert parameters
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapter = write_adapter(path, tmp_path / "a", seed=3, targets=targets)
    llm = LLM(str(path), enable_lora=True, max_loras=1)
    lr = LoRARequest("a", 1, str(adapter))
    prompts = prompts_for(300, 4, seed=5)
    got = greedy(llm, prompts, 10, [lr, None, lr, lr])
    applied = hf_lora_model(base, adapter, merged=False)
    assert got == [hf_greedy(applied if i != 1 else base, p, 10) for i, p in enumerate(prompts)]
    # an adapter of an MoE layer's experts (or of its MLP) is refused by name
    bad = tmp_path / "experts"
    shutil.copytree(adapter, bad)
    save_file({"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight":
               torch.zeros(8, 64), "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight":
               torch.zeros(32, 8)}, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="mixture of experts"):
        llm.engine.check_lora(LoRARequest("experts", 2, str(bad)))
