"""The examples' programs run step by step by hand with `LLM.chat` (each step one batched call
over all rows): the reference every program test (offline, Ray, Spark) compares with. Also
loads the example modules."""
from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

from batchgen_data import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def example(name: str) -> ModuleType:
    """examples/<name>.py as a module (registered, so Ray/Spark can pickle its program)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _say(llm: LLM, conversations: list[list[dict[str, Any]]],
         params: list[SamplingParams]) -> list[str]:
    outs = llm.chat(conversations, params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def vote_by_hand(llm: LLM, rows: list[dict[str, Any]], max_tokens: int) -> list[dict[str, Any]]:
    m = example("programs_vote")
    asks = [(i, k) for i, row in enumerate(rows) for k in range(row.get("samples") or m.SAMPLES)]
    texts = _say(llm, [m.vote_prompt(rows[i]["question"]) for i, _ in asks],
                 [SamplingParams(temperature=m.TEMPERATURE, seed=k, max_tokens=max_tokens)
                  for _, k in asks])
    outs = []
    for i in range(len(rows)):
        votes = [m.final_answer(t) for (j, _), t in zip(asks, texts) if j == i]
        answer, count = Counter(votes).most_common(1)[0]
        outs.append({"answer": answer, "votes": votes, "agreement": count / len(votes)})
    return outs


def revise_by_hand(llm: LLM, rows: list[dict[str, Any]], max_tokens: int
                   ) -> list[dict[str, Any]]:
    m = example("programs_revise")
    sp = [SamplingParams(temperature=0, max_tokens=max_tokens)] * len(rows)
    convs = [[{"role": "user", "content": row["question"]}] for row in rows]
    steps = []
    for follow_up in (m.CRITIQUE, m.REVISE, None):
        steps.append(_say(llm, convs, sp))
        convs = [c + [{"role": "assistant", "content": t}, {"role": "user", "content": follow_up}]
                 for c, t in zip(convs, steps[-1])]
    return [{"answer": a, "draft": d, "critique": c} for d, c, a in zip(*steps)]


def judge_by_hand(llm: LLM, rows: list[dict[str, Any]], max_tokens: int
                  ) -> list[dict[str, Any]]:
    m = example("programs_judge")
    convs = []
    for row in rows:
        q, a, b = row["question"], row["answer_a"], row["answer_b"]
        convs += [m.judge_prompt(q, a, b), m.judge_prompt(q, b, a)]
    texts = _say(llm, convs, [SamplingParams(temperature=0, max_tokens=max_tokens)] * len(convs))
    outs = []
    for ab, ba in zip(texts[::2], texts[1::2]):
        first, second = m.verdict(ab), {"A": "B", "B": "A"}.get(m.verdict(ba) or "")
        consistent = first is not None and first == second
        outs.append({"winner": first if consistent else "tie", "verdict_ab": ab,
                     "verdict_ba": ba, "consistent": consistent})
    return outs


def rows_for(name: str) -> list[dict[str, Any]]:
    """A few rows per example, small enough for a 2-core box."""
    if name == "programs_vote":
        return [{"question": q, "samples": 3} for q in example(name).QUESTIONS[:3]]
    if name == "programs_revise":
        return [{"question": q} for q in example(name).QUESTIONS[:4]]
    return [{"question": q, "answer_a": a, "answer_b": b} for q, a, b in example(name).PAIRS[:3]]


EXAMPLES = {"programs_vote": ("self_consistency", vote_by_hand),
            "programs_revise": ("revise", revise_by_hand),
            "programs_judge": ("judge_both_orders", judge_by_hand)}
