"""Quantized checkpoints on the GPU (issue 37): our engine on FP8-block and W4A16 checkpoints
against the same engine on the bf16 model they were made from, HF on the dequantized weights as
the correctness oracle.

Cases (random weights, seed 0, built on the device and saved; `tests/integration/
quant_checkpoints.py` writes the quantized checkpoints in each format's published layout and the
dequantized weights beside them):
  * dense: Qwen2.5-0.5B's shape (`_gpu_setup.Profile.h200`), bf16 vs FP8 with 128x128 block
    scales (`quant_method: fp8`, DeepSeek-V3 / Qwen3-FP8's layout) vs W4A16 (GPTQ, 4 bits,
    groups of 128, symmetric);
  * moe: Qwen3-30B-A3B's layer shape (`--moe-layers` of its 48 layers), bf16 vs FP8-block
    (experts and attention projections quantized; router, embeddings and head stay bf16).
For each quantized checkpoint: the top-5 check first (each of our greedy tokens in HF's top-5 on
the dequantized model given the same prefix), then tok/s of the same requests (random token ids,
EOS ignored) for every format in turn, and the weights' bytes on the device. The goal (issue 37):
FP8 >= 1.5x our bf16 tok/s on the same shape, on an H200.

    PYTHONPATH=. python benchmarks/gpu_quant.py            # the H200 run (run_gpu.sh quant)
    PYTHONPATH=. python benchmarks/gpu_quant.py --quick    # CPU smoke run of the same steps

Prints a table and JSON lines; writes them to $OUT/gpu_quant.json when OUT is set.
"""
from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from _common import tensor_bytes  # noqa: E402
from _gpu_report import Report  # noqa: E402
from _gpu_setup import Profile, build_model_dir, check_against_hf, free_device  # noqa: E402
from gpu_throughput import attempt, make_requests, record, run_ours, warmup_requests  # noqa: E402
from quant_checkpoints import write_quantized  # noqa: E402

FORMATS = {  # name -> write_quantized arguments
    "fp8_block": dict(method="fp8", block=(128, 128)),
    "w4a16": dict(method="gptq", bits=4, group=128, symmetric=True),
}


def weight_bytes(llm: Any) -> int:
    """Bytes of the model's parameters and buffers (the quantized codes and scales included)."""
    return tensor_bytes(llm.engine.runner.model)


def time_engine(report: Report, bench: str, name: str, p: Profile, model_dir: Path,
                requests: list, eager: bool) -> None:
    from batchgen_data import LLM

    llm = LLM(str(model_dir), device=p.device, dtype=p.dtype, enforce_eager=eager,
              **p.engine_kwargs)
    for w in warmup_requests(requests):
        run_ours(llm, [w])
    rec = record(name, requests, run_ours(llm, requests))
    report.add({**rec, "bench": bench, "weights_mib": round(weight_bytes(llm) / 2**20, 1)})
    del llm
    gc.collect()


def quantized_files(qdir: Path) -> dict[str, int]:
    """How many of the checkpoint's tensors hold codes (fp8 or packed ints) and how many not."""
    from safetensors import safe_open

    codes = other = 0
    for f in qdir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                if key.endswith(".qweight") or (
                        key.endswith(".weight") and st.get_slice(key).get_dtype() == "F8_E4M3"):
                    codes += 1
                elif key.endswith(".weight"):
                    other += 1
    return {"quantized_weights": codes, "dense_weights": other}


def run_case(report: Report, bench: str, p: Profile, formats: list[str], seed: int,
             deadline: float) -> bool:
    """Build the bf16 model, quantize it, check each format against HF, time every format."""
    device = torch.device(p.device)
    root = Path(tempfile.mkdtemp(prefix=f"gpu_quant_{bench}_"))
    ok = True
    try:
        src = attempt(report, {"bench": bench, "system": "build"}, build_model_dir,
                      root / "bf16", p, device)
        if src is None:
            return False
        free_device(device)
        dirs: dict[str, Path] = {"bf16": src}
        for fmt in formats:
            t0 = time.perf_counter()
            made = attempt(report, {"bench": f"{bench}_check", "system": fmt}, write_quantized,
                           src, root / fmt, root / f"{fmt}-deq", **FORMATS[fmt])
            if made is None:
                ok = False
                continue
            qdir, ddir = made
            check = attempt(report, {"bench": f"{bench}_check", "system": fmt},
                            check_against_hf, qdir, p, p.dtype, device, hf_path=ddir)
            free_device(device)
            if check is None:
                ok = False
                continue
            report.add({**check, "bench": f"{bench}_check", "system": fmt,
                        "write_s": round(time.perf_counter() - t0, 1), **quantized_files(qdir)})
            ok = ok and check["top5_ok"]
            dirs[fmt] = qdir
            shutil.rmtree(ddir, ignore_errors=True)  # HF is done with it: disk for the next
        requests = make_requests(p, p.vocab, seed)
        for name, path in dirs.items():
            if time.monotonic() > deadline:
                report.add({"bench": bench, "system": name, "error": "skipped: time budget spent"})
                continue
            what = {"bench": bench, "system": name}
            if attempt(report, what, time_engine, report, bench, name, p, path, requests,
                       False) is None and device.type == "cuda":
                attempt(report, what, time_engine, report, bench, name + "_eager", p, path,
                        requests, True)
            free_device(device)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return ok


def ratios(report: Report) -> None:
    """Each format's tok/s over bf16's, per case (the goal: fp8_block >= 1.5x on an H200)."""
    for bench in ("quant_dense", "quant_moe"):
        rows = {r["system"].removesuffix("_eager"): r for r in report.records
                if r.get("bench") == bench and "tok_s" in r}
        base = rows.get("bf16")
        if base is None:
            continue
        for name, r in rows.items():
            if name != "bf16":
                report.add({"bench": f"{bench}_ratio", "system": name,
                            "vs_bf16": round(r["tok_s"] / base["tok_s"], 3),
                            "weights_vs_bf16": round(r["weights_mib"] / base["weights_mib"], 3)})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny models")
    ap.add_argument("--cases", default="dense,moe")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help=f"dense case; comma list of {sorted(FORMATS)} (moe: fp8_block only)")
    ap.add_argument("--requests", type=int, default=128, help="requests per timed run (H200)")
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=260.0,
                    help="no timed run starts after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if set(formats) - set(FORMATS):
        raise SystemExit(f"--formats: {sorted(set(formats) - set(FORMATS))} not in {sorted(FORMATS)}")
    report = Report("gpu_quant", benches=("quant_dense", "quant_moe"))
    ok = True
    cases = args.cases.split(",")
    if "dense" in cases:
        p = Profile.quick() if args.quick else replace(
            Profile.h200(), num_requests=args.requests, prompt_len=(100, 512),
            output_len=(100, 512))
        torch.set_num_threads(p.threads)
        ok = run_case(report, "quant_dense", p, formats, args.seed, deadline) and ok
    if "moe" in cases:
        p = Profile.quick_moe() if args.quick else replace(
            Profile.h200_moe(args.moe_layers), num_requests=args.requests,
            prompt_len=(100, 512), output_len=(100, 512))
        torch.set_num_threads(p.threads)
        ok = run_case(report, "quant_moe", p, ["fp8_block"], args.seed, deadline) and ok
    ratios(report)
    report.table()
    print(f"correctness: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
