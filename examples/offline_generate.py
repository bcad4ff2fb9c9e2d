"""Offline generation with the embedded default model (SmolLM2-135M-Instruct) on a CPU.

    python examples/offline_generate.py [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import time

from batchgen_data import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clear emails.",
    "Classify the sentiment of this review as positive or negative: 'The zipper broke on day one.'",
    "Summarise in one sentence: The city council voted to extend library hours on weekends "
    "after a survey showed strong demand from students and working parents.",
    "Write a haiku about autumn leaves.",
    "Extract the date and the amount from: 'Invoice 4471, issued 12 March 2024, total due EUR 318.50.'",
    "Explain what a hash table is to a beginner.",
    "Translate 'Good morning, how are you?' into Spanish.",
    "What is 17 multiplied by 3?",
    "Suggest a name for a bakery that specialises in sourdough.",
    "Is this answer correct? Question: What is the boiling point of water at sea level? "
    "Answer: 90 degrees Celsius.",
    "Write a Python function that returns the largest number in a list.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args()

    llm = LLM(num_threads=args.threads)  # model=None: the embedded default
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    wall = time.perf_counter() - start
    for q, out in zip(QUESTIONS, outputs):
        c = out.outputs[0]
        print(f"\n### {q}\n{c.text.strip()}  [{len(c.token_ids)} tokens, {c.finish_reason}]")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{len(outputs)} prompts, {tokens} generated tokens in {wall:.1f} s "
          f"({tokens / wall:.1f} tok/s)")


if __name__ == "__main__":
    main()
