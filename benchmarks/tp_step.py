"""What one decode step costs at tensor_parallel_size=2 on this machine, and what its collectives
move: bytes and their share of the step, against the same model at TP=1.

A random Llama-shaped model (default ~150M parameters, fp32: hidden 1024, 8 layers, 16 heads,
4 KV heads, MLP 2816, vocabulary 32,001 so the head is padded) is written once to a cache
directory. For each TP size the script builds an engine, starts `--batch` sequences of
`--prompt-len` tokens, steps until every sequence decodes, then times `--steps` decode steps.
At TP=2 rank 0's counters say what the collectives cost on it: the model's (an all-reduce after
each o and down projection and after the embedding lookup, the logits' gather) and the step's
broadcast of plain data (`worker/tp/step_io.py`); their time includes waiting for the slower
rank, so it is an upper bound on transfer time. `--cases` lists TP size x threads per rank;
the default compares TP=2 (one thread per rank) with TP=1 on the same two cores (two threads)
and on one (one thread, the per-rank compute of TP=2 without the split).

    .venv/bin/python benchmarks/tp_step.py
    .venv/bin/python benchmarks/tp_step.py --batch 1,8,32 --steps 20

A device machine with fewer than two GPUs skips the TP=2 case with a line saying so.

`--kv-move N` adds what re-splitting KV by heads costs (the data path of a re-partition,
docs/parallel.md): N running sequences exported with their KV from a TP=1 engine and imported
into a TP=2 engine, whose next step writes each rank's heads (`TPRunner.write_kv`); seconds per
GB for the export and for the import + write (the write is the first step's time minus a
plain decode step's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, step_until_decode  # noqa: E402

MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, vocab_size=32001,
             max_position_embeddings=2048, tie_word_embeddings=False)


TINY = dict(MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=401)  # smoke runs


def model_dir(cache: Path, shape: dict[str, Any] | None = None, name: str = "tp-step-llama"
              ) -> Path:
    """The benchmark's random model (`shape`: MODEL) and a small tokenizer, written once."""
    path = cache / name
    if (path / "config.json").exists():
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["a b c d e f g h"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>",
                            bos_token="<s>").save_pretrained(path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**(shape or MODEL), bos_token_id=0,
                                 eos_token_id=1)).save_pretrained(path)
    return path


def measure(path: Path, tp: int, per_rank: int, batch: int, prompt_len: int, steps: int,
            device: str) -> dict[str, Any]:
    import torch

    from batchgen_data import SamplingParams
    from batchgen_data.engine.engine import Engine

    torch.set_num_threads(per_rank)
    engine = Engine.from_kwargs(str(path), tensor_parallel_size=tp, num_threads=per_rank,
                                device=device, max_num_seqs=batch, enable_prefix_caching=False)
    try:
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.submit([(7 * i + j) % 290 + 5 for j in range(prompt_len)], params)
        step_until_decode(engine)
        for _ in range(3):  # warm-up
            engine.step()
        ranks = getattr(engine.runner, "ranks", None)
        before = _counters(ranks)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        after = _counters(ranks)
    finally:
        engine.close()
    step_s = statistics.median(times)
    total_s = sum(times)
    d = {k: after[k] - before[k] for k in after}
    return {"tp": tp, "batch": batch, "threads_per_rank": per_rank,
            "step_ms": round(step_s * 1e3, 2),
            "step_ms_min": round(min(times) * 1e3, 2),
            "tok_s": round(batch / step_s, 1),
            "model_kib_per_step": round(d["model_bytes"] / steps / 1024, 1),
            "bcast_kib_per_step": round(d["control_bytes"] / steps / 1024, 2),
            "collectives_per_step": round((d["model_calls"] + d["control_calls"]) / steps, 1),
            "model_calls_per_step": round(d["model_calls"] / steps, 2),
            "collective_share": round((d["model_s"] + d["control_s"]) / total_s, 3),
            "bcast_share": round(d["control_s"] / total_s, 3)}


