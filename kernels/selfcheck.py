"""Every Triton kernel, compiled for this machine's GPU and run against its torch reference.

    python -m batchgen_data.kernels.selfcheck [--quick] [--json PATH]

A user on new hardware (or this project's GPU script, before it times anything) runs it to
learn whether the compiled kernels compute what the references compute: bf16 and fp16, head
dims 64/128/256 and MLA's 576, contexts up to 8k, GQA groups 1-8 (prefill: 3 too; 128 for
MLA), and one CUDA-graph capture and replay of a decode step against eager. Each case reports
its error as ``max|got - want| / max|want|`` (a relative error that stays meaningful for
outputs near zero) against a tolerance set by the dtype; the exit code is 1 when a case fails,
2 when there is no CUDA device. Prints a table and one JSON line. Needs torch with CUDA and
triton; imports nothing else of the engine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from batchgen_data.kernels.selfcheck_quant import case_fp8_block, case_mxfp4, case_quant

# relative error allowed: a few units of the output dtype's rounding after fp32 accumulation
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    scale = max(float(want.abs().max()), 1e-6)
    return float((got - want).abs().max()) / scale


def _paged(num_seqs: int, lens: list[int], kv_heads: int, dim: int, block: int,
           dtype: torch.dtype, dev: torch.device, gen: torch.Generator
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables int32, seq_lens int32), blocks shuffled."""
    per = [-(-n // block) for n in lens]
    width = max(per)
    total = sum(per) + 3
    k = torch.randn(total, block, kv_heads, dim, generator=gen).to(dtype).to(dev)
    v = torch.randn(total, block, kv_heads, dim, generator=gen).to(dtype).to(dev)
    order = torch.randperm(total, generator=gen).tolist()
    tables, at = [], 0
    for n in per:
        row = order[at:at + n]
        at += n
        tables.append(row + [0] * (width - n))
    return (k, v, torch.tensor(tables, dtype=torch.int32, device=dev),
            torch.tensor(lens, dtype=torch.int32, device=dev))


def case_decode(dtype: torch.dtype, dim: int, group: int, ctx: int, dev: torch.device,
                **extra: object) -> float:
    """`extra`: the launchers' sliding_window / sinks (True: random ones) / softcap."""
    from batchgen_data.kernels import paged_decode_attention, reference

    gen = torch.Generator().manual_seed(dim * 7 + ctx)
    kv_heads, seqs = 2, 4
    lens = [ctx, max(1, ctx // 3), 1, max(1, ctx - 17)]
    k, v, tables, seq_lens = _paged(seqs, lens, kv_heads, dim, 16, dtype, dev, gen)
    q = torch.randn(seqs, kv_heads * group, dim, generator=gen).to(dtype).to(dev)
    scale = dim ** -0.5
    kw = _extra(extra, kv_heads * group, gen, dev)
    got = paged_decode_attention(q, k, v, tables, seq_lens, scale, **kw)
    want = reference.paged_decode_attention(q, k, v, tables, seq_lens, scale, **kw)
    return rel_err(got, want)


def _extra(extra: dict, heads: int, gen: torch.Generator, dev: torch.device) -> dict:
    """A window / sinks / soft-cap case's keyword arguments (sinks=True: random logits)."""
    kw = dict(extra)
    if kw.get("sinks") is True:
        kw["sinks"] = (torch.randn(heads, generator=gen) * 2).to(dev)
    return kw


def case_prefill(dtype: torch.dtype, dim: int, group: int, ctx: int, dev: torch.device,
                 **extra: object) -> float:
    from batchgen_data.kernels import paged_prefill_attention, reference

    gen = torch.Generator().manual_seed(dim * 11 + ctx)
    kv_heads = 2
    lens = [ctx, max(2, ctx // 2), 37]
    q_lens = [min(n, q) for n, q in zip(lens, (min(ctx, 512), 64, 37))]
    k, v, tables, seq_lens = _paged(len(lens), lens, kv_heads, dim, 16, dtype, dev, gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=dev)
    q = torch.randn(sum(q_lens), kv_heads * group, dim, generator=gen).to(dtype).to(dev)
    scale = dim ** -0.5
    kw = _extra(extra, kv_heads * group, gen, dev)
    got = paged_prefill_attention(q, k, v, tables, cu, seq_lens, scale,
                                  max_seqlen_q=max(q_lens), **kw)
    want = reference.paged_prefill_attention(q, k, v, tables, cu, seq_lens, scale, **kw)
    return rel_err(got, want)


def case_write_kv(dtype: torch.dtype, dim: int, dev: torch.device) -> float:
    from batchgen_data.kernels import reference, write_kv_cache

    gen = torch.Generator().manual_seed(dim)
    k = torch.randn(50, 4, dim, generator=gen).to(dtype).to(dev)
    v = torch.randn(50, 4, dim, generator=gen).to(dtype).to(dev)
    slots = torch.randperm(64 * 16, generator=gen)[:50].to(dev)
    slots[3] = -1
    caches = [torch.zeros(64, 16, 4, dim, dtype=dtype, device=dev) for _ in range(4)]
    write_kv_cache(k, v, caches[0], caches[1], slots)
    reference.write_kv_cache(k, v, caches[2], caches[3], slots)
    return max(rel_err(caches[0], caches[2]), rel_err(caches[1], caches[3]))


def case_norm_rotary_act(dtype: torch.dtype, dim: int, dev: torch.device) -> float:
    from batchgen_data.kernels import (apply_rotary, fused_add_rms_norm, reference, rms_norm,
                                       silu_and_mul)

    gen = torch.Generator().manual_seed(dim + 1)
    x = torch.randn(37, 896, generator=gen).to(dtype).to(dev)
    w = torch.randn(896, generator=gen).to(dtype).to(dev)
    errs = [rel_err(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))]
    res = torch.randn_like(x)
    a, ra = fused_add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    b, rb = reference.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    errs += [rel_err(a, b), rel_err(ra, rb)]
    gu = torch.randn(37, 2 * 4864, generator=gen).to(dtype).to(dev)
    errs.append(rel_err(silu_and_mul(gu), reference.silu_and_mul(gu)))
    pos = torch.randint(0, 4096, (37,), generator=gen).to(dev)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    ang = torch.arange(4096).float()[:, None] * inv[None, :]
    cache = torch.cat([ang.cos(), ang.sin()], -1).to(dev)
    q = torch.randn(37, 8, dim, generator=gen).to(dtype).to(dev)
    k = torch.randn(37, 2, dim, generator=gen).to(dtype).to(dev)
    q1, k1 = apply_rotary(q.clone(), k.clone(), pos, cache)
    q2, k2 = reference.apply_rotary(q.clone(), k.clone(), pos, cache)
    errs += [rel_err(q1, q2), rel_err(k1, k2)]
    return max(errs)


def case_moe(dtype: torch.dtype, tokens: int, dev: torch.device) -> float:
    from batchgen_data.kernels import fused_experts, reference

    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 16, 512, 256, 4
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(dev)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype).to(dev)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype).to(dev)
    logits = torch.randn(tokens, experts, generator=gen).to(dev)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    got = fused_experts(x, w13, w2, weights.float(), ids)
    want = reference.fused_experts(x, w13, w2, weights.float(), ids)
    return rel_err(got, want)


def case_fp8_kv_write(dtype: torch.dtype, dev: torch.device) -> float:
    """The FP8 KV cache's write: e4m3 codes of k / k_scale, v / v_scale; 0.0 when every code
    is torch's (the kernel rounds by integer arithmetic, no fp8 type)."""
    from batchgen_data.kernels import reference, write_kv_cache

    gen = torch.Generator().manual_seed(8)
    k = (torch.randn(300, 4, 128, generator=gen) * 30).to(dtype).to(dev)
    v = (torch.randn(300, 4, 128, generator=gen) * 0.01).to(dtype).to(dev)
    slots = torch.randperm(64 * 16, generator=gen)[:300].to(dev)
    caches = [torch.zeros(64, 16, 4, 128, dtype=torch.float8_e4m3fn, device=dev)
              for _ in range(4)]
    write_kv_cache(k, v, caches[0], caches[1], slots, 0.37, 0.004)
    reference.write_kv_cache(k, v, caches[2], caches[3], slots, 0.37, 0.004)
    return float(sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
                     for a, b in ((caches[0], caches[2]), (caches[1], caches[3]))))


def case_fp8_kv_attention(dtype: torch.dtype, prefill: bool, dim: int, dev: torch.device
                          ) -> float:
    """Decode or prefill attention over an FP8 cache (codes widened in registers, per-tensor
    scales) against the reference's dequantize-then-attend."""
    from batchgen_data.kernels import paged_decode_attention, paged_prefill_attention, reference

    gen = torch.Generator().manual_seed(dim + prefill)
    lens = [2048, 300, 37, 1]
    k, v, tables, seq_lens = _paged(4, lens, 2, dim, 16, torch.float32, dev, gen)
    k, v = (k * 40).clamp(-448, 448).to(torch.float8_e4m3fn), (v * 0.1).to(torch.float8_e4m3fn)
    ks, vs, scale = 0.05, 3.0, dim ** -0.5
    if not prefill:
        q = torch.randn(4, 8, dim, generator=gen).to(dtype).to(dev)
        got = paged_decode_attention(q, k, v, tables, seq_lens, scale, k_scale=ks, v_scale=vs)
        want = reference.paged_decode_attention(q, k, v, tables, seq_lens, scale,
                                                k_scale=ks, v_scale=vs)
        return rel_err(got, want)
    q_lens = [256, 64, 37, 1]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=dev)
    q = torch.randn(sum(q_lens), 8, dim, generator=gen).to(dtype).to(dev)
    got = paged_prefill_attention(q, k, v, tables, cu, seq_lens, scale, max_seqlen_q=256,
                                  k_scale=ks, v_scale=vs)
    want = reference.paged_prefill_attention(q, k, v, tables, cu, seq_lens, scale,
                                             k_scale=ks, v_scale=vs)
    return rel_err(got, want)


def case_graph_replay(dtype: torch.dtype, dev: torch.device) -> float:
    """A decode attention call captured in a CUDA graph, replayed on new inputs in the same
    buffers: equal to eager on those inputs (0.0 when bit-identical)."""
    from batchgen_data.kernels import paged_decode_attention

    gen = torch.Generator().manual_seed(5)
    k, v, tables, lens = _paged(8, [300] * 8, 2, 128, 16, dtype, dev, gen)
    q = torch.randn(8, 8, 128, generator=gen).to(dtype).to(dev)
    paged_decode_attention(q, k, v, tables, lens, 0.088)  # compile outside the capture
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, k, v, tables, lens, 0.088)
    q.copy_(torch.randn(8, 8, 128, generator=gen).to(dtype).to(dev))
    lens.copy_(torch.tensor([300, 1, 17, 299, 64, 250, 3, 100], dtype=torch.int32))
    graph.replay()
    eager = paged_decode_attention(q, k, v, tables, lens, 0.088)
    return rel_err(out, eager)


