"""Embedding throughput on the CPU: our pooling engine vs sentence-transformers and HF padded.

Passages with lognormal lengths (median ~60 tokens, a tail to 512) go through a random
BERT-base-shaped model (optionally a Qwen3-0.6B-shaped one), fp32, saved once as a
sentence-transformers directory (mean pooling, normalised) so all three systems load the same
weights:
  * ours: `LLM.embed` (packed varlen steps under max_num_batched_tokens, no padding);
  * sentence-transformers `encode` at its default batch size (it sorts by length);
  * HF `AutoModel` in batches of 32 in input order, padded to each batch's longest, mean
    pooling over the attention mask.
Each repeat runs the three in turn (so a neighbour's load falls on all of them); the table
shows medians with the spread (min-max) and the embeddings' agreement (min cosine), then one
JSON line.

`--ray-actors N` adds our engine through Ray Data in each repeat (`build_processor` with
`task_type="embed"`, N actors of `--ray-num-cpus` each on a local Ray started once): its wall
from the dataset's start to the last row, actors' start-up and model load included, so the
overhead is read against ours offline with its load included too (`ray_overhead`), and against
the offline embed wall alone (`ray_overhead_vs_embed`); and the steady overhead: the offline
rate over Ray's from its first row out to its last (`ray_overhead_steady`: start-up excluded).

    python benchmarks/embed_throughput.py --passages 400 --repeats 3
    python benchmarks/embed_throughput.py --passages 400 --repeats 3 --ray-actors 2
    python benchmarks/embed_throughput.py --passages 2000 --ray-actors 2 --baselines ''
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _common import format_table, wait_for_quiet  # noqa: E402

SHAPES = {
    "bert-base": dict(kind="bert", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072, vocab_size=30522, max_position_embeddings=512),
    "qwen3-0.6b": dict(kind="qwen3", hidden_size=1024, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151936, max_position_embeddings=4096),
    "tiny-bert": dict(kind="bert", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, vocab_size=2000, max_position_embeddings=512),
}


def build_model(shape: str, root: Path) -> Path:
    """A random model of `shape` with a word-per-token tokenizer, as a sentence-transformers
    directory (mean pooling + Normalize)."""
    import transformers as tf

    spec = dict(SHAPES[shape])
    kind = spec.pop("kind")
    path = root / shape
    path.mkdir(parents=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += [f"w{i}" for i in range(spec["vocab_size"] - len(vocab))]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = tf.BertTokenizerFast(vocab_file=str(path / "vocab.txt"))
    if kind == "qwen3":
        # a decoder with the same word-level vocabulary; its last token is [SEP]
        tok.chat_template = None
    tok.save_pretrained(path)
    torch.manual_seed(0)
    if kind == "bert":
        model = tf.BertModel(tf.BertConfig(**spec), add_pooling_layer=False)
    else:
        model = tf.Qwen3Model(tf.Qwen3Config(pad_token_id=0, **spec))
    model.eval().save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "2_Normalize").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": spec["hidden_size"], "pooling_mode_mean_tokens": True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    return path


def make_passages(n: int, vocab: int, seed: int, median: float = 60.0,
                  sigma: float = 0.7) -> list[str]:
    """Passages of lognormal token counts (two of them [CLS]/[SEP]), clipped to [4, 512]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(min(512, max(4, round(rng.lognormvariate(math.log(median), sigma)))))
        out.append(" ".join(f"w{rng.randrange(vocab - 5)}" for _ in range(length - 2)))
    return out


def run_ours(path: Path, texts: list[str], budget: int
             ) -> tuple[float, torch.Tensor, Any, float]:
    """Our offline engine: the embed wall, the embeddings, the engine's stats and the load
    time (building `LLM`)."""
    from batchgen_data import LLM

    t_load = time.perf_counter()
    llm = LLM(str(path), max_num_batched_tokens=budget, max_num_seqs=1024)
    t0 = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=False)
    wall = time.perf_counter() - t0
    return wall, torch.tensor([o.outputs.embedding for o in outs]), llm.engine.stats, t0 - t_load


