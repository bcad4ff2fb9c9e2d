"""Set-up for the GPU benchmark: run profiles, the random Qwen2.5-0.5B-shaped model (and the
Qwen3-30B-A3B-shaped MoE one), and the correctness check against HF that runs before anything
is timed."""
from __future__ import annotations

import gc
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Profile:
    device: str
    dtype: str  # the benchmark dtype; the check also runs in float32
    threads: int
    num_requests: int
    prompt_len: tuple[int, int]  # inclusive uniform ranges
    output_len: tuple[int, int]
    hf_time_limit: float
    budget_s: float  # HF baselines are skipped or shortened to end the run by then
    model: dict[str, Any]  # config sizes (Qwen2Config, or Qwen3MoeConfig when arch="qwen3_moe")
    engine_kwargs: dict[str, Any]
    check_prompt_lens: tuple[int, ...]
    check_tokens: int
    check_kv_bytes: int | None = None
    cb_config: dict[str, Any] = field(default_factory=dict)
    # the simulator's cost-model fit: runs (prompt, sequences, output tokens), preset name,
    # transfer rates (not measured: spec figures) and the engine shape vLLM picks by default
    sim_calibration: dict[str, Any] = field(default_factory=dict)
    arch: str = "qwen2"  # "qwen2" or "qwen3_moe"

    @classmethod
    def h200(cls) -> "Profile":
        qwen25_05b = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                          num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                          max_position_embeddings=32768)
        # KV for 256 sequences of 2048 tokens is 6.4 GB; the rest of the GPU stays free for HF.
        engine = dict(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048,
                      kv_cache_memory_bytes=8 << 30)
        # prefills of 256-2048 tokens, then decode at 1-256 sequences and 128 / 1024 tokens of
        # context; H200 transfer figures and vLLM's default shape as in the h200-llama8b preset
        sim = dict(runs=[(256, 1, 1), (1024, 1, 1), (2048, 1, 1), (512, 8, 1),
                         (128, 1, 16), (128, 32, 16), (128, 128, 16), (128, 256, 16),
                         (1024, 16, 16), (1024, 64, 16), (1024, 256, 16)],
                   name="h200-qwen0.5b-measured",
                   transfer=dict(pcie_bytes_per_s=50e9, link_bytes_per_s=25e9),
                   shape=dict(max_num_seqs=1024, max_num_batched_tokens=16384))
        # 250 s here and 160 s for the MoE case keep run_gpu.sh under its 450 s timeout
        return cls("cuda", "bfloat16", 4, 256, (100, 1024), (100, 1024), 60.0, 250.0,
                   qwen25_05b, engine, (40, 300, 900), 24, check_kv_bytes=1 << 30,
                   sim_calibration=sim)

    @classmethod
    def quick(cls) -> "Profile":
        tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                    max_position_embeddings=256)
        # few sequences and a small token budget: queueing and chunked prefill happen too
        engine = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
        sim = dict(runs=[(16, 1, 1), (60, 1, 1), (8, 1, 4), (8, 4, 4), (40, 4, 4)],
                   name="cpu-tiny-measured",
                   transfer=dict(pcie_bytes_per_s=10e9, link_bytes_per_s=1.25e9),
                   shape=dict(max_num_seqs=4, max_num_batched_tokens=32))
        return cls("cpu", "float32", 1, 6, (5, 24), (3, 10), 20.0, 50.0, tiny, engine,
                   (7, 20), 6, cb_config={"num_blocks": 16, "page_size": 64},
                   sim_calibration=sim)

    @classmethod
    def h200_moe(cls, layers: int = 8) -> "Profile":
        """Qwen3-30B-A3B's layer shape (128 experts, top-8, expert width 768) with `layers` of
        its 48 layers: all 48 are 61 GB in bf16, which would not fit this machine's disk (the
        script saves the model for the engine to load) next to HF's copy on the GPU."""
        qwen3_30b_a3b = dict(hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                             moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                             norm_topk_prob=True, vocab_size=151936, max_position_embeddings=4096)
        engine = dict(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048,
                      kv_cache_memory_bytes=8 << 30)
        return cls("cuda", "bfloat16", 4, 256, (100, 1024), (100, 1024), 25.0, 160.0,
                   qwen3_30b_a3b, engine, (40, 300), 16, check_kv_bytes=1 << 30,
                   arch="qwen3_moe")

    @classmethod
    def quick_moe(cls) -> "Profile":
        tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=128,
                    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                    norm_topk_prob=True, vocab_size=512, max_position_embeddings=256)
        engine = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
        return cls("cpu", "float32", 1, 4, (5, 16), (3, 8), 15.0, 40.0, tiny, engine, (7,), 4,
                   cb_config={"num_blocks": 16, "page_size": 64}, arch="qwen3_moe")

    @property
    def vocab(self) -> int:
        return self.model["vocab_size"]

    @property
    def heads(self) -> int:
        return self.model["num_attention_heads"]

    @property
    def kv_heads(self) -> int:
        return self.model["num_key_value_heads"]

    @property
    def head_dim(self) -> int:
        return self.model["hidden_size"] // self.heads