def case_sampler(cands: int, dev: torch.device) -> float:
    """The sampler's race kernel (`race_candidates`: temperature, top-k, top-p, min-p and the
    seeded draw over a row's candidates) against its reference, on `cands` candidates a row
    drawn from Qwen's 151,936 ids, unranked and ranked, with and without top-p, min-p and a
    mass from beyond the candidates: the fraction of rows whose token differs (0.0 expected:
    the draw is a function of (seed, output index, token id))."""
    from batchgen_data.kernels import reference
    from batchgen_data.kernels.sampling import race_candidates

    gen = torch.Generator().manual_seed(cands)
    n = 16
    differ = 0
    variants = [(False, False, False, False), (False, False, True, False),
                (True, False, False, False), (True, True, False, False), (True, True, True, True)]
    for ranked, use_top_p, use_min_p, use_total in variants:
        vals = torch.randn(n, cands, generator=gen) * 3.0
        ids = torch.stack([torch.randperm(151936, generator=gen)[:cands] for _ in range(n)])
        if ranked:
            vals, order = vals.sort(dim=-1, descending=True, stable=True)
            ids = ids.gather(1, order)
        temp = torch.rand(n, 1, generator=gen) * 1.5 + 0.3
        top_k = torch.randint(1, cands + 5, (n, 1), generator=gen) if ranked else \
            torch.full((n, 1), 10**6)
        top_p = torch.rand(n, 1, generator=gen) * 0.7 + 0.3 if use_top_p else None
        min_p = torch.rand(n, 1, generator=gen) * 0.2 if use_min_p else None
        seeds = torch.randint(0, 2**62, (n,), generator=gen)
        steps = torch.randint(0, 10**5, (n,), generator=gen)
        total = None
        if use_total:
            sc = vals / temp
            total = torch.exp(sc - sc[:, :1]).sum(-1, keepdim=True) * 1.25
        args = [t.to(dev) if isinstance(t, torch.Tensor) else t
                for t in (vals, ids, temp, top_k, top_p, min_p, seeds, steps, total)]
        tok = race_candidates(*args, ranked)[0]
        want = reference.race_candidates(*args, ranked)[0]
        differ += int((tok.cpu() != want.cpu()).sum())
    return differ / (n * len(variants))


