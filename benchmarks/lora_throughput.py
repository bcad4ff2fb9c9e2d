"""Many LoRA adapters in one engine: completion time of a job whose rows name 8 adapters,
interleaved, against running the same engine one adapter at a time and against HF + peft
switching adapters; and one decode step under adapters against the base model's step.

Workload (uniform): `--adapters` random rank-`--rank` adapters of q/k/v/o and gate/up/down,
`--rows-per-adapter` rows each, interleaved (row i names adapter i % adapters), prompts of
`--prompt-len` random ids, exactly `--max-tokens` greedy tokens each (no EOS stops a row).

* ours, mixed: one `LLM(enable_lora=True, max_loras=adapters)`, every row in one `generate`;
* ours, one adapter at a time: the same engine, one `generate` per adapter (what a user does
  without multi-LoRA: a job per adapter, each waiting for the last);
* HF + peft: the adapters loaded into one `PeftModel`, `set_adapter` then one left-padded
  `generate` of that adapter's rows, adapter by adapter;
* the ceiling: the same rows on the base model (an engine without enable_lora, no adapters),
  all in one `generate` against one `generate` per adapter's group of rows. No LoRA engine can
  gain more from batching the groups together than the base model does on this machine (where
  a step's cost grows with its rows, e.g. a CPU's compute-bound decode, that is little).
Each is run `--repeats` times round-robin; the table shows medians (and min-max).

Step time: `--step-rows` rows decoding, one step timed `--step-repeats` times (median): rows
spread over the adapters, against the same rows on an engine without enable_lora (its fastest
path, the C decode stack where it runs) and on the per-layer path that the LoRA steps take.
Goals: mixed >= 3x lower completion time than one adapter at a time; a LoRA step <= 1.3x the
base model's step at rank 16.

    .venv/bin/python benchmarks/lora_throughput.py --repeats 3
    .venv/bin/python benchmarks/lora_throughput.py --quick   # smoke run: tiny sizes, no HF
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, step_until_decode, wait_for_quiet  # noqa: E402

from batchgen_data import LLM, LoRARequest, SamplingParams  # noqa: E402

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapters(model_dir: Path, out: Path, n: int, rank: int) -> list[Path]:
    """`n` random PEFT adapters (the files `save_pretrained` writes) for the model's shapes."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv, h, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, \
        cfg.hidden_size, cfg.intermediate_size
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    paths = []
    for a in range(n):
        gen = torch.Generator().manual_seed(a)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for proj, part in TARGETS.items():
                fan_in, fan_out = dims[proj]
                key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) \
                    / fan_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) \
                    * 0.02
        path = out / f"adapter{a}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
            "target_modules": list(TARGETS), "bias": "none", "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(model_dir)}))
        paths.append(path)
    return paths


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)]
            for _ in range(args.adapters * args.rows_per_adapter)]


def ours_mixed(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None],
               sp: SamplingParams) -> tuple[float, list[list[int]]]:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                        lora_request=[loras[i % len(loras)] for i in range(len(prompts))])
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def ours_one_at_a_time(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None],
                       sp: SamplingParams) -> tuple[float, list[list[int]]]:
    llm.reset_prefix_cache()
    tokens: dict[int, list[int]] = {}
    start = time.perf_counter()
    for a, lora in enumerate(loras):
        rows = list(range(a, len(prompts), len(loras)))
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in rows], sp,
                            use_tqdm=False, lora_request=lora)
        tokens.update({i: o.outputs[0].token_ids for i, o in zip(rows, outs)})
    return time.perf_counter() - start, [tokens[i] for i in range(len(prompts))]


def hf_peft_switching(model: Any, prompts: list[list[int]], names: list[str],
                      max_tokens: int) -> float:
    start = time.perf_counter()
    for a, name in enumerate(names):
        model.set_adapter(name)
        rows = [prompts[i] for i in range(a, len(prompts), len(names))]
        ids = torch.tensor(rows)  # one prompt length: no padding needed
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start


