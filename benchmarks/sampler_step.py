"""Time one sampler call (SamplingBatch.build + the sampling kernels) per row count and feature.

Answers "what does a step pay for the sampling fields": the `plain` rows (greedy, nothing else
set) are the cost every job pays; run this script on two checkouts to compare them. The other
rows set one field on every row (logit_bias, allowed_token_ids, bad_words, random draws with top-k
or top-p, penalties); a checkout without a field skips its rows. Logits are random, [rows, vocab] float32; no model runs.

    .venv/bin/python benchmarks/sampler_step.py --rows 64,256,1024 --device cpu
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_report  # noqa: E402

from batchgen_data.engine.sampler import Sampler  # noqa: E402
from batchgen_data.engine.sequence import Sequence  # noqa: E402
from batchgen_data.sampling_params import SamplingParams  # noqa: E402


class _Tokenizer:
    """Stand-in for bad_words: one id per character (no model or tokenizer files needed)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 1000 for c in text]


FEATURES = {
    "plain": {},
    "logit_bias": {"logit_bias": {i: 0.5 for i in range(0, 2000, 100)}},
    "allowed_token_ids": {"allowed_token_ids": list(range(10, 30))},
    "bad_words": {"bad_words": ["no", "never", " x"]},
    # random draws (engine/token_draw.py) and the penalties, on every row
    "random": {"temperature": 1.0},
    "top_k": {"temperature": 1.0, "top_k": 50},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
    "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.2},
}


def time_step(rows: int, vocab: int, device: torch.device, extra: dict, repeats: int) -> float:
    params = SamplingParams(**{"temperature": 0, "max_tokens": 512, **extra})
    seqs = [Sequence(i, f"r{i}", 0, [1, 2, 3], params, seed=i, max_tokens=512,
                     token_ids=[1, 2, 3] + [5] * 40) for i in range(rows)]
    sampler = Sampler({2}, _Tokenizer()) if "bad_words" in extra else Sampler({2})
    logits = torch.randn(rows, vocab, device=device) * 5  # peaked like a language model's
    times = []
    for _ in range(repeats + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sampler(logits, seqs)  # ends in .tolist(): synchronous
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,256,1024")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    device = torch.device(args.device)
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    records = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, extra in FEATURES.items():
            if not set(extra) <= known:
                continue
            s = time_step(rows, args.vocab, device, extra, args.repeats)
            records.append({"feature": name, "rows": rows, "step_ms": round(s * 1e3, 3),
                            "device": args.device, "vocab": args.vocab})
    print_report(records, ["feature", "rows", "step_ms", "device"])
    print(json.dumps({"bench": "sampler_step", "results": records}))


if __name__ == "__main__":
    main()
