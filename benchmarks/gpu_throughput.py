"""GPU throughput in one device call: this engine against HF continuous batching and HF `generate`.

1. Builds a model with Qwen2.5-0.5B's shape and random weights (seed 0), saved with a word-level
   tokenizer (prompts are token ids), so every system loads the same files.
2. Checks correctness first: greedy tokens against HF in float32, and in the benchmark dtype
   (bfloat16) that each token we chose is in HF's top-5 given the same prefix.
3. Times the engine, then HF static `generate` and HF continuous batching, on 256 requests with
   prompt and output lengths uniform in [100, 1024], random token ids, EOS ignored. The HF runs
   are time-boxed (`--hf-time-limit`) and reported over the tokens and requests they finished.
4. Measures decode-attention bandwidth against a plain copy (benchmarks/kernel_bench.py).
5. Times the engine's steps for the cluster simulator's cost model (`sim.calibrate`: prefills
   up to 2k tokens, decode batches of 1-256 sequences at 128 and 1024 tokens of context) and
   writes the fitted preset to $OUT/sim_preset_<device>.json, for
   `python -m batchgen_lab.sim --preset that.json` on any machine.
6. MoE (when the engine has Qwen3-MoE; skipped with a record saying so otherwise): a random
   bf16 model with Qwen3-30B-A3B's layer shape (`--moe-layers` of its 48 layers), the bf16
   top-5 check, then ours vs HF static and continuous batching on 256 requests of U[100, 1024]
   in and out, with tokens/s and tokens per expert per step for each system; and the fused
   MoE kernel alone against the per-expert torch loop (benchmarks/moe_kernel_bench.py).

Prints a table and JSON lines; writes everything to $OUT/gpu_throughput.json when OUT is set.
Needs only torch, triton, transformers and this project (no ray, no pyspark).

    PYTHONPATH=. python benchmarks/gpu_throughput.py          # the H200 run, < 7.5 minutes
    PYTHONPATH=. python benchmarks/gpu_throughput.py --quick  # CPU smoke run of the same steps
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from batchgen_data import LLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_moe import HFExpertCounter, expert_load_mark, expert_load_since, moe_available  # noqa: E402
from _gpu_report import Report  # noqa: E402
from _gpu_setup import (  # noqa: E402
    Profile,
    build_model_dir,
    check_against_hf,
    free_device,
    load_hf,
)
from _hf_baselines import Outcome, Request, hf_continuous, hf_static  # noqa: E402



def make_requests(p: Profile, vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(vocab) for _ in range(rng.randint(*p.prompt_len))],
                    rng.randint(*p.output_len)) for _ in range(p.num_requests)]


def record(system: str, requests: list[Request], out: Outcome) -> dict[str, Any]:
    """Useful tokens (capped at each request's max_tokens) and tokens of finished requests."""
    got = [min(len(o), r.max_tokens) for o, r in zip(out.outputs, requests)]
    fin = [g == r.max_tokens for g, r in zip(got, requests)]
    fin_tokens = sum(g for g, f in zip(got, fin) if f)
    return {"bench": "throughput", "system": system, "finished": f"{sum(fin)}/{len(requests)}",
            "output_tokens": sum(got), "finished_tokens": fin_tokens,
            "wall_s": round(out.wall_s, 2), "tok_s": round(sum(got) / out.wall_s, 1),
            "tok_s_finished": round(fin_tokens / out.wall_s, 1), **out.extra}


def run_ours(llm: Any, requests: list[Request]) -> Outcome:
    from batchgen_data import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
              for r in requests]
    stats = llm.engine.stats
    steps0, load0 = stats.num_steps, expert_load_mark(stats)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    runner = llm.engine.runner
    mixed = runner.mixed_graphs
    extra = {"engine_steps": stats.num_steps - steps0,
             "cuda_graph_sizes": runner.graphs.sizes if runner.graphs is not None else None,
             "mixed_graph_steps": mixed.steps_run if mixed is not None else None}
    load = expert_load_since(stats, load0)
    if load is not None:
        extra["tokens_per_expert"] = load
    return Outcome([list(o.outputs[0].token_ids) for o in outs], wall, extra)


