"""Weights beyond device memory: this engine's streamed weights vs HF accelerate offload (issue 16).

The same random model and prompts run through (1) HF transformers with accelerate's
`device_map="auto"` and `max_memory` capped to a device weight budget (`generate` at the best of
a few batch sizes), and (2) this engine under the same budget (`weight_memory_bytes`, the absolute form of
`cpu_offload_gb`). Printed
per system: output tokens/s, weight bytes moved host -> device per output token, and the
physical bound (measured host -> device bandwidth / bytes moved per output token) with the share
of it reached. A table, then one JSON line per system.

    python benchmarks/offload.py --cpu                 # smoke: tiny Llama, CPU "device"
    python benchmarks/offload.py --model llama8b       # H200: Llama-3-8B shape, bf16 (~16 GB)
    python benchmarks/offload.py --model qwen3moe      # H200: Qwen3-30B-A3B shape, bf16 (~61 GB)
    python benchmarks/offload.py --model tiny          # GPU: a quick check of the CUDA path
    python benchmarks/offload.py --cpu --model tiny_moe  # smoke of the MoE rows (below)

For an MoE model the engine runs twice: streaming only the routed experts (the default,
`batchgen_data`) and whole layers (`stream_experts=False`, `batchgen_data_whole_layers`); the
summary's `expert_vs_layer_bytes` is the ratio of their bytes moved per output token.

With `--kv-host-tier-bytes N` the engine also runs with the KV host tier (`host_kv_tier_bytes`,
row `batchgen_data_kv_host_tier`): sequences beyond the device KV cache (`--kv-device-bytes`
caps it, for both engine rows) keep their KV in host memory, so a step carries more sequences
and each streamed layer serves more tokens. The summary's `kv_tier_vs_device_bytes` is its
weight bytes per output token over the device-KV row's; the check then also compares its greedy
tokens with the resident engine's.

    python benchmarks/offload.py --cpu --num-requests 16 --kv-device-bytes 150000 \
        --kv-host-tier-bytes 4000000               # smoke of the host-tier row

On the H200 the one command is `bash benchmarks/run_gpu.sh offload [llama8b|qwen3moe]`: the
CUDA path's check on `tiny` (streamed == resident greedy tokens), then the model, each timed and
bounded to fit one device call. Without accelerate (or with `--no-hf`) the HF row is left out and
the engine is reported against the physical bound alone. With OUT set, the JSON lines also go to
$OUT/offload_<model>.json.

The budget is a quarter of the weights (`--budget-frac`). On the CPU accelerate has no device to
offload to, so its overflow goes to disk (`offload_folder`): the smoke run checks the plumbing,
never the speed. The H200 models are random (seed 0) and saved once under `--workdir`. On the
CPU our engine runs its plain linear layout (`cpu_kernels=False`): on AVX-512 the panel kernels
pad the tiny model's matrices (a 256x64 weight to 256x96), which would put what streams 20%
above the checkpoint's bytes and a quarter of the checkpoint under one layer's slot.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_report  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(arch="llama", hidden_size=64, intermediate_size=256, num_hidden_layers=12,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "tiny_moe": dict(arch="qwen3_moe", hidden_size=64, intermediate_size=128,
                     moe_intermediate_size=64, num_experts=16, num_experts_per_tok=2,
                     norm_topk_prob=True, num_hidden_layers=12, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512),
    "llama8b": dict(arch="llama", hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    vocab_size=128256, rope_theta=500000.0),
    "qwen3moe": dict(arch="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, vocab_size=151936),
}


def build_model_dir(path: Path, name: str, dtype: torch.dtype, device: torch.device,
                    num_layers: int | None = None) -> Path:
    """Random weights (seed 0), no EOS token (every request generates exactly its length);
    `num_layers` cuts the shape's decoder layers (same layer shape, fewer of them)."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    if (path / "config.json").exists():
        return path
    shape = dict(SHAPES[name])
    arch = shape.pop("arch")
    if num_layers:
        shape["num_hidden_layers"] = num_layers
    common = dict(max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                  pad_token_id=0, tie_word_embeddings=False, **shape)
    cfg_cls, model_cls = ((tf.LlamaConfig, tf.LlamaForCausalLM) if arch == "llama"
                          else (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM))
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # a 30B model never exists in fp32 (120 GB)
    try:
        with torch.device(device):
            model = model_cls(cfg_cls(**common)).eval()
    finally:
        torch.set_default_dtype(prev)
    model.save_pretrained(str(path))
    vocab = shape["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(path))
    del model
    return path


def weight_bytes_of(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                s = st.get_slice(key)
                n = 1
                for d in s.get_shape():
                    n *= d
                total += n * torch.finfo(getattr(torch, _dtype_name(s.get_dtype()))).bits // 8
    return total


def _dtype_name(st_dtype: str) -> str:
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[st_dtype]


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_hf(path: Path, prompts: list[list[int]], out_len: int, budget: int, dtype: torch.dtype,
           cuda: bool, batch_sizes: list[int], limit_s: float) -> dict[str, Any]:
    """accelerate `device_map="auto"` under `max_memory`; the best batch size's tok/s. Bytes
    moved: the weights placed off the device (`hf_device_map`), once per forward call."""
    from transformers import AutoModelForCausalLM

    max_memory: dict[Any, Any] = ({0: budget, "cpu": "110GiB"} if cuda else {"cpu": budget})
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, device_map="auto", max_memory=max_memory,
        offload_folder=str(path / "hf_offload")).eval()
    off = ("cpu", "disk") if cuda else ("disk",)
    moved_per_call = sum(p.numel() * p.element_size() for name, p in _named_weights(path, dtype)
                         if _placement(model.hf_device_map, name) in off)
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    best: dict[str, Any] = {}
    device = "cuda:0" if cuda else "cpu"
    for bs in batch_sizes:
        start, tokens, calls[0] = time.perf_counter(), 0, 0
        for i in range(0, len(prompts), bs):
            batch = prompts[i:i + bs]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                                device=device)
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                               max_new_tokens=out_len, pad_token_id=0)
            tokens += out_len * len(batch)
            if time.perf_counter() - start > limit_s:
                break  # time box: measured on what finished
        wall = time.perf_counter() - start
        rec = dict(hf_batch_size=bs, output_tokens=tokens, wall_s=round(wall, 3),
                   tok_s=tokens / wall, bytes_per_token=moved_per_call * calls[0] / tokens)
        if not best or rec["tok_s"] > best["tok_s"]:
            best = rec
    best["offloaded_bytes"] = moved_per_call
    del model
    _free(cuda)
    return best


