"""Draft → critique → revise as a per-row program, greedy.

    python examples/programs_revise.py [--max-tokens 96] [--model PATH]

Each step's messages extend the previous step's `.conversation`, so its prompt starts with the
tokens the engine has just computed: the engine keeps that KV pinned between the steps and
prefills only the new turn. With `ray.data.llm` the same job is three processors, each a full
pass over the dataset that prefills the whole conversation again (benchmarks/programs.py).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from batchgen_data import LLM, Generate, SamplingParams, program

QUESTIONS = [
    "Explain what a hash table is to a beginner.",
    "Give me three tips for writing clear emails.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a bakery that specialises in sourdough.",
]
CRITIQUE = "Critique your answer: what is wrong, missing or unclear? Be brief."
REVISE = "Now write an improved answer that fixes those problems."


@program(schema={"answer": "string", "draft": "string", "critique": "string"})
def revise(row: dict[str, Any]) -> Any:
    draft = yield Generate(messages=[{"role": "user", "content": row["question"]}], temperature=0)
    notes = yield Generate(messages=draft.conversation + [{"role": "user", "content": CRITIQUE}],
                           temperature=0)
    final = yield Generate(messages=notes.conversation + [{"role": "user", "content": REVISE}],
                           temperature=0)
    return {"answer": final.text, "draft": draft.text, "critique": notes.text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    args = ap.parse_args()

    llm = LLM(args.model)
    rows = [{"question": q} for q in QUESTIONS]
    outs = llm.run(rows, revise, SamplingParams(max_tokens=args.max_tokens))
    for row, out in zip(rows, outs):
        print(f"\n### {row['question']}\n[draft] {out.get('draft', '').strip()}\n"
              f"[final] {out.get('answer', '').strip()}")
    print(json.dumps({"rows": len(outs), "errors": sum(o.get("error") is not None for o in outs),
                      "prefix_hits": llm.engine.pool.hits}))


if __name__ == "__main__":
    main()
