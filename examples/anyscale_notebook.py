# %% [markdown]
# # Batch inference with batchgen_data on Ray Data
#
# Paste these cells into an Anyscale (or any Jupyter) notebook attached to a Ray cluster.
# `build_processor` takes the same shape of config as `ray.data.llm.build_processor`; the engine
# runs one model copy per actor and streams each row out as soon as it is finished.
#
# Install once per cluster image: `pip install "batchgen_data[ray]"`.

# %%
import time

import ray

from batchgen_data.connectors.ray_data import BatchGenProcessorConfig, build_processor
from batchgen_data.report import summarize

DATA = "examples/data/prompts.jsonl"  # any JSONL/Parquet source with a text column
LIMIT = 40  # rows to run; None for all of them
MAX_TOKENS = 48

ray.init(ignore_reinit_error=True, log_to_driver=False)  # joins the cluster when there is one
ray.data.DataContext.get_current().enable_progress_bars = False

# %% [markdown]
# ## Configure the processor
# `model_source=None` uses the small model embedded in the package; give a Hugging Face
# checkpoint directory for a real one, and `num_gpus=1` to put each engine on a GPU.

# %%
config = BatchGenProcessorConfig(
    model_source=None,
    concurrency=2,  # engine actors
    batch_size=32,  # rows per input batch; 4 batches are in flight on each actor
    engine_kwargs={"max_model_len": 2048},
    sampling_params={"temperature": 0.0, "max_tokens": MAX_TOKENS},
    num_gpus=0,
)

processor = build_processor(
    config,
    # each row becomes a chat request (the model is an instruct model); the rest passes through
    preprocess=lambda row: {**row, "messages": [
        {"role": "system", "content": f"You are a helpful assistant. Task type: {row['task']}."},
        {"role": "user", "content": row["prompt"]},
    ]},
    # keep what the summary below counts; drop the token ids and the messages
    postprocess=lambda row: {k: row[k] for k in (
        "id", "task", "generated_text", "num_prompt_tokens", "num_generated_tokens",
        "finish_reason", "error")},
)

# %% [markdown]
# ## Run it

# %%
ds = ray.data.read_json(DATA)
if LIMIT is not None:
    ds = ds.limit(LIMIT)
start = time.perf_counter()
out = processor(ds).materialize()  # run once; keep the rows for inspecting and saving
wall_s = time.perf_counter() - start
# rows, errors by kind, empty answers, finish reasons, tokens and throughput
print(summarize(out.take_all(), wall_s=wall_s).format())

# %%
out.to_pandas().sort_values("id").head(10)

# %% [markdown]
# ## Save
# Rows leave the engines as small blocks (one per finished row); `min_rows_per_file` keeps
# Parquet files from being that small too.

# %%
out.write_parquet("/tmp/batchgen_notebook_out", min_rows_per_file=256, mode="overwrite")