def decoding(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None],
             steps: int) -> None:
    """Submit these rows (each with its adapter or None) and step until every one decodes."""
    sp = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for p, lr in zip(prompts, loras):
        llm.engine.submit(p, sp, lora_request=lr)
    step_until_decode(llm.engine)
    llm.engine.step()  # one decode step before timing: warm caches and buffers


def step_times(engines: dict[str, LLM], repeats: int) -> dict[str, float]:
    """Median seconds of one decode step of each engine, the engines stepped in turn (so a
    neighbour's load falls on all of them alike)."""
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(repeats):
        for name, llm in engines.items():
            t0 = time.perf_counter()
            llm.engine.step()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="local model dir (default: the embedded one)")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rows-per-adapter", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-rows", type=int, default=32)
    ap.add_argument("--step-repeats", type=int, default=20)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF + peft baseline")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for every system (1 on a loaded box: a busy neighbour "
                         "stalls each multi-threaded small op for milliseconds)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny sizes, no HF, no waiting for a quiet machine")
    ap.add_argument("--wait-quiet", type=float, default=120.0,
                    help="seconds to wait for the load average to drop under 1.5 first")
    args = ap.parse_args()
    if args.quick:
        args.adapters, args.rows_per_adapter, args.max_tokens = 2, 2, 4
        args.step_rows, args.step_repeats, args.no_hf = 4, 3, True
        args.prompt_len, args.wait_quiet = 16, 0.0
    load = wait_for_quiet(args.wait_quiet, below=1.5)
    if args.threads:
        torch.set_num_threads(args.threads)

    from batchgen_data.models.loader import resolve_model_path

    model_dir = resolve_model_path(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    paths = write_adapters(model_dir, tmp, args.adapters, args.rank)
    loras = [LoRARequest(f"adapter{a}", a + 1, str(p)) for a, p in enumerate(paths)]
    kw = dict(max_num_seqs=max(64, args.step_rows), max_model_len=args.prompt_len
              + max(args.max_tokens, args.step_repeats + 8) + 16)
    if args.threads:
        kw["num_threads"] = args.threads
    llm = LLM(args.model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              **kw)
    vocab = llm.engine.vocab_size
    prompts = workload(args, vocab)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    ours_mixed(llm, prompts[: 2 * args.adapters], loras, sp)  # warm-up: adapters into memory

    hf = None
    if not args.no_hf:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf = PeftModel.from_pretrained(base, str(paths[0]), adapter_name="adapter0")
        for a, p in enumerate(paths[1:], 1):
            hf.load_adapter(str(p), adapter_name=f"adapter{a}")
        hf.eval()
    names = [f"adapter{a}" for a in range(args.adapters)]

    base_llm = LLM(args.model, **kw)
    no_adapter = [None] * args.adapters
    ours_mixed(base_llm, prompts[: 2 * args.adapters], no_adapter, sp)  # warm-up
    walls: dict[str, list[float]] = {"mixed": [], "one_at_a_time": [], "hf_peft": [],
                                     "base_mixed": [], "base_one_at_a_time": []}
    same_tokens = True
    for _ in range(args.repeats):  # round-robin: a neighbour's load falls on all alike
        t, mixed_tokens = ours_mixed(llm, prompts, loras, sp)
        walls["mixed"].append(t)
        t, single_tokens = ours_one_at_a_time(llm, prompts, loras, sp)
        walls["one_at_a_time"].append(t)
        same_tokens &= mixed_tokens == single_tokens
        walls["base_mixed"].append(ours_mixed(base_llm, prompts, no_adapter, sp)[0])
        walls["base_one_at_a_time"].append(ours_one_at_a_time(base_llm, prompts, no_adapter,
                                                              sp)[0])
        if hf is not None:
            walls["hf_peft"].append(hf_peft_switching(hf, prompts, names, args.max_tokens))

    rows = args.step_rows
    step_prompts = workload(argparse.Namespace(adapters=rows, rows_per_adapter=1,
                                               prompt_len=args.prompt_len), vocab)
    del hf
    engines = {"lora": llm, "lora_engine_no_adapter": LLM(args.model, enable_lora=True,
                                                          max_loras=args.adapters,
                                                          max_lora_rank=args.rank, **kw),
               "base": base_llm}
    fast = engines["base"].engine.runner.cpu_stack is not None
    if fast:  # the per-layer path the LoRA steps take, without the adapters
        per_layer = LLM(args.model, **kw)
        runner = per_layer.engine.runner
        runner.fast_paths = [p for p in runner.fast_paths if p is not runner.cpu_stack]
        engines["base_per_layer"] = per_layer
    for name, engine in engines.items():
        decoding(engine, step_prompts, [loras[i % len(loras)] if name == "lora" else None
                                        for i in range(rows)], args.step_repeats)
    step = step_times(engines, args.step_repeats)
    lora_step, none_step, base_step = step["lora"], step["lora_engine_no_adapter"], step["base"]
    layer_step = step.get("base_per_layer", base_step)

    n_rows = len(prompts)
    med = {k: statistics.median(v) for k, v in walls.items() if v}
    records = [
        {"system": "ours, 8 adapters mixed in one engine" if args.adapters == 8 else
         f"ours, {args.adapters} adapters mixed", "completion_s": med["mixed"],
         "range_s": spread(walls["mixed"]), "rows_per_s": n_rows / med["mixed"]},
        {"system": "ours, one adapter at a time", "completion_s": med["one_at_a_time"],
         "range_s": spread(walls["one_at_a_time"]), "rows_per_s": n_rows / med["one_at_a_time"]},
    ]
    if "hf_peft" in med:
        records.append({"system": "HF + peft, switching adapters", "completion_s": med["hf_peft"],
                        "range_s": spread(walls["hf_peft"]), "rows_per_s": n_rows / med["hf_peft"]})
    for key, name in (("base_mixed", "ceiling: base model, all rows at once"),
                      ("base_one_at_a_time", "ceiling: base model, one group at a time")):
        records.append({"system": name, "completion_s": med[key], "range_s": spread(walls[key]),
                        "rows_per_s": n_rows / med[key]})
    print(f"# {n_rows} rows over {args.adapters} adapters (rank {args.rank}), prompt "
          f"{args.prompt_len}, {args.max_tokens} tokens each; medians of {args.repeats}; "
          f"{torch.get_num_threads()} threads; load average at start {load:.1f}")
    print(format_table(records, ["system", "completion_s", "range_s", "rows_per_s"]))
    steps = [
        {"step": f"{rows} rows over {min(rows, args.adapters)} adapters", "ms": 1e3 * lora_step},
        {"step": f"{rows} rows, no adapter (LoRA engine)", "ms": 1e3 * none_step},
        {"step": f"{rows} rows, base engine{' (C decode stack)' if fast else ''}",
         "ms": 1e3 * base_step},
        {"step": f"{rows} rows, base engine per-layer path", "ms": 1e3 * layer_step},
    ]
    print(format_table(steps, ["step", "ms"]))
    summary = {
        "benchmark": "lora_throughput", "rows": n_rows, "adapters": args.adapters,
        "rank": args.rank, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "threads": torch.get_num_threads(),
        "load_at_start": round(load, 2), "load_at_end": round(os.getloadavg()[0], 2),
        "completion_s": {k: round(v, 3) for k, v in med.items()},
        "speedup_vs_one_at_a_time": round(med["one_at_a_time"] / med["mixed"], 2),
        "speedup_vs_hf_peft": round(med["hf_peft"] / med["mixed"], 2) if "hf_peft" in med
        else None,
        # the same ratio for the base model: what batching the groups buys on this machine
        "base_model_all_at_once_vs_one_group_at_a_time":
            round(med["base_one_at_a_time"] / med["base_mixed"], 2),
        "same_tokens_mixed_and_one_at_a_time": same_tokens,
        "step_ms": {"lora": round(1e3 * lora_step, 2), "lora_engine_no_adapter":
                    round(1e3 * none_step, 2), "base": round(1e3 * base_step, 2),
                    "base_per_layer": round(1e3 * layer_step, 2)},
        "lora_step_vs_base": round(lora_step / base_step, 3),
        "lora_step_vs_base_per_layer": round(lora_step / layer_step, 3),
        "goals": {"speedup_vs_one_at_a_time": ">= 3", "lora_step_vs_base": "<= 1.3"},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
