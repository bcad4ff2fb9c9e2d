"""Self-consistency as a per-row program: sample n answers, keep the majority.

    python examples/programs_vote.py [--samples 5] [--max-tokens 64] [--model PATH]

Each row yields one list of n `Generate`s (a fan-out: they run side by side, in the same engine
batches as every other row's samples), then votes over the final answers. Seeds are fixed per
sample, so a row gives the same vote on every run and on every engine.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from typing import Any

from batchgen_data import LLM, Generate, SamplingParams, program

QUESTIONS = [
    "What is 17 multiplied by 3?",
    "What is 12 plus 30?",
    "How many legs do three cats have in total?",
    "What is 100 divided by 4?",
    "What is 9 times 9?",
    "If a train leaves at 3 pm and travels for 2 hours, at what hour does it arrive?",
]
SAMPLES = 5
TEMPERATURE = 0.8


def final_answer(text: str) -> str:
    """The last number in a reply, else its last non-empty line: what the vote compares."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    if numbers:
        return numbers[-1]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1].lower() if lines else ""


def vote_prompt(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{question} Think step by step, then give the answer."}]


@program(schema={"answer": "string", "votes": "list<string>", "agreement": "double"})
def self_consistency(row: dict[str, Any]) -> Any:
    n = row.get("samples") or SAMPLES
    samples = yield [Generate(messages=vote_prompt(row["question"]), temperature=TEMPERATURE,
                              seed=k) for k in range(n)]
    votes = [final_answer(s.text) for s in samples]
    answer, count = Counter(votes).most_common(1)[0]
    return {"answer": answer, "votes": votes, "agreement": count / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=SAMPLES)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    args = ap.parse_args()

    llm = LLM(args.model)
    rows = [{"question": q, "samples": args.samples} for q in QUESTIONS]
    outs = llm.run(rows, self_consistency, SamplingParams(max_tokens=args.max_tokens))
    for row, out in zip(rows, outs):
        print(f"{row['question']}\n  -> {out.get('answer')!r} (agreement "
              f"{out.get('agreement', 0):.0%}, votes {out.get('votes')})")
    print(json.dumps({"rows": len(outs), "errors": sum(o.get("error") is not None for o in outs)}))


if __name__ == "__main__":
    main()
