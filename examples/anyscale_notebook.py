# %% [markdown]
# # Batch inference with batchgen_data on Ray Data
#
# Paste these cells into an Anyscale (or any Jupyter) notebook attached to a Ray cluster.
# `build_processor` takes the same shape of config as `ray.data.llm.build_processor`; the engine
# runs one model copy per actor and streams each row out as soon as it is finished.
#
# Install once per cluster image: `pip install "batchgen_data[ray]"`.

# %%
import ray

from batchgen_data.connectors.ray_data import BatchGenProcessorConfig, build_processor

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
    # each row becomes a chat request; anything else in the row passes through
    preprocess=lambda row: {**row, "messages": [
        {"role": "system", "content": f"You are a helpful assistant. Task type: {row['task']}."},
        {"role": "user", "content": row["prompt"]},
    ]},
    postprocess=lambda row: {"id": row["id"], "task": row["task"],
                             "answer": row["generated_text"], "tokens": row["num_generated_tokens"],
                             "error": row["error"]},
)

# %% [markdown]
# ## Run it

# %%
ds = ray.data.read_json(DATA)
if LIMIT is not None:
    ds = ds.limit(LIMIT)
out = processor(ds).materialize()  # run once; keep the rows for inspecting and saving
results = out.to_pandas()
print(f"{len(results)} rows, {results['error'].notna().sum()} errors, "
      f"{results['tokens'].sum()} generated tokens")

# %%
results.sort_values("id").head(10)

# %% [markdown]
# ## Save
# Rows leave the engines as small blocks (one per finished row); `min_rows_per_file` keeps
# Parquet files from being that small too.

# %%
out.write_parquet("/tmp/batchgen_notebook_out", min_rows_per_file=256, mode="overwrite")
