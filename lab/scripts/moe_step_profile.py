"""Where one MoE decode step's time goes: this engine's step split by part, and HF's step beside it.

Same model and prompts as `moe_throughput.py` (random Qwen3-MoE shape: 8 layers, hidden 512,
32 experts of 256, top-4, fp32). For each batch size B the engine gets B prompts of the uniform
workload, runs until every sequence decodes, and then times `--steps` pure-decode steps; the
parts (experts, router, the attention block split into its q|k|v and o matmuls, attention, norms,
rotation and the rest, LM head, input preparation, scheduling) are
timed by wrapping the methods that run them. HF: the same B prompts, left-padded, one forward
over the prompt, then `--steps` single-token forwards with its KV cache (the per-step work of
static `generate`, without its logits processors). Times are CPU seconds of the calling thread
(`time.thread_time`), which a loaded machine inflates less than wall time; run with
`--threads 1` for them to hold all the work.

    .venv/bin/python lab/scripts/moe_step_profile.py --batches 1,4,8,16,32 --threads 1

Prints a table (ms per step) and one JSON line.
"""
from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),  # lab/: batchgen_lab
                str(Path(__file__).resolve().parents[2] / "benchmarks")]
from _common import make_workload, step_until_decode  # noqa: E402
from cpu_throughput import EOS_ID, FIRST_PLAIN_ID, VOCAB_SIZE  # noqa: E402
from moe_throughput import moe_model_dir, print_step_records, step_bench_parser  # noqa: E402

PARTS = ("experts", "router", "qkv", "o", "attn", "norms", "rope", "attn_rest", "lm_head",
         "prepare", "schedule")


def timed(owner: Any, name: str, part: str, acc: collections.Counter) -> None:
    """Replaces `owner.name` by a wrapper that adds its thread time to `acc[part]`."""
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            acc[part] += time.thread_time() - t0

    object.__setattr__(owner, name, wrapper)  # nn.Module.__setattr__ would refuse a function


def ours(model_dir: Path, batch: int, steps: int, seed: int) -> dict[str, float]:
    from batchgen_data import LLM, SamplingParams
    from batchgen_data.layers import moe

    llm = LLM(model=str(model_dir), dtype="float32", max_num_seqs=batch,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    eng = llm.engine
    acc: collections.Counter = collections.Counter()
    model = eng.runner.model
    for layer in model.layers:
        timed(layer, "attend", "attend", acc)  # the whole block; its parts are timed inside
        sa = layer.self_attn
        timed(sa.qkv_proj, "forward", "qkv", acc)
        timed(sa.o_proj, "forward", "o", acc)
        timed(sa.attn, "forward", "attn", acc)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, sa.q_norm, sa.k_norm):
            if norm is not None:
                timed(norm, "forward", "norms", acc)
        if isinstance(layer.mlp, moe.FusedMoE):
            timed(layer.mlp.gate, "forward", "router", acc)
            if layer.mlp._c_experts is not None:  # the one-call C kernel (few tokens)
                timed(layer.mlp, "_c_experts", "experts", acc)
    timed(model.rotary, "forward", "rope", acc)  # one module shared by every layer
    timed(moe, "cpu_fused_experts", "experts", acc)  # FusedMoE.forward looks it up per call
    timed(moe, "route", "router", acc)  # softmax + top-k, likewise
    timed(model, "compute_logits", "lm_head", acc)
    timed(eng.runner, "prepare", "prepare", acc)
    timed(eng.scheduler, "schedule", "schedule", acc)
    for r in make_workload("uniform", batch, seed, VOCAB_SIZE, FIRST_PLAIN_ID):
        eng.submit(r.prompt_token_ids, SamplingParams(max_tokens=steps + 8, ignore_eos=True,
                                                      temperature=0))
    step_until_decode(eng)
    eng.step()  # one decode step off the clock
    acc.clear()
    t0 = time.thread_time()
    for _ in range(steps):
        eng.step()
    total = (time.thread_time() - t0) / steps
    # the attention block's own Python and small ops: what its timed parts leave over
    acc["attn_rest"] = acc["attend"] - sum(acc[p] for p in ("qkv", "o", "attn", "norms", "rope"))
    row = {p: acc[p] / steps * 1e3 for p in PARTS}
    row["step"] = total * 1e3
    row["other"] = row["step"] - sum(row[p] for p in PARTS)
    return row


def hf(model_dir: Path, batch: int, steps: int, seed: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    prompts = [r.prompt_token_ids
               for r in make_workload("uniform", batch, seed, VOCAB_SIZE, FIRST_PLAIN_ID)]
    width = max(map(len, prompts))
    ids = torch.full((batch, width), EOS_ID, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as generate wants
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        elapsed = 0.0
        for i in range(steps + 1):
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            t0 = time.thread_time()
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            if i:  # the first decode step is off the clock
                elapsed += time.thread_time() - t0
    return {"step": elapsed / steps * 1e3}


def main(argv: list[str] | None = None) -> None:
    ap = step_bench_parser(__doc__, batches="1,4,8,16,32", threads=1, count="steps",
                           count_default=6, count_help="timed decode steps per batch size")
    ap.add_argument("--no-hf", action="store_true", help="skip HF's step")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = moe_model_dir(args.seed)
    records = []
    for batch in (int(b) for b in args.batches.split(",")):
        systems = [("ours", ours)] + ([] if args.no_hf else [("hf", hf)])
        for name, fn in systems:
            row = fn(model_dir, batch, args.steps, args.seed)
            records.append({"system": name, "batch": batch,
                            **{k: round(v, 1) for k, v in row.items()}})
            print(f"{name} B={batch} done", file=sys.stderr, flush=True)
    print_step_records("moe_step_profile", records, ["system", "batch", "step", *PARTS, "other"],
                       threads=args.threads, clock="thread_time")

if __name__ == "__main__":
    main()
