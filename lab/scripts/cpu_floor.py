"""How fast could any engine run the CPU throughput workloads on this machine? A measured ceiling.

`cpu_throughput.py` compares this engine with HF `generate`; this script asks what the hardware
allows at all, so a missed goal can be told apart from a slow engine. It measures, with the same
thread count and the same SmolLM2-135M-shaped fp32 model:

* `gflops`      fp32 matmul rate on the model's own weight shapes, at 32 and 256 rows (the
                best of a decode batch and of a prefill chunk);
* `weights_ms`  one pass over every weight (a sum of each tensor): the least a decode step costs,
                whatever the batch, because every step reads all 540 MB of fp32 weights;
* `step1_ms`    this engine's measured decode step with a single sequence (the real value of
                the same bound, with attention, norms and sampling);
* `rows_ms`     one pass of all the model's matmuls at 1 to 256 rows (a decode batch
                of that size): how far small batches stay from the weights-pass bound; printed
                for plain `F.linear`, for the oneDNN-packed weights and for the two C kernels
                the engine uses on the CPU (`kernels/cpu/csrc/small_gemm.c`, `panel_gemm.c`);
* `attn_ms`     one layer's decode attention over the paged cache (the model's head shape, a
                random block layout) at 5 and 32 sequences: the torch path (gather + SDPA)
                against the compiled C kernel the engine uses for fp32 caches.

Two lower bounds on a workload's wall time follow, each valid for any engine:
  compute  = (prompt tokens x body FLOPs + output tokens x (body + lm_head) FLOPs) / best gflops
  latency  = the longest request's output length x weights_ms (its decode steps are sequential)
The ceiling is useful output tokens / max(compute, latency); with `--hf-static-tok-s` it also
prints the largest speedup over that HF figure that the ceiling leaves possible.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python lab/scripts/cpu_floor.py --hf-static-tok-s 64.4,16.0
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),  # lab/: batchgen_lab
                str(Path(__file__).resolve().parents[2] / "benchmarks")]
from _common import OUTPUT_LENGTHS, make_workload, print_report  # noqa: E402
from cpu_throughput import (  # noqa: E402
    FIRST_PLAIN_ID, VOCAB_SIZE, default_model_dir, prepare_model_dir)


def _best_of(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_pass_ms(weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    """Best time of one pass of `rows`-row inputs through every weight matrix."""
    xs = [torch.randn(rows, w.shape[1]) for w in weights]

    def run() -> None:
        for x, w in zip(xs, weights):
            torch.nn.functional.linear(x, w)

    return _best_of(run, repeats) * 1e3


def packed_matmul_pass_ms(weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    """`matmul_pass_ms` with each weight pre-packed for oneDNN (`kernels/cpu/linear.py`)."""
    from batchgen_data.kernels.cpu.linear import onednn_linear, pack_onednn

    packed = [pack_onednn(w) for w in weights]
    xs = [torch.randn(rows, w.shape[1]) for w in weights]

    def run() -> None:
        for x, p in zip(xs, packed):
            onednn_linear(x, p, None)

    return _best_of(run, repeats) * 1e3


def c_kernel_pass_ms(kind: str, weights: list[torch.Tensor], rows: int,
                     repeats: int) -> float | None:
    """`matmul_pass_ms` through one of the engine's C matmul kernels (`kernels/cpu/linear.py`):
    kind "small" (`small_linear` on the plain weights), "panel" (`panel_linear` on weights
    repacked by `pack_panels`) or "panel_torch" (`panel_matmul`, torch's batched matmul on the
    same panels: what the engine runs beyond `PANEL_MAX_ROWS` rows). None when that kernel is
    not available here."""
    from batchgen_data.kernels.cpu import linear as cl

    if kind == "small":
        if not cl.small_gemm_available():
            return None
        prepared = weights

        def call(x, p, w):  # type: ignore[no-untyped-def]
            return cl.small_linear(x, p, None)
    else:
        if not cl.panel_gemm_available():
            return None
        prepared = [cl.pack_panels(w) for w in weights]

        panel_fn = cl.panel_linear if kind == "panel" else cl.panel_matmul

        def call(x, p, w):  # type: ignore[no-untyped-def]
            return panel_fn(x, p, None, w.shape[0])
    xs = [torch.randn(rows, w.shape[1]) for w in weights]

    def run() -> None:
        for x, p, w in zip(xs, prepared, weights):
            call(x, p, w)

    return _best_of(run, repeats) * 1e3


def decode_attention_ms(seqs: int, context: int, heads: int, kv_heads: int, head_dim: int,
                        repeats: int) -> dict[str, float]:
    """One layer's decode attention, the engine's torch path vs its C kernel, on the same random
    block layout."""
    from types import SimpleNamespace

    from batchgen_data.kernels.cpu import attention as cpu_attention
    from batchgen_data.layers.attention_torch import decode as _decode_torch

    bs = 16
    nblk = -(-context // bs)
    k_cache = torch.randn(seqs * nblk * 2, bs, kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(k_cache.shape[0])[:seqs * nblk].view(seqs, nblk).int()
    lens = torch.full((seqs,), context, dtype=torch.int32)
    q = torch.randn(seqs, heads, head_dim)
    # the fields of AttentionMetadata that the torch decode path reads
    meta = SimpleNamespace(num_decodes=seqs, decode_blocks=tables.reshape(-1).long(),
                           decode_mask=(torch.arange(nblk * bs)[None] < lens[:, None])[:, None, None, :])
    scale = head_dim ** -0.5
    out = {"torch": round(_best_of(lambda: _decode_torch(q, k_cache, v_cache, meta, scale),
                                   repeats * 4) * 1e3, 3)}
    if cpu_attention.supports(head_dim):
        out["c_kernel"] = round(_best_of(lambda: cpu_attention.paged_decode(
            q, k_cache, v_cache, tables, lens, scale), repeats * 4) * 1e3, 3)
    return out


def matmul_gflops(weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    flops = sum(2 * rows * w.shape[0] * w.shape[1] for w in weights)
    return flops / matmul_pass_ms(weights, rows, repeats) / 1e6


def weights_pass_ms(params: list[torch.Tensor], repeats: int) -> float:
    def run() -> None:
        for p in params:
            p.sum()

    return _best_of(run, repeats) * 1e3


def single_decode_step_ms(model_dir: Path, steps: int) -> float:
    from batchgen_data import LLM, SamplingParams

    llm = LLM(model=str(model_dir), max_num_seqs=4)
    eng = llm.engine
    eng.submit(list(range(FIRST_PLAIN_ID, FIRST_PLAIN_ID + 128)),
               SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0.0))
    for _ in range(4):  # prefill and a few decodes
        eng.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hf-static-tok-s", default=None,
                    help="comma list, one per workload (uniform,longtail): HF static tok/s "
                         "measured by cpu_throughput.py, to print the largest possible speedup")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model_dir = prepare_model_dir(default_model_dir(args.seed), args.seed)
    from safetensors.torch import load_file

    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    params = [t.float().contiguous() for t in state.values()]
    mats = [t for k, t in state.items() if t.dim() == 2 and "embed" not in k]
    embed = next(t for k, t in state.items() if "embed_tokens" in k)
    body_flops = 2 * sum(t.numel() for t in mats)  # per token, without attention scores
    head_flops = 2 * embed.numel()  # tied lm_head, only for tokens that are sampled

    with torch.inference_mode():
        gflops = max(matmul_gflops(mats, rows, args.repeats) for rows in (32, 256))
        weights_ms = weights_pass_ms(params, args.repeats)
        row_counts = (1, 2, 4, 5, 8, 12, 16, 24, 32, 64, 128, 256)
        rows_ms = {rows: round(matmul_pass_ms(mats + [embed], rows, args.repeats), 1)
                   for rows in row_counts}
        packed_ms = {rows: round(packed_matmul_pass_ms(mats + [embed], rows, args.repeats), 1)
                     for rows in row_counts}
        small_ms: dict[int, float] = {}
        panel_ms: dict[int, float] = {}
        panel_torch_ms: dict[int, float] = {}
        for kind, table in (("small", small_ms), ("panel", panel_ms),
                            ("panel_torch", panel_torch_ms)):
            for rows in (r for r in row_counts if kind != "small" or r <= 64):
                ms = c_kernel_pass_ms(kind, mats + [embed], rows, args.repeats)
                if ms is not None:
                    table[rows] = round(ms, 1)
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(str(model_dir))
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        attn_ms = {f"{b}x{ctx}": decode_attention_ms(b, ctx, cfg.num_attention_heads,
                                                     cfg.num_key_value_heads, head_dim, args.repeats)
                   for b, ctx in ((5, 700), (32, 256))}
    step1_ms = single_decode_step_ms(model_dir, 48)
    print(f"threads={args.threads}  matmul {gflops:.1f} GFLOP/s  weights pass {weights_ms:.1f} ms "
          f"({sum(p.numel() for p in params) * 4 / weights_ms / 1e6:.1f} GB/s)  "
          f"single-sequence decode step {step1_ms:.1f} ms", flush=True)
    print("all matmuls (body + lm_head) per decode step, by batch rows: "
          + ", ".join(f"{r}: {ms} ms" for r, ms in rows_ms.items()), flush=True)
    print("the same with oneDNN-packed weights: "
          + ", ".join(f"{r}: {ms} ms" for r, ms in packed_ms.items()), flush=True)
    print("the same with the C small-row kernel: "
          + (", ".join(f"{r}: {ms} ms" for r, ms in small_ms.items()) or "not available here"),
          flush=True)
    print("the same with the C panel kernel: "
          + (", ".join(f"{r}: {ms} ms" for r, ms in panel_ms.items()) or "not available here"),
          flush=True)
    print("the same with torch's batched matmul on the panels (rows > 64 in the engine): "
          + (", ".join(f"{r}: {ms} ms" for r, ms in panel_torch_ms.items())
             or "not available here"), flush=True)
    print("one layer's decode attention (seqs x context): "
          + ", ".join(f"{k}: {v}" for k, v in attn_ms.items()), flush=True)

    hf = [float(x) for x in args.hf_static_tok_s.split(",")] if args.hf_static_tok_s else []
    records = []
    for i, name in enumerate(OUTPUT_LENGTHS):
        reqs = make_workload(name, args.num_requests, args.seed, VOCAB_SIZE, FIRST_PLAIN_ID)
        prompt = sum(len(r.prompt_token_ids) for r in reqs)
        out = sum(r.max_tokens for r in reqs)
        compute_s = (prompt * body_flops + out * (body_flops + head_flops)) / (gflops * 1e9)
        latency_s = max(r.max_tokens for r in reqs) * weights_ms / 1e3
        ceiling = out / max(compute_s, latency_s)
        rec = {"workload": name, "output_tokens": out, "prompt_tokens": prompt,
               "compute_floor_s": round(compute_s, 1), "latency_floor_s": round(latency_s, 1),
               "ceiling_tok_s": round(ceiling, 1),
               "latency_floor_measured_step_s": round(
                   max(r.max_tokens for r in reqs) * step1_ms / 1e3, 1)}
        if i < len(hf):
            rec["hf_static_tok_s"] = hf[i]
            rec["max_speedup_vs_hf_static"] = round(ceiling / hf[i], 2)
        records.append(rec)
    print_report(records, list(records[0]))
    print(json.dumps({"threads": args.threads, "gflops": round(gflops, 1),
                      "weights_pass_ms": round(weights_ms, 1), "single_decode_step_ms": round(step1_ms, 1),
                      "matmul_ms_by_rows": rows_ms, "packed_matmul_ms_by_rows": packed_ms,
                      "small_kernel_matmul_ms_by_rows": small_ms,
                      "panel_kernel_matmul_ms_by_rows": panel_ms,
                      "panel_torch_matmul_ms_by_rows": panel_torch_ms,
                      "decode_attention_ms": attn_ms}))


if __name__ == "__main__":
    main()