def run_ray(path: Path, texts: list[str], budget: int, actors: int, num_cpus: float
            ) -> tuple[float, torch.Tensor, float, float]:
    """Our engine through Ray Data: `actors` embed actors over the passages. The wall from the
    dataset's start (actors' start-up and model load included) to the last row, the
    embeddings, the steady rate (passages a second from the first row out to the last) and
    the time to the first row."""
    import ray

    from batchgen_data.connectors.ray_data import BatchGenProcessorConfig, build_processor

    config = BatchGenProcessorConfig(
        model_source=str(path), task_type="embed", concurrency=actors, num_cpus=num_cpus,
        engine_kwargs={"max_num_batched_tokens": budget, "max_num_seqs": 1024})
    ds = ray.data.from_items([{"id": i, "prompt": t} for i, t in enumerate(texts)])
    t0 = time.perf_counter()
    rows, t_first = [], None
    for row in build_processor(config)(ds).iter_rows():
        rows.append(row)
        if t_first is None:
            t_first = time.perf_counter()
    wall = time.perf_counter() - t0
    steady = (len(rows) - 1) / max(time.perf_counter() - (t_first or t0), 1e-9)
    bad = [r for r in rows if r.get("error")]
    if len(rows) != len(texts) or bad:
        raise RuntimeError(f"Ray Data returned {len(rows)} rows for {len(texts)}, "
                           f"{len(bad)} with errors: {bad[:1]}")
    rows.sort(key=lambda r: r["id"])
    return (wall, torch.tensor([list(r["embedding"]) for r in rows], dtype=torch.float32),
            steady, (t_first or t0) - t0)


def progress(system: str, wall: float) -> None:
    """Each run's wall time as it ends (stderr), so a long run shows where it is."""
    print(f"[embed_throughput] {system}: {wall:.1f} s", file=sys.stderr, flush=True)


def start_ray() -> None:
    import ray
    import ray.data

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
             log_to_driver=False, configure_logging=False)  # a Ray of its own, never a test's
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False


def run_st(path: Path, texts: list[str]) -> tuple[float, torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    t0 = time.perf_counter()
    emb = model.encode(texts, convert_to_tensor=True)
    return time.perf_counter() - t0, emb.float()


def run_hf_padded(path: Path, texts: list[str], batch: int = 32) -> tuple[float, torch.Tensor]:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            enc = tok(texts[i:i + batch], padding=True, return_tensors="pt")
            h = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            rows.append(torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1))
    return time.perf_counter() - t0, torch.cat(rows)


