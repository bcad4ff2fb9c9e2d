"""How much host memory does one engine hold? RSS of `LLM()` as a new user builds it.

Prints, for one engine (default: the embedded SmolLM2-135M on the CPU, default kwargs):

* `rss_import_gib`  the process after importing torch and batchgen_data;
* `rss_llm_gib`     after `LLM()` returns (model loaded, weights in their kernels' layouts, KV
                    cache allocated, fast paths built);
* `rss_gen_gib`     after generating a small batch (`--num-prompts` x `--max-tokens`);
* `peak_gib`        the process's high-water mark (VmHWM), load-time transients included;
* `weights_<layout>_mib`  bytes the model holds per weight layout ("plain", "onednn",
                    "panels"; norms, biases and the rotary table count as plain);
* `kv_mib`          the paged KV cache (`kv_tokens` tokens).

Run it in a fresh process (RSS is per process) on a machine of any load; memory does not depend
on it. The issue 14 goal is `rss_gen_gib <= 1.5` for the default model.

    .venv/bin/python benchmarks/engine_memory.py
    .venv/bin/python benchmarks/engine_memory.py --engine-kw cpu_kernels=False
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, parse_key_values  # noqa: E402

GIB = float(1 << 30)
MIB = float(1 << 20)


def proc_status_kib(field: str) -> int:
    """A `VmRSS`-style field of /proc/self/status, in KiB."""
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def rss_gib() -> float:
    return proc_status_kib("VmRSS") * 1024 / GIB


def weight_bytes_by_layout(model: Any) -> dict[str, int]:
    """Bytes of every parameter and buffer of `model`, keyed by the layout of the module that
    holds it (a module without a `layout` counts as plain)."""
    out: Counter[str] = Counter()
    seen: set[int] = set()
    for module in model.modules():
        layout = getattr(module, "layout", "plain")
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        for t in tensors:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            out[layout] += t.numel() * t.element_size()
    return dict(out)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from batchgen_data import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    rec: dict[str, Any] = {"model": args.model or "default", "rss_import_gib": rss_gib()}
    llm = LLM(args.model, **parse_key_values(args.engine_kw))
    rec["rss_llm_gib"] = rss_gib()
    prompts = [f"Question {i}: name a colour and say why you like it." for i in range(args.num_prompts)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0),
                        use_tqdm=False)
    rec["rss_gen_gib"] = rss_gib()
    rec["peak_gib"] = proc_status_kib("VmHWM") * 1024 / GIB
    runner = llm.engine.runner
    for layout, nbytes in sorted(weight_bytes_by_layout(runner.model).items()):
        rec[f"weights_{layout}_mib"] = nbytes / MIB
    rec["kv_mib"] = runner.kv.numel() * runner.kv.element_size() / MIB
    rec["kv_tokens"] = runner.num_blocks * runner.block_size
    rec["backend_linear"] = runner.backend.linear
    rec["fast_paths"] = ",".join(type(p).__name__ for p in runner.fast_paths) or "-"
    rec["first_output"] = outs[0].outputs[0].text[:40]
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded one)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--engine-kw", action="append", metavar="KEY=VALUE",
                    help="LLM(...) kwarg (repeatable), e.g. kv_cache_memory_bytes=1073741824")
    args = ap.parse_args()
    rec = measure(args)
    rows = [{"what": k, "value": v} for k, v in rec.items()]
    print(format_table(rows, ["what", "value"]))
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