def _save_word_tokenizer(path: Path, vocab: int) -> None:
    """A tokenizer with one word per id ("t0" ... ): prompts are token ids, it only detokenises."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(path))


def build_model_dir(path: Path, p: Profile, device: torch.device) -> Path:
    """Random weights (seed 0) in the benchmark dtype, rope theta 1e6, and no EOS token, so
    every system generates exactly max_tokens. Qwen2: tied embeddings, q/k/v bias; Qwen3-MoE:
    untied, as Qwen3-30B-A3B."""
    import transformers

    common = dict(rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if p.arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**p.model, tie_word_embeddings=False, **common)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.Qwen2Config(**p.model, tie_word_embeddings=True,
                                       use_sliding_window=False, **common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg).to(getattr(torch, p.dtype))
    model.save_pretrained(str(path))
    _save_word_tokenizer(path, p.vocab)
    del model
    return path


def load_hf(path: Path, dtype: str, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa")
    return model.to(device).eval()


def free_device(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_against_hf(path: Path, p: Profile, dtype: str, device: torch.device,
                     hf_path: Path | None = None) -> dict[str, Any]:
    """Our greedy tokens vs HF on a few prompts: exact matches of HF `generate`, and whether
    each token we chose is in HF's top-5 given the same prefix (one teacher-forced forward per
    prompt). Near-ties of a random model flip the odd argmax in bfloat16; top-5 must hold.
    `hf_path`: the checkpoint HF loads when it is not ours (a quantized checkpoint's
    dequantized weights)."""
    from batchgen_data import LLM, SamplingParams

    llm = LLM(str(path), device=p.device, dtype=dtype, max_num_seqs=4,
              max_model_len=p.engine_kwargs["max_model_len"],
              kv_cache_memory_bytes=p.check_kv_bytes)
    rng = random.Random(1)
    prompts = [[rng.randrange(p.vocab) for _ in range(n)] for n in p.check_prompt_lens]
    sp = SamplingParams(max_tokens=p.check_tokens, temperature=0, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids) for o in
            llm.generate([{"prompt_token_ids": x} for x in prompts], sp, use_tqdm=False)]
    graphs, mixed = llm.engine.runner.graphs, llm.engine.runner.mixed_graphs
    del llm
    hf = load_hf(hf_path or path, dtype, device)
    exact = in_top5 = total = 0
    for prompt, toks in zip(prompts, ours):
        with torch.inference_mode():
            ids = torch.tensor([prompt + toks[:-1]], device=device)
            logits = hf(input_ids=ids).logits[0, len(prompt) - 1:]  # [len(toks), vocab]
            ref = hf.generate(torch.tensor([prompt], device=device), do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                        device=device),
                              max_new_tokens=len(toks), pad_token_id=0)[0, len(prompt):]
        top5 = logits.float().topk(5, -1).indices.tolist()
        in_top5 += sum(t in row for t, row in zip(toks, top5))
        total += len(toks)
        exact += ref.tolist() == toks
    del hf
    free_device(device)
    return {"bench": "check", "dtype": dtype, "exact_greedy_match": f"{exact}/{len(prompts)}",
            "top5_positions": f"{in_top5}/{total}", "top5_ok": in_top5 == total,
            "cuda_graph_sizes": graphs.sizes if graphs is not None else None,
            "mixed_graph_steps": mixed.steps_run if mixed is not None else None}
