"""Per-row programs against the `ray.data.llm` way: a 3-step draft → critique → revise job.

Two systems run the same rows on one engine (the default model unless --model), greedy, so both
must produce the same three texts per row:

  program   `LLM.run(rows, revise)` (examples/programs_revise.py): every row's steps share the
            engine's batches, a row's next step starts as soon as its previous one finishes, and
            its conversation's KV stays pinned between steps, so only the new turn is prefilled
  stages    what three chained `ray.data.llm` processors do: one full pass per step
            (`LLM.chat` over every row), the prefix cache reset between passes (each stage is its
            own vLLM engine, so it cannot reuse the previous stage's KV), so each pass prefills
            the whole conversation again and waits for the slowest row before the next pass
            starts. Within a pass prefix caching stays on, as in vLLM by default: the rows share
            the chat template's system prompt.
  shared    (--shared-arm) the same passes on one engine whose prefix cache is kept between
            them: a more generous baseline than ray.data.llm can be, reported beside it

Both arms use the same engine (same config, same weights), greedy steps, the same rows.

Reported per system: completion time of the whole batch and prompt tokens computed (tokens run
through the model minus decode tokens: what prefill and recompute cost), with ratios
stages/program, plus how many rows came out identical. For the program: prefix-cache hits per
step index, the most programs in flight, the engine's pin counters (taken, refused, dropped) and
the starts admission's thrash guard put off. Issue #19's goal: >= 2x fewer prefill tokens and
>= 1.5x lower completion time for the program. Each arm's decode-only steps are counted apart
(`decode_seqs_per_step`: how full its decode batches were), with its preemptions.

`--context-words N` puts a passage of about N words before each question; every row's passage is
its own (numbered, its sentences in an order drawn from `--seed` for that row), so only the
system prompt is shared between rows. `--admission key=value` passes ProgramAdmission settings
(`fill`, `guard`) to the program arm.

    .venv/bin/python benchmarks/programs.py                 # 200 rows, 64 tokens per step
    .venv/bin/python benchmarks/programs.py --quick         # 10 rows, 16 tokens: a smoke run
    .venv/bin/python benchmarks/programs.py --rows 400 --engine max_num_seqs=128 --engine device=cuda
    .venv/bin/python benchmarks/programs.py --rows 200 --context-words 400 \
        --engine kv_cache_memory_bytes=4000000000                     # the document workload
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, parse_key_values  # noqa: E402

from batchgen_data import LLM, SamplingParams  # noqa: E402
from batchgen_data.programs.admission import ProgramAdmission  # noqa: E402
from batchgen_data.programs.offline import ProgramRunner  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["hash tables", "photosynthesis", "the French revolution", "compound interest",
          "binary search", "plate tectonics", "vaccines", "supply and demand", "recursion",
          "black holes", "the water cycle", "public key cryptography", "inflation",
          "neural networks", "the immune system", "climate change", "TCP handshakes",
          "the Roman empire", "electric motors", "sorting algorithms"]
ASKS = ["Explain {} to a beginner.", "Give three key facts about {}.",
        "What is a common misconception about {}?", "Why does {} matter?",
        "Summarise {} in two sentences.", "Write a short quiz question about {}.",
        "Compare {} with a related idea.", "How would you teach {} to a child?",
        "What are the limits of {}?", "Describe a real-world example of {}."]


def load_revise() -> Any:
    spec = importlib.util.spec_from_file_location("programs_revise",
                                                  ROOT / "examples" / "programs_revise.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


NOTES = ["{} is often taught in the first weeks of an introductory course.",
         "Many people meet {} at school and forget most of it later.",
         "Experts still disagree about the best way to explain {}.",
         "A good explanation of {} starts from a concrete example.",
         "Textbooks usually present {} with a diagram and a short story.",
         "The history of {} goes back further than most people think.",
         "Some of the vocabulary around {} is confusing for newcomers.",
         "Practitioners use {} every day, often without naming it.",
         "There are several popular myths about {} that deserve a correction.",
         "Questions about {} come up in job interviews and exams alike.",
         "Understanding {} helps with many neighbouring subjects.",
         "A common mistake is to treat {} as simpler than it is.",
         "Recent work has refined what we know about {}.",
         "Analogies help with {}, but each one breaks down somewhere.",
         "Teachers report that students remember {} best through practice."]


def make_rows(n: int, context_words: int = 0, seed: int = 0) -> list[dict[str, Any]]:
    """`context_words` > 0: each question follows a passage of about that many words about its
    topic (a document-grounded job: summarise, extract, answer from notes), the part of the
    prompt that a chained stage prefills again and a program prefills once. Every row gets its
    own passage: it opens with the row's document number and its sentences come in an order
    drawn for that row (from `seed`), so no two rows share KV beyond the chat template's system
    prompt, and a stage's prefix cache cannot absorb a repeated passage."""
    qs = [(a, t) for a in ASKS for t in TOPICS]
    rows = []
    for i in range(n):
        ask, topic = qs[i % len(qs)]
        q = ask.format(topic) + ("" if i < len(qs) else f" (variant {i // len(qs)})")
        if context_words:
            rng = random.Random(f"{seed}-{i}")
            words = f"Document {i + 1}.".split()
            while len(words) < context_words:
                for note in rng.sample(NOTES, len(NOTES)):  # each pass a new order
                    words += note.format(topic).split()
                    if len(words) >= context_words:
                        break
            q = "Notes:\n" + " ".join(words) + "\n\nUsing the notes above: " + q
        rows.append({"question": q})
    return rows