def cases(quick: bool) -> list[tuple[str, torch.dtype, Callable[[torch.device], float]]]:
    dtypes = (torch.bfloat16, torch.float16)
    dims = (64, 128) if quick else (64, 128, 256)
    ctxs = (300, 2048) if quick else (300, 2048, 8192)
    out: list[tuple[str, torch.dtype, Callable[[torch.device], float]]] = []
    for dt in dtypes:
        for d in dims:
            for g in (1, 4) if quick else (1, 4, 8):
                for c in ctxs:
                    out.append((f"decode D={d} group={g} ctx={c}", dt,
                                lambda dev, dt=dt, d=d, g=g, c=c: case_decode(dt, d, g, c, dev)))
            for c in ctxs:
                out.append((f"prefill D={d} group=4 ctx={c}", dt,
                            lambda dev, dt=dt, d=d, c=c: case_prefill(dt, d, 4, c, dev)))
            # q tile rows: all tokens; a row left over; 8 heads a token (one compile each)
            for g in (8,) if quick else (1, 3, 8):
                out.append((f"prefill D={d} group={g} ctx=2048", dt,
                            lambda dev, dt=dt, d=d, g=g: case_prefill(dt, d, g, 2048, dev)))
            out.append((f"write_kv D={d}", dt, lambda dev, dt=dt, d=d: case_write_kv(dt, d, dev)))
        # gpt-oss's 128-token windows with sinks; Gemma 2's soft-capped local layers
        win = dict(sliding_window=128, sinks=True)
        cap = dict(sliding_window=128, softcap=50.0)
        out.append(("decode D=64 group=8 ctx=2048 window=128 sinks", dt,
                    lambda dev, dt=dt: case_decode(dt, 64, 8, 2048, dev, **win)))
        out.append(("prefill D=64 group=8 ctx=2048 window=128 sinks", dt,
                    lambda dev, dt=dt: case_prefill(dt, 64, 8, 2048, dev, **win)))
        out.append(("decode D=128 group=2 ctx=2048 window=128 softcap=50", dt,
                    lambda dev, dt=dt: case_decode(dt, 128, 2, 2048, dev, **cap)))
        out.append(("prefill D=128 group=2 ctx=2048 window=128 softcap=50", dt,
                    lambda dev, dt=dt: case_prefill(dt, 128, 2, 2048, dev, **cap)))
        out.append(("norm/rotary/silu", dt, lambda dev, dt=dt: case_norm_rotary_act(dt, 128, dev)))
        for t in (1, 64, 512):
            out.append((f"fused_moe T={t}", dt, lambda dev, dt=dt, t=t: case_moe(dt, t, dev)))
        # MLA's shape (DeepSeek: one latent KV head read by 128 query heads, head dim 576);
        # kv_heads 2 here, the tiles are the same
        out.append(("decode MLA D=576 group=128 ctx=2048", dt,
                    lambda dev, dt=dt: case_decode(dt, 576, 128, 2048, dev)))
        out.append(("prefill MLA D=576 group=16 ctx=2048", dt,
                    lambda dev, dt=dt: case_prefill(dt, 576, 16, 2048, dev)))
    out.append(("cuda graph replay (decode)", torch.bfloat16,
                lambda dev: case_graph_replay(torch.bfloat16, dev)))
    out.append(("sampler race, 1024 candidates", torch.float32,
                lambda dev: case_sampler(1024, dev)))
    return out


