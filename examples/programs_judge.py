"""LLM-as-judge in both orders as a per-row program: position bias cancels out.

    python examples/programs_judge.py [--max-tokens 8] [--model PATH]

The two verdicts (A shown first, then B shown first) are one fan-out step; a winner counts only
when both orders agree, otherwise the row is a tie.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from batchgen_data import LLM, Generate, SamplingParams, program

PAIRS = [
    ("What is the capital of France?", "Paris.", "Lyon."),
    ("What is 2 + 2?", "5", "4"),
    ("Name a primary colour.", "Red.", "Green, probably, or maybe purple."),
    ("Translate 'thank you' into Spanish.", "Gracias.", "Merci."),
]


def judge_prompt(question: str, first: str, second: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": (
        f"Question: {question}\nAnswer A: {first}\nAnswer B: {second}\n"
        "Which answer is better? Reply with the single letter A or B.")}]


def verdict(text: str) -> str | None:
    """'A' or 'B' from a judge's reply (the first such letter standing alone), else None."""
    for token in text.replace(".", " ").replace(":", " ").split():
        if token.upper() in ("A", "B"):
            return token.upper()
    return None


@program(schema={"winner": "string", "verdict_ab": "string", "verdict_ba": "string",
                 "consistent": "bool"})
def judge_both_orders(row: dict[str, Any]) -> Any:
    q, a, b = row["question"], row["answer_a"], row["answer_b"]
    ab, ba = yield [Generate(messages=judge_prompt(q, a, b), temperature=0),
                    Generate(messages=judge_prompt(q, b, a), temperature=0)]
    first = verdict(ab.text)
    # in the swapped order "A" is answer_b: map it back before comparing
    second = {"A": "B", "B": "A"}.get(verdict(ba.text) or "")
    consistent = first is not None and first == second
    return {"winner": first if consistent else "tie", "verdict_ab": ab.text,
            "verdict_ba": ba.text, "consistent": consistent}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    args = ap.parse_args()

    llm = LLM(args.model)
    rows = [{"question": q, "answer_a": a, "answer_b": b} for q, a, b in PAIRS]
    outs = llm.run(rows, judge_both_orders, SamplingParams(max_tokens=args.max_tokens))
    for row, out in zip(rows, outs):
        print(f"{row['question']} A={row['answer_a']!r} B={row['answer_b']!r} -> "
              f"{out.get('winner')} ({out.get('verdict_ab', '').strip()!r} / "
              f"{out.get('verdict_ba', '').strip()!r})")
    print(json.dumps({"rows": len(outs), "errors": sum(o.get("error") is not None for o in outs),
                      "ties": sum(o.get("winner") == "tie" for o in outs)}))


if __name__ == "__main__":
    main()