class Meter:
    """Completion time and prompt tokens computed between `start` and `stop` on one engine, and
    where the time went: steps that only decode (one token per sequence) against steps that
    carry prompt tokens, and the rest of the wall time (scheduling, tokenizing, the program
    driver). Decode-only time is what no saving of prefill can remove: it bounds the ratio."""

    def __init__(self, llm: LLM) -> None:
        self.stats = llm.engine.stats
        self.split = {"decode": [0, 0.0, 0], "prefill": [0, 0.0, 0]}  # steps, seconds, seqs
        record = self.stats.record

        def counted(num_seqs: int, num_tokens: int, num_sampled: int, dt: float,
                    **kwargs: Any) -> None:
            row = self.split["decode" if num_tokens == num_seqs else "prefill"]
            row[0] += 1
            row[1] += dt
            row[2] += num_seqs
            record(num_seqs, num_tokens, num_sampled, dt, **kwargs)  # e.g. light_seqs
        self.stats.record = counted  # type: ignore[method-assign]

    def start(self) -> None:
        s = self.stats
        self.t0, self.c0, self.g0, self.f0 = time.perf_counter(), s.computed_tokens, \
            s.generated_tokens, s.num_finished
        self.p0 = s.num_preemptions
        for row in self.split.values():
            row[:] = [0, 0.0, 0]

    def stop(self) -> dict[str, Any]:
        s = self.stats
        requests = s.num_finished - self.f0
        wall = time.perf_counter() - self.t0
        # a request computes all its sampled tokens but the last: those are its decode tokens
        decode = (s.generated_tokens - self.g0) - requests
        (ds, dt, dn), (ps, pt, pn) = self.split["decode"], self.split["prefill"]
        return {"wall_s": round(wall, 3), "requests": requests,
                "prefill_tokens": (s.computed_tokens - self.c0) - decode,
                "decode_steps": ds, "decode_s": round(dt, 2),
                "decode_seqs_per_step": round(dn / max(1, ds), 1),
                "prefill_steps": ps, "prefill_s": round(pt, 2),
                "other_s": round(wall - dt - pt, 2),
                "preemptions": s.num_preemptions - self.p0}


def run_program(llm: LLM, rows: list[dict[str, Any]], mod: Any, max_tokens: int,
                admission_kwargs: dict[str, Any]) -> tuple[list[tuple[str, str, str]],
                                                           dict[str, Any]]:
    llm.reset_prefix_cache()
    pins = llm.engine.pins
    before = (pins.num_pinned, pins.num_refused, pins.num_dropped, pins.num_dropped_blocks)
    meter = Meter(llm)
    meter.start()
    # what LLM.run does, keeping the runner to read its counters
    admission = ProgramAdmission.for_engine(llm.engine, **admission_kwargs)
    runner = ProgramRunner(llm.engine, mod.revise, SamplingParams(max_tokens=max_tokens),
                           admission=admission)
    outs = runner.run_all(rows)
    stats = meter.stop()
    reuse = runner.stats.summary(pins)
    reuse["pins"] = {k: v - b for (k, v), b in zip(reuse["pins"].items(), before)}
    # starts the thrash guard put off (pins taken back: admission waits a round of steps)
    reuse["admission_paused"] = getattr(admission, "num_paused", None)
    return [(o["draft"], o["critique"], o["answer"]) for o in outs], {**stats, "reuse": reuse}