def quant_cases() -> list[tuple[str, torch.dtype, Callable[[torch.device], float]]]:
    """The quantized matmuls and the FP8 KV cache's kernels (`--quant` only: not yet run on a
    device, so kept out of the default check that `benchmarks/run_gpu.sh` starts with)."""
    out: list[tuple[str, torch.dtype, Callable[[torch.device], float]]] = []
    for dt in (torch.bfloat16, torch.float16):
        out.append(("fp8 kv write (codes differing)", dt,
                    lambda dev, dt=dt: case_fp8_kv_write(dt, dev)))
        for d in (64, 128):
            for pre in (False, True):
                out.append((f"fp8 kv {'prefill' if pre else 'decode'} D={d}", dt,
                            lambda dev, dt=dt, pre=pre, d=d: case_fp8_kv_attention(dt, pre, d,
                                                                                   dev)))
        for kind in ("int4", "int8", "fp8"):
            for r in (1, 64):
                out.append((f"quant_linear {kind} M={r}", dt,
                            lambda dev, dt=dt, kind=kind, r=r: rel_err(*case_quant(dt, kind, r,
                                                                                     dev))))
        for r in (1, 64):
            out.append((f"fp8_block_matmul M={r}", dt,
                        lambda dev, dt=dt, r=r: rel_err(*case_fp8_block(dt, r, dev))))
            out.append((f"mxfp4_linear M={r}", dt,
                        lambda dev, dt=dt, r=r: rel_err(*case_mxfp4(dt, r, dev))))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--json", default=None, help="also write the records here")
    ap.add_argument("--quant", action="store_true",
                    help="the quantized matmuls only (kernels/quant_matmul.py)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel self-check: no CUDA device here; nothing to check")
        return 2
    dev = torch.device("cuda")
    records: list[dict[str, Any]] = []
    for name, dt, fn in quant_cases() if args.quant else cases(args.quick):
        rec: dict[str, Any] = {"case": name, "dtype": str(dt).replace("torch.", "")}
        t0 = time.perf_counter()
        try:
            err = fn(dev)
            torch.cuda.synchronize(dev)
            exact = name.startswith(("cuda graph", "fp8 kv write", "sampler"))
            tol = 0.0 if exact else TOLERANCE[dt]
            rec.update(rel_err=float(f"{err:.3g}"), tol=tol, ok=err <= tol)
        except Exception as e:  # noqa: BLE001 - a failing case is reported, the rest still run
            rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:300],
                       where=traceback.format_exc(limit=3)[-600:])
        rec["s"] = round(time.perf_counter() - t0, 2)
        records.append(rec)
        print(f"{'ok  ' if rec['ok'] else 'FAIL'} {rec['dtype']:9s} {name:34s} "
              f"err={rec.get('rel_err', '-')} tol={rec.get('tol', '-')} {rec['s']}s"
              + (f"  {rec['error']}" if "error" in rec else ""), flush=True)
    failed = [r for r in records if not r["ok"]]
    summary = {"bench": "kernel_selfcheck", "device": torch.cuda.get_device_name(dev),
               "cases": len(records), "failed": len(failed),
               "worst": max((r.get("rel_err", 0.0) / max(r.get("tol", 1.0), 1e-9)
                             for r in records if "rel_err" in r and r.get("tol")), default=0.0)}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "records": records}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
