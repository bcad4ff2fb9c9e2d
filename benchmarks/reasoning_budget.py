"""A long-tail reasoning job with and without thinking budgets: batch completion time.

The job: `--rows` rows, 90% of which reason 500-2,000 tokens and 10% 8,000-30,000 (uniform,
seeded), each then answering `--answer` tokens. Four arms on the same rows:

* ``none``: every row reasons as long as it wants;
* ``budget``: a per-row `thinking_token_budget` (``--budget``, 4,000);
* ``p95``: the job-level adaptive cap, `thinking_cap_quantile=0.95`;
* ``budget+p95``: both.

A reasoning model cannot run on this box at that length, so the engine is the real one (its
scheduler, coroutines, thinking budget and cap) over the lab's emulated runner
(`batchgen_lab.emulated_runner`), which sleeps each step's modelled time on the preset's cost
model (``--preset``, an H200 running Llama-8B) times ``--scale``; one emulated token stands for
``--tokens-per-step`` real ones. A script at the runner seam writes each row's tokens: `<think>`
is open in the prompt (DeepSeek-R1's template), the row thinks its length, closes `</think>`,
answers and ends; where the engine appends the end of thinking the script answers from there.
`completion_s` is the batch completion time on the modelled device (the runner's summed
modelled step time), `wall_s` what this run slept and spent; each arm runs ``--repeats`` times
(seeds 0..), the table gives medians and the spread (max - min) of `completion_s`.

    .venv/bin/python benchmarks/reasoning_budget.py
    .venv/bin/python benchmarks/reasoning_budget.py --rows 64 --scale 0.001 --repeats 1

Two Ray actors (the issue's second setting) are not measured here: see docs/reasoning.md.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "lab"))
from _common import format_table  # noqa: E402

from batchgen_data import SamplingParams  # noqa: E402
from batchgen_data.config import make_engine_config  # noqa: E402
from batchgen_data.engine.engine import Engine  # noqa: E402
from batchgen_lab import emulated_runner as emu  # noqa: E402

START, END, FILLER, SENTENCE = 252, 253, 2, 255  # below the prompt header's ids
END_STR = "Enough thinking.</think>"


class ThinkTokenizer(emu.EmulatedTokenizer):
    """The emulated tokenizer with think tags, and the end text as coarse tokens + `</think>`."""

    def __init__(self, end_len: int) -> None:
        self.end_len = end_len

    def get_vocab(self) -> dict[str, int]:
        return {"<think>": START, "</think>": END}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text != END_STR:
            return super().encode(text)
        return [SENTENCE] * self.end_len + [END]


class Script:
    """The runner, then each sampled row's next token from its script: think, close, answer."""

    def __init__(self, runner: Any, plan: dict[int, tuple[int, int]]) -> None:
        self.runner, self.plan = runner, plan  # row key -> (think, answer) coarse tokens

    def run(self, inp: Any) -> torch.Tensor:
        logits = self.runner.run(inp)
        forced = torch.zeros_like(logits)
        for i, seq in enumerate(inp.sample_seqs):
            forced[i, self.next(seq)] = 1.0
        return forced

    def next(self, seq: Any) -> int:
        think, answer = self.plan[tuple(seq.prompt_token_ids[2:4])]
        out = seq.token_ids[len(seq.prompt_token_ids):]
        if END in out:
            done = len(out) - out.index(END) - 1
            return emu.EOS if done >= answer else FILLER
        return FILLER if len(out) < think else END

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def key(i: int) -> tuple[int, int]:
    return 2 + i % 250, 2 + i // 250


def lengths(rows: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(8000, 30000) if rng.random() < 0.1 else rng.randint(500, 2000)
            for _ in range(rows)]


def run_arm(args: argparse.Namespace, arm: str, seed: int) -> dict[str, Any]:
    g = args.tokens_per_step
    coarse = lambda n: max(1, math.ceil(n / g))  # noqa: E731
    model = f"emulated:{args.preset}?scale={args.scale}&tokens_per_step={g}"
    cap = 0.95 if "p95" in arm else None
    config = make_engine_config(model, max_num_seqs=args.max_num_seqs, max_model_len=1 << 16,
                                reasoning_parser="deepseek_r1", reasoning_end_str=END_STR,
                                thinking_cap_quantile=cap, enable_prefix_caching=False)
    parts = emu.build_parts(config)
    parts.tokenizer = parts.stopper.tokenizer = ThinkTokenizer(coarse(args.end_tokens))
    think = lengths(args.rows, seed)
    plan = {key(i): (coarse(n), coarse(args.answer)) for i, n in enumerate(think)}
    parts.runner = Script(parts.runner, plan)
    engine = Engine(config, parts)
    budget = coarse(args.budget) if "budget" in arm else None
    params = SamplingParams(temperature=0.0, max_tokens=coarse(40000), ignore_eos=False,
                            thinking_token_budget=budget, detokenize=False)
    for i in range(args.rows):
        prompt = emu.encode_prompt(1, 4) + [START]
        prompt[2:4] = key(i)  # the row's script key, inside the vocabulary
        engine.submit(prompt, params)
    t0, done = time.perf_counter(), []
    while engine.has_unfinished():
        done += engine.step()
    reasoning = [o.outputs[0].num_reasoning_tokens * g for o in done]
    cut = sum(1 for o in done if END in o.outputs[0].token_ids and SENTENCE in
              o.outputs[0].token_ids)
    return {"arm": arm, "seed": seed, "completion_s": parts.runner.runner.modelled_s,
            "wall_s": time.perf_counter() - t0, "rows_cut": cut,
            "mean_reasoning": statistics.fmean(reasoning), "max_reasoning": max(reasoning)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--budget", type=int, default=4000)
    p.add_argument("--answer", type=int, default=300)
    p.add_argument("--end-tokens", type=int, default=30, help="tokens of the end-of-thinking text")
    p.add_argument("--preset", default="h200-llama8b")
    p.add_argument("--scale", type=float, default=0.01)
    p.add_argument("--tokens-per-step", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    arms = ["none", "budget", "p95", "budget+p95"]
    runs = [run_arm(args, arm, seed) for seed in range(args.repeats) for arm in arms]
    base = statistics.median(r["completion_s"] for r in runs if r["arm"] == "none")
    table = []
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        times = [r["completion_s"] for r in mine]
        table.append({"arm": arm, "completion_s": statistics.median(times),
                      "spread_s": max(times) - min(times),
                      "vs_none": statistics.median(times) / base,
                      "rows_cut": statistics.median(r["rows_cut"] for r in mine),
                      "mean_reasoning": statistics.median(r["mean_reasoning"] for r in mine),
                      "max_reasoning": statistics.median(r["max_reasoning"] for r in mine),
                      "wall_s": statistics.median(r["wall_s"] for r in mine)})
    print(format_table(table, list(table[0])))
    print(json.dumps({"benchmark": "reasoning_budget", "rows": args.rows,
                      "budget": args.budget, "preset": args.preset,
                      "tokens_per_step": args.tokens_per_step, "repeats": args.repeats,
                      "arms": table, "runs": runs}))


if __name__ == "__main__":
    main()