def run_stages(llm: LLM, rows: list[dict[str, Any]], mod: Any, max_tokens: int,
               shared_cache: bool = False) -> tuple[list[tuple[str, str, str]], dict[str, Any]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    convs = [[{"role": "user", "content": r["question"]}] for r in rows]
    texts: list[list[str]] = []
    meter = Meter(llm)
    meter.start()
    if shared_cache:
        llm.reset_prefix_cache()  # but only before the first pass
    for follow_up in (mod.CRITIQUE, mod.REVISE, None):
        if not shared_cache:
            llm.reset_prefix_cache()  # the next stage is another engine
        outs = llm.chat(convs, sp, use_tqdm=False)
        texts.append([o.outputs[0].text for o in outs])
        convs = [c + [{"role": "assistant", "content": t}, {"role": "user", "content": follow_up}]
                 for c, t in zip(convs, texts[-1])]
    return list(zip(*texts)), meter.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64, help="per step")
    ap.add_argument("--quick", action="store_true", help="10 rows, 16 tokens per step")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--engine", action="append", help="engine kwarg key=value (repeatable)")
    ap.add_argument("--context-words", type=int, default=0,
                    help="a passage of about this many words before each question (0: none)")
    ap.add_argument("--seed", type=int, default=0, help="draws each row's passage")
    ap.add_argument("--admission", action="append",
                    help="ProgramAdmission kwarg key=value, e.g. fill=0.8 or guard=False")
    ap.add_argument("--program-only", action="store_true",
                    help="run only the program arm (e.g. to compare admission settings)")
    ap.add_argument("--shared-arm", action="store_true",
                    help="also run the passes on one engine that keeps its prefix cache")
    ap.add_argument("--dump-rows", action="store_true",
                    help="print the rows this run would use as one JSON line and exit")
    args = ap.parse_args()
    rows_n, max_tokens = (10, 16) if args.quick else (args.rows, args.max_tokens)
    if args.dump_rows:
        print(json.dumps(make_rows(rows_n, args.context_words, args.seed)))
        return

    llm = LLM(args.model, **parse_key_values(args.engine))
    mod = load_revise()
    rows = make_rows(rows_n, args.context_words, args.seed)
    run_stages(llm, rows[:2], mod, 4)  # warm-up: kernels built, caches touched
    head = {"bench": "programs", "rows": rows_n, "max_tokens": max_tokens,
            "context_words": args.context_words, "seed": args.seed,
            "admission": parse_key_values(args.admission), "model": args.model or "default"}
    if args.program_only:
        _, prog = run_program(llm, rows, mod, max_tokens, head["admission"])
        print(json.dumps({**head, "load_avg": os.getloadavg(), "program": prog}))
        return
    # each arm's figures as soon as it ends: a run cut short keeps what it measured
    got_s, stages = run_stages(llm, rows, mod, max_tokens)
    print("stages:", json.dumps(stages), flush=True)
    got_p, prog = run_program(llm, rows, mod, max_tokens, head["admission"])
    print("program:", json.dumps(prog), flush=True)
    same = sum(a == b for a, b in zip(got_p, got_s))
    records = [{"system": "stages (ray.data.llm-style)", **stages},
               {"system": "program (LLM.run)", **prog}]
    shared = None
    if args.shared_arm:
        got_h, shared = run_stages(llm, rows, mod, max_tokens, shared_cache=True)
        same = min(same, sum(a == b for a, b in zip(got_h, got_s)))
        records.insert(1, {"system": "stages, one engine, cache kept", **shared})
    print(format_table(records, ["system", "wall_s", "prefill_tokens", "requests", "decode_s",
                                 "decode_steps", "decode_seqs_per_step", "prefill_s", "other_s",
                                 "preemptions"]))
    print("program reuse:", json.dumps(prog["reuse"]))
    summary = {**head, "load_avg": os.getloadavg(),
               "stages": stages, "shared_stages": shared, "program": prog,
               "prefill_ratio": round(stages["prefill_tokens"] / max(1, prog["prefill_tokens"]), 3),
               "time_ratio": round(stages["wall_s"] / max(1e-9, prog["wall_s"]), 3),
               "identical_rows": same,
               # the program's own decode-only steps cannot shrink by reusing KV: the stages'
               # time over them is the most any prefill saving could give on this machine
               "time_ratio_bound": round(stages["wall_s"] / max(1e-9, prog["decode_s"]), 3)}
    print(f"\nprefill tokens: {summary['prefill_ratio']}x fewer with the program; completion "
          f"time: {summary['time_ratio']}x lower (at most {summary['time_ratio_bound']}x with the "
          f"program's decode-only steps as they ran); identical rows: {same}/{rows_n}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