def kernel_bandwidth(p: Profile) -> list[dict[str, Any]]:
    import kernel_bench

    args = kernel_bench.parse_args(["--dtype", "bfloat16", "--heads", str(p.heads),
                                    "--kv-heads", str(p.kv_heads), "--head-dim", str(p.head_dim)])
    return kernel_bench.measure(args)


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"bench": "env", "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton_version, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "ray_or_pyspark_imported": sorted(m for m in ("ray", "pyspark") if m in sys.modules)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, few requests")
    ap.add_argument("--hf-time-limit", type=float, default=None, help="seconds per HF baseline")
    ap.add_argument("--systems", default="ours,hf_static,hf_cb,moe",
                    help="sim: fit the lab simulator's cost model on this device (needs "
                         "PYTHONPATH=lab: the simulator is not part of the package); "
                         "moe: the Qwen3-MoE case (ours and the listed HF systems)")
    ap.add_argument("--moe-layers", type=int, default=8,
                    help="layers of the Qwen3-30B-A3B-shaped model (of 48)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def warmup_requests(requests: list[Request]) -> list[Request]:
    """Short prompts of a few sizes (each prefill tile variant compiles once), 4 tokens each."""
    return [Request(r.prompt_token_ids[:n], 4) for r, n in zip(requests, (16, 48, 200))]


def attempt(report: Report, what: dict[str, Any], fn: Any, *args: Any, **kw: Any) -> Any:
    """Run one phase; on failure record the error (traceback on stderr) and return None, so
    that one broken phase does not cost the rest of a scarce device run."""
    try:
        return fn(*args, **kw)
    except Exception as e:
        traceback.print_exc()
        report.add({**what, "error": repr(e)[:500]})
        return None


def run_engine(report: Report, p: Profile, model_dir: Path, requests: list[Request],
               eager: bool, bench: str = "throughput") -> bool:
    llm = LLM(str(model_dir), device=p.device, dtype=p.dtype, enforce_eager=eager,
              **p.engine_kwargs)
    for w in warmup_requests(requests):  # one prompt per step: each prefill tile compiles
        run_ours(llm, [w])
    rec = record("ours" + ("_eager" if eager else ""), requests, run_ours(llm, requests))
    report.add({**rec, "bench": bench})
    del llm
    gc.collect()
    return True


def sim_calibration(p: Profile, model_dir: Path) -> dict[str, Any]:
    """Fit the simulator's step-time model on this device (see lab/batchgen_lab/sim/calibrate.py)."""
    from batchgen_lab.sim.calibrate import calibrate

    cal = p.sim_calibration
    cm, diag = calibrate(str(model_dir), repeats=1, runs=cal["runs"], device=p.device,
                         name=cal["name"], dtype=p.dtype, **cal["transfer"], **p.engine_kwargs)
    cm = replace(cm, **cal["shape"])  # the shape vLLM would pick on this device
    out = os.environ.get("OUT")
    if out:
        (Path(out) / f"sim_preset_{p.device}.json").write_text(cm.to_json())
    return {"bench": "sim_calibration", "preset": cm.name, "c0_ms": round(cm.c0 * 1e3, 4),
            "c_tok_us": round(cm.c_tok * 1e6, 4), "c_kv_ns": round(cm.c_kv * 1e9, 4),
            "c_seq_us": round(cm.c_seq * 1e6, 4), "kv_capacity_tokens": cm.kv_capacity_tokens,
            **diag}


def hf_baselines(report: Report, bench: str, p: Profile, model_dir: Path,
                 requests: list[Request], systems: list[str], deadline: float,
                 time_limit: float | None) -> None:
    """HF static `generate` and continuous batching, each time-boxed to end by `deadline`;
    MoE records also get HF's tokens per expert per step."""
    names = [n for n in ("hf_static", "hf_cb") if n in systems]
    if not names:
        return
    device = torch.device(p.device)
    hf = load_hf(model_dir, p.dtype, device)
    for name in names:
        fn = hf_static if name == "hf_static" else hf_continuous
        what = {"bench": bench, "system": name}
        if deadline - time.monotonic() < 20:
            report.add({**what, "error": "skipped: time budget spent"})
            continue
        kw = {"cb_config": p.cb_config} if name == "hf_cb" else {}
        if attempt(report, what, fn, hf, warmup_requests(requests), 600, **kw) is None:
            continue
        counter = HFExpertCounter(p.model["num_experts_per_tok"]).attach(hf) \
            if p.arch == "qwen3_moe" else None
        limit = min(time_limit or p.hf_time_limit, deadline - time.monotonic() - 10)
        out = attempt(report, what, fn, hf, requests, max(limit, 5.0), **kw)
        if counter is not None:
            counter.detach()
            if out is not None:
                out.extra["tokens_per_expert"] = counter.summary()
        if out is not None:
            report.add({**record(name, requests, out), "bench": bench})
    del hf
    free_device(device)


def dense_case(report: Report, p: Profile, args: argparse.Namespace) -> bool:
    """Checks (fp32 greedy, bf16 top-5), then throughput, bandwidth, simulator fit and HF."""
    deadline = time.monotonic() + p.budget_s
    device = torch.device(p.device)
    model_dir = build_model_dir(Path(tempfile.mkdtemp(prefix="gpu_bench_")), p, device)
    requests = make_requests(p, p.vocab, args.seed)
    checks = [attempt(report, {"bench": "check", "dtype": dtype}, check_against_hf,
                      model_dir, p, dtype, device) for dtype in dict.fromkeys(["float32", p.dtype])]
    for c in checks:
        if c is not None:
            report.add(c)
    systems = args.systems.split(",")
    if "ours" in systems:
        what = {"bench": "throughput", "system": "ours"}
        if attempt(report, what, run_engine, report, p, model_dir, requests, False) is None \
                and device.type == "cuda":  # no number at all is the worst outcome
            attempt(report, what, run_engine, report, p, model_dir, requests, True)
        free_device(device)
        if device.type == "cuda":
            for row in attempt(report, {"bench": "decode_attention"}, kernel_bandwidth, p) or []:
                report.add(row)
        if "sim" in systems:
            rec = attempt(report, {"bench": "sim_calibration"}, sim_calibration, p, model_dir)
            if rec is not None:
                report.add(rec)
            free_device(device)
    hf_baselines(report, "throughput", p, model_dir, requests, systems, deadline,
                 args.hf_time_limit)
    shutil.rmtree(model_dir, ignore_errors=True)
    return all(c is not None and c["top5_ok"] for c in checks)


def moe_case(report: Report, p: Profile, args: argparse.Namespace) -> bool:
    """The Qwen3-MoE case: bf16 top-5 check, then ours vs HF with tokens per expert. True
    when it passed or was skipped (a record says why)."""
    if not moe_available():
        report.add({"bench": "moe_check", "skipped": "batchgen_data.models has no qwen3_moe"})
        return True
    deadline = time.monotonic() + p.budget_s
    device = torch.device(p.device)
    model_dir = attempt(report, {"bench": "moe_check"}, build_model_dir,
                        Path(tempfile.mkdtemp(prefix="gpu_bench_moe_")), p, device)
    if model_dir is None:
        return False
    free_device(device)
    check = attempt(report, {"bench": "moe_check", "dtype": p.dtype}, check_against_hf,
                    model_dir, p, p.dtype, device)
    if check is not None:
        report.add({**check, "bench": "moe_check"})
    requests = make_requests(p, p.vocab, args.seed)
    systems = args.systems.split(",")
    if "ours" in systems:
        attempt(report, {"bench": "moe_throughput", "system": "ours"}, run_engine, report, p,
                model_dir, requests, False, bench="moe_throughput")
        free_device(device)
        if device.type == "cuda":  # the kernel alone, one layer's shape, 1-8192 tokens
            import moe_kernel_bench

            for row in attempt(report, {"bench": "fused_moe"}, moe_kernel_bench.measure,
                               moe_kernel_bench.parse_args([])) or []:
                report.add(row)
            free_device(device)
    hf_baselines(report, "moe_throughput", p, model_dir, requests, systems, deadline, None)
    shutil.rmtree(model_dir, ignore_errors=True)
    return check is not None and check["top5_ok"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    p = Profile.quick() if args.quick else Profile.h200()
    torch.set_num_threads(p.threads)
    report = Report()
    report.add(environment(torch.device(p.device)))  # after every import the engine needs
    ok = dense_case(report, p, args)
    if "moe" in args.systems.split(","):
        moe = Profile.quick_moe() if args.quick else Profile.h200_moe(args.moe_layers)
        ok = moe_case(report, moe, args) and ok
    report.add({"bench": "imports", "ray_or_pyspark_imported":
                sorted(m for m in ("ray", "pyspark") if m in sys.modules)})
    report.table()
    print(f"correctness: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # HF's continuous-batching thread may outlive a time-boxed run; do not wait for it.
    os._exit(code)
