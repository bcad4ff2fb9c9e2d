"""Spark: `batchgen_udf` against `pyspark.ml.functions.predict_batch_udf` wrapping HF `generate`.

Both run on the same DataFrame, model, Spark session (local[N]) and greedy decoding with the same
`max_tokens`, stopping at EOS. The baseline is what Spark users write today: a predict function
that left-pads each batch and calls `model.generate`; every Arrow batch is split into batches of
`--batch-size`, and a batch runs until its longest row is done. batchgen_udf keeps rows from many
Arrow batches in one continuously batched engine. Both get one torch thread per task (=
spark.task.cpus) and are warmed up first, so model loading is not timed; timed runs alternate
between the systems and the median is reported.

    python benchmarks/spark_vs_predict_batch_udf.py                  # default model, 256 rows
    python benchmarks/spark_vs_predict_batch_udf.py --rows 64 --max-tokens 16
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_report, wait_for_quiet  # noqa: E402

TOPICS = ["the ocean", "a broken laptop", "tax forms", "a football match", "quantum computers",
          "grandmother's soup recipe", "a delayed train", "the history of Rome"]
STYLES = ["Write one sentence about {t}.",
          "Explain {t} to a child.",
          "List three facts about {t}, then summarise them in a short paragraph.",
          "Write a product review that mentions {t}."]


def prompts(n: int, tokenizer: Any) -> list[str]:
    """Chat-formatted requests of mixed tasks, so answers end (EOS) at varied lengths.

    The chat template is applied here, once, so both systems tokenize the very same text.
    """
    out = []
    for i in range(n):
        ask = STYLES[i % len(STYLES)].format(t=TOPICS[(i // len(STYLES)) % len(TOPICS)])
        msgs = [{"role": "user", "content": f"{ask} (request {i})"}]
        out.append(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    return out


def hf_predict_fn(model_dir: str, max_tokens: int, threads: int) -> Callable[[], Callable]:
    """`make_predict_fn` for predict_batch_udf: left-padded greedy HF generate per batch."""

    def make() -> Callable:
        import numpy as np
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        tok.pad_token = tok.pad_token or tok.eos_token
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

        def predict(texts: np.ndarray) -> dict[str, np.ndarray]:
            enc = tok(list(texts), return_tensors="pt", padding=True)
            with torch.inference_mode():
                out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                                     pad_token_id=tok.pad_token_id)
            new = out[:, enc["input_ids"].shape[1]:]
            done = new == tok.eos_token_id  # tokens after the first EOS are padding
            lengths = torch.where(done.any(1), done.int().argmax(1) + 1, new.shape[1])
            text = [tok.decode(row[:n], skip_special_tokens=True) for row, n in zip(new, lengths)]
            return {"text": np.array(text, dtype=object), "num_tokens": lengths.numpy()}

        return predict

    return make


def timed(df: Any, column: Any, tokens_field: str) -> tuple[float, int, int]:
    """(wall seconds, rows, generated tokens) for one full evaluation of `column` over `df`."""
    from pyspark.sql import functions as F

    t0 = time.perf_counter()
    row = df.select(column.alias("o")).agg(F.count("*").alias("rows"),
                                           F.sum(f"o.{tokens_field}").alias("tokens")).first()
    return time.perf_counter() - t0, row["rows"], int(row["tokens"] or 0)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: the embedded model)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16, help="predict_batch_udf batch_size")
    ap.add_argument("--arrow-batch", type=int, default=64, help="arrow.maxRecordsPerBatch")
    ap.add_argument("--cores", type=int, default=2, help="local[N]; one torch thread per task")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per system (median)")
    ap.add_argument("--quiet-wait", type=float, default=60.0, help="max s to wait for low load")
    args = ap.parse_args(argv)

    from batchgen_data.models.loader import resolve_model_path
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql import SparkSession
    from pyspark.sql import types as T

    from batchgen_data.connectors.spark import batchgen_udf

    model_dir = str(resolve_model_path(args.model))  # converts the default model once
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master(f"local[{args.cores}]").appName("bench-spark")
             .config("spark.ui.enabled", "false").config("spark.python.worker.reuse", "true")
             .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(args.arrow_batch))
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    from transformers import AutoTokenizer

    texts = prompts(args.rows, AutoTokenizer.from_pretrained(model_dir))
    df = spark.createDataFrame([(i, p) for i, p in enumerate(texts)],
                               "id long, prompt string").repartition(args.cores).cache()
    df.count()
    warm = df.limit(args.cores * 4).repartition(args.cores)

    baseline = predict_batch_udf(
        hf_predict_fn(model_dir, args.max_tokens, threads=1),
        return_type=T.StructType([T.StructField("text", T.StringType()),
                                  T.StructField("num_tokens", T.LongType())]),
        batch_size=args.batch_size)
    ours = batchgen_udf(model_dir, {"temperature": 0.0, "max_tokens": args.max_tokens})
    systems = [("predict_batch_udf+hf_generate", baseline, "num_tokens"),
               ("batchgen_udf", ours, "num_generated_tokens")]

    for _, udf, tokens_field in systems:
        timed(warm, udf("prompt"), tokens_field)  # load the model in every worker
    runs: dict[str, list[tuple[float, int, int, float]]] = {name: [] for name, _, _ in systems}
    for _ in range(args.repeat):  # interleaved, so a noisy neighbour hits both systems alike
        for name, udf, tokens_field in systems:
            load = wait_for_quiet(args.quiet_wait)
            runs[name].append((*timed(df, udf("prompt"), tokens_field), load))
    results = []
    for name, _, _ in systems:
        wall, rows, tokens, load = sorted(runs[name])[(len(runs[name]) - 1) // 2]  # median
        results.append({"system": name, "rows": rows, "output_tokens": tokens,
                        "wall_s": round(wall, 2), "rows_per_s": round(rows / wall, 2),
                        "tok_per_s": round(tokens / wall, 1), "load_avg": round(load, 1),
                        "wall_s_all": [round(r[0], 2) for r in runs[name]]})
    base = results[0]["rows_per_s"]
    for rec in results:
        rec["vs_predict_batch_udf"] = round(rec["rows_per_s"] / base, 2)
        rec.update(model=Path(model_dir).name, max_tokens=args.max_tokens,
                   batch_size=args.batch_size, arrow_batch=args.arrow_batch, cores=args.cores)
    print_report(results, ["system", "rows", "output_tokens", "wall_s", "rows_per_s", "tok_per_s",
                           "vs_predict_batch_udf", "load_avg"])
    spark.stop()
    return results


if __name__ == "__main__":
    main()