def _named_weights(path: Path, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
    return list(meta.to(dtype).named_parameters())


def _placement(device_map: dict[str, Any], name: str) -> Any:
    """Where accelerate put parameter `name`: its longest module prefix in the device map."""
    parts = name.split(".")
    for i in range(len(parts), -1, -1):
        key = ".".join(parts[:i])
        if key in device_map:
            return device_map[key]
    return device_map.get("", None)


def run_engine(path: Path, prompts: list[list[int]], out_len: int, budget: int,
               dtype: str, device: str, stream_experts: bool = True, **engine_kw: Any
               ) -> dict[str, Any]:
    from batchgen_data import LLM, SamplingParams

    # the absolute cap: the engine's own weight count includes buffers (the rotary cache) that
    # the checkpoint lacks, so a cpu_offload_gb from checkpoint bytes would give it more room
    llm = LLM(str(path), dtype=dtype, device=device, weight_memory_bytes=budget,
              max_model_len=max(map(len, prompts)) + out_len + 1,
              stream_experts=stream_experts, **_layout_kw(device), **engine_kw)
    sp = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.engine.stats
    rec = dict(output_tokens=tokens, wall_s=round(wall, 3), tok_s=tokens / wall,
               bytes_per_token=stats.offload_bytes_moved / tokens,
               peak_resident_bytes=stats.offload_peak_resident_bytes,
               max_batch_seqs=stats.max_batch_seqs, kv_host_seqs_peak=stats.kv_host_seqs_peak,
               kv_host_bytes_per_token=stats.kv_host_bytes_moved / tokens)
    del llm
    _free(device.startswith("cuda"))
    return rec


def check_outputs(path: Path, prompts: list[list[int]], budget: int, dtype: str, device: str,
                  tier_kw: dict[str, int] | None = None) -> bool:
    """Greedy tokens of the streamed engine (and of the host-tier one, with `tier_kw`) equal
    the all-resident engine's (run before timing; all eager, so all run the same kernels)."""
    from batchgen_data import LLM, SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    outs = []
    runs: list[dict[str, Any]] = [{}, {"weight_memory_bytes": budget}]
    if tier_kw:
        runs.append({"weight_memory_bytes": budget, **tier_kw})
    for kw in runs:
        llm = LLM(str(path), dtype=dtype, device=device, enforce_eager=True,
                  max_model_len=max(map(len, prompts)) + 9, **_layout_kw(device), **kw)
        outs.append([o.outputs[0].token_ids for o in llm.generate(reqs, sp, use_tqdm=False)])
        del llm
        _free(device.startswith("cuda"))
    return all(o == outs[0] for o in outs[1:])


def _layout_kw(device: str) -> dict[str, Any]:
    """The CPU run keeps weights byte for byte as in the checkpoint (module docstring)."""
    return {"cpu_kernels": False} if device == "cpu" else {}


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="smoke run: tiny model, CPU device")
    ap.add_argument("--model", choices=sorted(SHAPES), default=None)
    ap.add_argument("--budget-frac", type=float, default=0.25, help="device weight budget")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--hf-time-limit", type=float, default=90.0,
                    help="seconds per HF batch size (measured on what finished)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip comparing streamed and resident greedy outputs first")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="fewer decoder layers of the same shape (a shorter device call)")
    ap.add_argument("--no-hf", dest="hf", action="store_false",
                    help="leave HF accelerate out (as when it is not installed)")
    ap.add_argument("--kv-device-bytes", type=int, default=None,
                    help="the engine's device KV cache in bytes (kv_cache_memory_bytes)")
    ap.add_argument("--kv-host-tier-bytes", type=int, default=0,
                    help="> 0: also run the engine with this KV host tier (host_kv_tier_bytes)")
    args = ap.parse_args()
    cuda = not args.cpu and torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    name = args.model or ("llama8b" if cuda else "tiny")
    dtype_name = "bfloat16" if cuda else "float32"
    dtype = getattr(torch, dtype_name)
    big = cuda and name not in ("tiny", "tiny_moe")
    # on the H200 ours takes all requests as one batch where KV allows; HF gets that size too
    n = args.num_requests or (1024 if big else 64 if cuda else 4)
    lo, hi = args.prompt_len or ((64, 128) if cuda else (4, 10))
    out_len = args.output_len or (32 if cuda else 4)
    hf_sizes = args.hf_batch_sizes or (sorted({min(256, n), n}) if cuda else [4])
    workdir = args.workdir or Path(tempfile.gettempdir()) / "batchgen_offload_bench"
    phases: dict[str, float] = {}  # seconds per phase: does the run fit one device call?
    t0 = time.perf_counter()
    path = build_model_dir(workdir / f"{name}-{args.num_layers or 'all'}", name, dtype,
                           torch.device(device), args.num_layers)
    phases["build_s"] = time.perf_counter() - t0
    total = weight_bytes_of(path)
    budget = int(total * args.budget_frac)
    prompts = make_prompts(n, lo, hi, SHAPES[name]["vocab_size"])

    from batchgen_data.worker.offload import measure_rates

    kv_kw = {} if args.kv_device_bytes is None else {"kv_cache_memory_bytes": args.kv_device_bytes}
    tier_kw = ({**kv_kw, "host_kv_tier_bytes": args.kv_host_tier_bytes}
               if args.kv_host_tier_bytes else None)
    t0 = time.perf_counter()
    same = (check_outputs(path, prompts[:8], budget, dtype_name, device, tier_kw)
            if args.check else None)
    phases["check_s"] = time.perf_counter() - t0
    print(f"check (streamed == resident greedy tokens): "
          f"{'skipped' if same is None else 'PASS' if same else 'FAIL'}")

    bw = measure_rates(torch.device(device), dtype).copy_bytes_per_s
    systems = []
    has_hf = args.hf and importlib.util.find_spec("accelerate") is not None
    print(f"HF accelerate: {'running' if has_hf else 'unavailable (left out)'}")
    if has_hf:
        t0 = time.perf_counter()
        systems.append(("hf_accelerate", run_hf(path, prompts, out_len, budget, dtype, cuda,
                                                hf_sizes, args.hf_time_limit)))
        phases["hf_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = run_engine(path, prompts, out_len, budget, dtype_name, device, **kv_kw)
    phases["ours_s"] = time.perf_counter() - t0
    systems.append(("batchgen_data", ours))
    if tier_kw:  # KV beyond the device cache in host memory: bigger steps per streamed layer
        systems.append(("batchgen_data_kv_host_tier",
                        run_engine(path, prompts, out_len, budget, dtype_name, device,
                                   **tier_kw)))
    moe = SHAPES[name]["arch"] != "llama"
    if moe:  # the same engine streaming whole MoE layers: what routing-aware copies save
        systems.append(("batchgen_data_whole_layers",
                        run_engine(path, prompts, out_len, budget, dtype_name, device,
                                   stream_experts=False, **kv_kw)))
    records = []
    for system, rec in systems:
        bound = bw / rec["bytes_per_token"] if rec["bytes_per_token"] else None
        records.append(dict(system=system, model=name, weight_bytes=total, budget_bytes=budget,
                            h2d_bytes_per_s=round(bw), **rec,
                            bound_tok_s=bound,
                            frac_of_bound=rec["tok_s"] / bound if bound else None))
    row = {r["system"]: r for r in records}
    hf = row.get("hf_accelerate")
    if hf:
        row["batchgen_data"]["vs_hf_accelerate"] = row["batchgen_data"]["tok_s"] / hf["tok_s"]
    print_report(records, ["system", "model", "tok_s", "bytes_per_token", "bound_tok_s",
                           "frac_of_bound", "max_batch_seqs", "wall_s"])
    # the least any system with this budget moves per output token when it streams whole
    # layers: the weights beyond it, once per output position, with all n requests in the same
    # pass (streaming only the routed experts of an MoE can go below it)
    floor = (total - budget) / n
    summary = {"summary": "offload", "model": name, "device": device, "num_requests": n,
               "num_layers": args.num_layers or SHAPES[name]["num_hidden_layers"],
               "check": same, "hf_accelerate": "ran" if hf else "unavailable",
               "speedup_vs_hf_accelerate": row["batchgen_data"].get("vs_hf_accelerate"),
               "floor_bytes_per_token": floor, "floor_bound_tok_s": bw / floor,
               **{k: round(v, 1) for k, v in phases.items()}}
    if moe:  # bytes per output token, expert-granular over whole-layer streaming
        summary["expert_vs_layer_bytes"] = (row["batchgen_data"]["bytes_per_token"]
                                            / row["batchgen_data_whole_layers"]["bytes_per_token"])
    if tier_kw:  # bytes per output token, with the KV host tier over device KV only
        summary["kv_tier_vs_device_bytes"] = (
            row["batchgen_data_kv_host_tier"]["bytes_per_token"]
            / row["batchgen_data"]["bytes_per_token"])
    print(json.dumps(summary))
    if os.environ.get("OUT"):  # the device call brings $OUT back
        with open(Path(os.environ["OUT"]) / f"offload_{name}.json", "w") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in [*records, summary])


if __name__ == "__main__":
    main()
