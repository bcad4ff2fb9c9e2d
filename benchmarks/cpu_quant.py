"""Quantized decode on the CPU: our fp32 engine vs the same engine on a quantized checkpoint vs
HF static `generate` on the dequantized model, one process, the same requests.

The model has SmolLM2-135M's shape (random weights, `cpu_throughput.py`'s seed and directory).
`--quant int8` writes a compressed-tensors pack-quantized W8A16 checkpoint (per channel),
`int4` W4A16 (groups of 128), `fp8` compressed-tensors float-quantized FP8 per channel; the
projections are quantized, the tied embedding/head stays fp32 (as llm-compressor leaves
`lm_head`). HF runs the dequantized weights (weight-only semantics), so greedy agreement with it
says whether the quantized kernels compute the same model. Every request decodes exactly its
max_tokens (EOS ignored); tok/s is useful output tokens over the generation call's wall time.
Memory per engine: the model's tensor bytes and the process RSS growth while it was built.

    .venv/bin/python benchmarks/cpu_quant.py --quant int8,int4,fp8 --repeat 3
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import make_workload, tensor_bytes, wait_for_quiet  # noqa: E402
from cpu_throughput import (  # noqa: E402
    FIRST_PLAIN_ID, VOCAB_SIZE, HFStatic, Ours, _agreement, _useful_tokens, _warm_up,
    default_model_dir, prepare_model_dir)

QUANTS = ("int8", "int4", "fp8")
_TARGETS = ("_proj.weight",)


def _rss() -> int:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _quantize(w: torch.Tensor, quant: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Checkpoint tensors of one projection (compressed-tensors layout) and its dequantized
    weight."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = w.shape
    if quant == "fp8":
        scale = w.abs().amax(-1, keepdim=True) / 448.0
        q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale}, q.float() * scale
    bits, group = (8, k) if quant == "int8" else (4, 128)
    qmax = (1 << (bits - 1)) - 1
    groups = -(-k // group)
    wp = torch.nn.functional.pad(w, (0, groups * group - k)).view(n, groups, group)
    scale = wp.abs().amax(-1) / (qmax + 0.5)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.clamp(torch.round(wp / scale[..., None]), -qmax - 1, qmax)
    deq = (codes * scale[..., None]).view(n, -1)[:, :k]
    codes = codes.view(n, -1)[:, :k].to(torch.int8)
    return ({"weight_packed": pack_to_int32(codes, bits), "weight_scale": scale,
             "weight_shape": torch.tensor([n, k])}, deq)


def _ct_config(quant: str) -> dict[str, Any]:
    bits, strategy, group = {"int8": (8, "channel", None), "int4": (4, "group", 128),
                             "fp8": (8, "channel", None)}[quant]
    weights = {"num_bits": bits, "type": "float" if quant == "fp8" else "int",
               "symmetric": True, "strategy": strategy, "group_size": group, "dynamic": False}
    return {"quant_method": "compressed-tensors",
            "format": "float-quantized" if quant == "fp8" else "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}},
            "ignore": ["lm_head"], "quantization_status": "compressed"}


def prepare_quantized(src: Path, quant: str) -> tuple[Path, Path]:
    """(quantized checkpoint, dequantized dense checkpoint) next to `src`, written once."""
    from safetensors.torch import load_file, save_file

    qdir, ddir = src.with_name(src.name + f"-{quant}"), src.with_name(src.name + f"-{quant}-deq")
    if (qdir / "config.json").exists() and (ddir / "config.json").exists():
        return qdir, ddir
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    out, dense = {}, {}
    for name, w in tensors.items():
        if name.endswith(_TARGETS) and w.dim() == 2:
            pieces, deq = _quantize(w.float(), quant)
            out.update({f"{name[:-len('.weight')]}.{p}": t for p, t in pieces.items()})
            dense[name] = deq.contiguous()
        else:
            out[name] = dense[name] = w
    for d, ts, qc in ((qdir, out, _ct_config(quant)), (ddir, dense, None)):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                (d / f.name).write_bytes(f.read_bytes())
        if qc is not None:
            cfg = json.loads((d / "config.json").read_text())
            cfg["quantization_config"] = qc
            (d / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
    return qdir, ddir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quant", default="int8,int4,fp8", help=f"comma list of {QUANTS}")
    p.add_argument("--workloads", default="uniform,longtail")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="decode batch (default: all requests at once)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-hf", action="store_true", help="skip HF static generate")
    p.add_argument("--hf-repeat", type=int, default=1,
                   help="HF runs per workload (the first rounds; it is the slow one)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS")
    args = p.parse_args(argv)
    args.quant = [q for q in args.quant.split(",") if q]
    for q in args.quant:
        if q not in QUANTS:
            p.error(f"--quant: unknown {q!r}; valid: {', '.join(QUANTS)}")
    args.workloads = [w for w in args.workloads.split(",") if w]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    src = prepare_model_dir(default_model_dir(args.seed), args.seed)
    kw = {"dtype": "float32", "max_num_seqs": args.max_num_seqs or args.num_requests,
          "max_num_batched_tokens": 2048, "enable_prefix_caching": False}
    systems: list[tuple[str, Any, dict[str, Any]]] = []
    for name, path in [("ours_fp32", src)] + [(f"ours_{q}", prepare_quantized(src, q)[0])
                                               for q in args.quant]:
        before = _rss()
        system = Ours(path, kw)
        mem = {"weight_bytes": tensor_bytes(system.llm.engine.runner.model),
               "rss_growth": _rss() - before}
        systems.append((name, system, mem))
    if not args.no_hf:
        from transformers import AutoModelForCausalLM
        for q in args.quant:
            before = _rss()
            hf = AutoModelForCausalLM.from_pretrained(str(prepare_quantized(src, q)[1]),
                                                      dtype=torch.float32,
                                                      attn_implementation="sdpa").eval()
            systems.append((f"hf_static_{q}_deq", HFStatic(hf, None),
                            {"weight_bytes": tensor_bytes(hf), "rss_growth": _rss() - before}))
    for _, s, _ in systems:
        _warm_up(s, args.seed)

    rows = []
    for workload in args.workloads:
        requests = make_workload(workload, args.num_requests, args.seed, VOCAB_SIZE,
                                 FIRST_PLAIN_ID)
        runs: dict[str, list[tuple[float, list[list[int]]]]] = {n: [] for n, _, _ in systems}
        # tokens per second of process CPU time: less sensitive to other jobs taking the cores
        cpu_rate: dict[str, list[float]] = {n: [] for n, _, _ in systems}
        for round_ in range(args.repeat):  # interleaved: drifting load hits every system alike
            for name, s, _ in systems:
                if name.startswith("hf") and round_ >= args.hf_repeat:
                    continue
                if args.wait_quiet:
                    wait_for_quiet(args.wait_quiet)
                cpu0 = time.process_time()
                run = s.run(requests, 3600)
                cpu_s = time.process_time() - cpu0
                useful, _ = _useful_tokens(requests, run.outputs)
                runs[name].append((useful / run.wall_s, run.outputs))
                cpu_rate[name].append(useful / cpu_s)
                print(f"  {name:<18} {workload:<8} {useful / run.wall_s:7.1f} tok/s "
                      f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr)
        base = statistics.median(t for t, _ in runs["ours_fp32"])
        base_cpu = statistics.median(cpu_rate["ours_fp32"])
        for name, _, mem in systems:
            toks = [t for t, _ in runs[name]]
            q = name.split("_")[1] if name.startswith("hf") else name[len("ours_"):]
            ref = runs.get(f"hf_static_{q}_deq")
            rows.append({"system": name, "workload": workload,
                         "tok_s": round(statistics.median(toks), 1),
                         "tok_s_min": round(min(toks), 1), "tok_s_max": round(max(toks), 1),
                         "vs_ours_fp32": round(statistics.median(toks) / base, 2),
                         "tok_per_cpu_s": round(statistics.median(cpu_rate[name]), 1),
                         "cpu_vs_ours_fp32": round(statistics.median(cpu_rate[name]) / base_cpu,
                                                   2),
                         "agree_vs_hf_deq": (_agreement(runs[name][0][1], ref[0][1])
                                             if ref and not name.startswith("hf") else None),
                         "weight_mib": round(mem["weight_bytes"] / 2**20, 1)
                         if mem["weight_bytes"] else None,
                         "rss_growth_mib": round(mem["rss_growth"] / 2**20, 1)})
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    print(json.dumps({"benchmark": "cpu_quant", "threads": args.threads,
                      "num_requests": args.num_requests, "repeat": args.repeat,
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                      "load1": round(os.getloadavg()[0], 2), "rows": rows}))


if __name__ == "__main__":
    main()