def spread(xs: list[float]) -> str:
    return f"{min(xs):.1f}-{max(xs):.1f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bert-base")
    ap.add_argument("--passages", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="seconds to wait for the load average to fall under 3 first")
    ap.add_argument("--ray-actors", type=int, default=0,
                    help="also run ours through Ray Data with this many actors (0: not)")
    ap.add_argument("--ray-num-cpus", type=float, default=0.5, help="CPUs per Ray actor")
    ap.add_argument("--baselines", default="st,hf",
                    help="comma list of st (sentence-transformers), hf (HF padded); '' for none "
                         "(a Ray overhead run)")
    args = ap.parse_args(argv)
    baselines = {b.strip() for b in args.baselines.split(",") if b.strip()}
    if baselines - {"st", "hf"}:
        ap.error(f"--baselines: st, hf or nothing, not {sorted(baselines - {'st', 'hf'})}")
    if args.threads:
        torch.set_num_threads(args.threads)
    load = wait_for_quiet(args.wait_quiet, below=3.0) if args.wait_quiet else os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args.shape, Path(tmp))
        texts = make_passages(args.passages, SHAPES[args.shape]["vocab_size"], args.seed)
        lens = [len(t.split()) + 2 for t in texts]
        times: dict[str, list[float]] = {"ours": []}
        if "st" in baselines:
            times["sentence-transformers"] = []
        if "hf" in baselines:
            times["hf-padded"] = []
        ray_arm = f"ours-ray-{args.ray_actors}-actors"
        if args.ray_actors:
            times[ray_arm] = []
            start_ray()
        loads: list[float] = []
        ray_steady: list[float] = []
        ray_first: list[float] = []
        cos_st, cos_hf, cos_ray = 1.0, 1.0, 1.0
        stats = None
        for _ in range(args.repeats):
            wall, ours, stats, load_s = run_ours(path, texts, args.budget)
            times["ours"].append(wall)
            progress("ours", wall)
            loads.append(load_s)
            if args.ray_actors:
                wall, got, rate, first = run_ray(path, texts, args.budget, args.ray_actors,
                                                 args.ray_num_cpus)
                times[ray_arm].append(wall)
                progress(ray_arm, wall)
                ray_steady.append(rate)
                ray_first.append(first)
                cos_ray = min(cos_ray, torch.nn.functional.cosine_similarity(ours, got).min().item())
            if "st" in baselines:
                wall, st = run_st(path, texts)
                times["sentence-transformers"].append(wall)
                progress("sentence-transformers", wall)
                cos_st = min(cos_st, torch.nn.functional.cosine_similarity(ours, st).min().item())
            if "hf" in baselines:
                wall, hf = run_hf_padded(path, texts)
                times["hf-padded"].append(wall)
                progress("hf-padded", wall)
                cos_hf = min(cos_hf, torch.nn.functional.cosine_similarity(ours, hf).min().item())
    med = {k: statistics.median(v) for k, v in times.items()}
    pps = {k: args.passages / v for k, v in med.items()}

    def ratio(k: str, base: str) -> float | None:
        return round(pps[k] / pps[base], 2) if base in pps else None

    records = [{"system": k, "passages_s": round(pps[k], 2), "wall_s": round(med[k], 2),
                "wall_spread_s": spread(times[k]), "vs_st": ratio(k, "sentence-transformers"),
                "vs_hf_padded": ratio(k, "hf-padded")} for k in times]
    print(f"{args.shape}, {args.passages} passages (tokens: median {statistics.median(lens)}, "
          f"max {max(lens)}, total {sum(lens)}), {args.repeats} repeats, "
          f"{torch.get_num_threads()} threads, load {load:.1f} at start")
    print(format_table(records, ["system", "passages_s", "wall_s", "wall_spread_s", "vs_st",
                                 "vs_hf_padded"]))
    agree = [f"ours-vs-{b} {c:.6f}" for b, c in (("st", cos_st), ("hf", cos_hf)) if b in baselines]
    if agree:
        print(f"embeddings agree: min cosine {', '.join(agree)}")
    ray_fields: dict[str, Any] = {}
    if args.ray_actors:
        offline_all = [w + s for w, s in zip(times["ours"], loads)]
        over = statistics.median(times[ray_arm]) / statistics.median(offline_all) - 1
        over_embed = med[ray_arm] / med["ours"] - 1
        over_steady = pps["ours"] / statistics.median(ray_steady) - 1
        print(f"Ray Data, {args.ray_actors} actors of {args.ray_num_cpus} CPU: wall "
              f"{med[ray_arm]:.1f} s against ours offline {statistics.median(offline_all):.1f} s "
              f"with its load ({statistics.median(loads):.1f} s), {med['ours']:.1f} s without: "
              f"overhead {100 * over:+.1f}% (load included), {100 * over_embed:+.1f}% "
              f"(embed only); first row after {statistics.median(ray_first):.1f} s, then "
              f"{statistics.median(ray_steady):.2f} passages/s against {pps['ours']:.2f} "
              f"offline: overhead {100 * over_steady:+.1f}% (steady); min cosine ours-vs-ray "
              f"{cos_ray:.6f}")
        ray_fields = {"ray_actors": args.ray_actors, "ray_num_cpus": args.ray_num_cpus,
                      "ray_overhead": round(over, 3), "ray_overhead_vs_embed": round(over_embed, 3),
                      "ray_overhead_steady": round(over_steady, 3),
                      "ray_steady_passages_s_all": [round(x, 2) for x in ray_steady],
                      "ray_first_row_s_all": [round(x, 2) for x in ray_first],
                      "ours_load_s_all": [round(x, 2) for x in loads],
                      "min_cosine_vs_ray": round(cos_ray, 6)}
    result = {"benchmark": "embed_throughput", "shape": args.shape, "passages": args.passages,
              "repeats": args.repeats, "budget": args.budget,
              "threads": torch.get_num_threads(), "load_at_start": round(load, 2),
              "tokens_total": sum(lens), "tokens_median": statistics.median(lens),
              "tokens_max": max(lens),
              "passages_s": {k: round(v, 2) for k, v in pps.items()},
              "wall_s_all": {k: [round(x, 2) for x in v] for k, v in times.items()},
              "ratio_vs_st": ratio("ours", "sentence-transformers"),
              "ratio_vs_hf_padded": ratio("ours", "hf-padded"),
              "min_cosine_vs_st": round(cos_st, 6) if "st" in baselines else None,
              "min_cosine_vs_hf": round(cos_hf, 6) if "hf" in baselines else None,
              "ours_steps": stats.num_steps if stats else None,
              "ours_max_step_tokens": stats.max_step_tokens if stats else None, **ray_fields}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