def kv_move(path: Path, n: int, prompt_len: int, device: str) -> dict[str, Any]:
    import torch

    from batchgen_data import SamplingParams
    from batchgen_data.engine.engine import Engine

    kw = dict(device=device, max_num_seqs=n, enable_prefix_caching=False)
    torch.set_num_threads(2)
    # every prompt in the first step, so each sequence has KV to export
    one = Engine.from_kwargs(str(path), num_threads=2,
                             max_num_batched_tokens=max(2048, n * (prompt_len + 1)), **kw)
    two = Engine.from_kwargs(str(path), tensor_parallel_size=2, num_threads=1, **kw)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        rids = [one.submit([(7 * i + j) % 290 + 5 for j in range(prompt_len)], params)
                for i in range(n)]
        step_until_decode(one)
        two.submit(list(range(5, 5 + prompt_len)), params)  # warm-up: first steps are slow
        while two.has_unfinished():
            two.step()
        t0 = time.perf_counter()
        states = [one.export(r, include_kv=True) for r in rids]
        export_s = time.perf_counter() - t0
        nbytes = sum(k.numel() * k.element_size() * 2 for st in states
                     for k, _ in st["seqs"][0]["kv"])
        t0 = time.perf_counter()
        for st in states:
            two.import_(st)
        two.step()  # writes every imported sequence's KV (each rank its heads), then decodes
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        two.step()
        decode_s = time.perf_counter() - t0
    finally:
        two.close()
    gb = nbytes / 1e9
    write_s = max(first_s - decode_s, 0.0)
    return {"seqs": n, "kv_mb": round(nbytes / 1e6, 1), "export_s": round(export_s, 3),
            "import_write_s": round(write_s, 3), "export_s_per_gb": round(export_s / gb, 2),
            "import_write_s_per_gb": round(write_s / gb, 2)}


def _counters(ranks: Any) -> dict[str, float]:
    if ranks is None:
        return dict.fromkeys(("model_bytes", "model_calls", "model_s", "control_bytes",
                              "control_calls", "control_s"), 0)
    m, c = ranks.tp.stats, ranks.control.stats
    return {"model_bytes": m.bytes, "model_calls": m.calls, "model_s": m.seconds,
            "control_bytes": c.bytes, "control_calls": c.calls, "control_s": c.seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,32", help="decode batch sizes, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cases", default="1x2,1x1,2x1",
                    help="TPxTHREADS_PER_RANK, comma-separated (e.g. 1x2,2x1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/batchgen-bench"))
    ap.add_argument("--kv-move", type=int, default=0, metavar="N",
                    help="also time N sequences' KV moved from a TP=1 to a TP=2 engine")
    ap.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"],
                    help="the model's depth (the per-layer count of collectives: run two "
                         "depths, lab/batchgen_lab/tail_repartition.py fits them)")
    args = ap.parse_args()
    shape = dict(MODEL, num_hidden_layers=args.layers)
    path = model_dir(args.cache, shape, "tp-step-llama" if shape == MODEL
                     else f"tp-step-llama-{args.layers}l")
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    if args.device.startswith("cuda"):
        import torch

        gpus = torch.cuda.device_count()
        if any(tp > gpus for tp, _ in cases):
            print(f"tp_step: {gpus} GPU(s) visible: skipping the cases with more ranks")
            cases = [c for c in cases if c[0] <= gpus]
    load = os.getloadavg()[0]
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        for tp, per_rank in cases:
            rows.append(measure(path, tp, per_rank, batch, args.prompt_len, args.steps,
                                args.device))
    for r in rows:  # speed-up over the first case of the same batch
        base = next(x for x in rows if x["batch"] == r["batch"])
        r["vs_first"] = round(base["step_ms"] / r["step_ms"], 2)
    cols = ["tp", "batch", "threads_per_rank", "step_ms", "step_ms_min", "tok_s", "vs_first",
            "model_kib_per_step", "bcast_kib_per_step", "collectives_per_step",
            "collective_share", "bcast_share"]
    print(format_table(rows, cols))
    moved = None
    if args.kv_move and any(tp == 2 for tp, _ in cases):  # (skipped where TP=2 is)
        moved = kv_move(path, args.kv_move, args.prompt_len, args.device)
        print(format_table([moved], list(moved)))
    print(json.dumps({"bench": "tp_step", "load_avg_1m": round(load, 2),
                      "prompt_len": args.prompt_len, "steps": args.steps, "model": shape,
                      "rows": rows, "kv_move": moved}))


if __name__ == "__main__":
    main()
