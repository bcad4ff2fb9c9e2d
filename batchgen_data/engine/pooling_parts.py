"""Build a pooling engine's parts (engine/pooling.py) through the generation engine's setup.

`open_checkpoint` and `kv_blocks` (engine/setup.py) do what both run modes do — threads,
device, the checkpoint's config with vLLM's `hf_overrides`, tokenizer, dtype, KV sizing — and
the pooling differences are here: the architecture comes from the pooling registry (encoders,
classifiers, decoder embedding bases, Qwen3-Reranker's two-token head), the linear layers
prefer oneDNN's blocked GEMM (a pooling step is thousands of prefill rows), a decoder's
prefix cache is on only for LAST pooling (MEAN and CLS read every token's hidden state), and
no KV is ever held (a preempted request is recomputed) nor run through a fast path.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from batchgen_data.config import EngineConfig
from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.core.kv.held_kv import HeldKVStore
from batchgen_data.core.scheduler import Scheduler
from batchgen_data.engine.setup import Checkpoint, kv_blocks, open_checkpoint
from batchgen_data.layers.backend import LayerBackend, building
from batchgen_data.layers.pooler import PoolerConfig, PoolingType
from batchgen_data.models import loader
from batchgen_data.models.pooling_config import matryoshka_dimensions, read_pooler_config
from batchgen_data.models.registry import resolve_pooling_architecture
from batchgen_data.worker.model_runner import ModelRunner


@dataclass
class PoolingParts:
    checkpoint: Checkpoint
    model: torch.nn.Module
    is_encoder: bool  # bidirectional: each request runs whole in one step, without KV
    pooler: PoolerConfig
    max_model_len: int
    matryoshka: Any  # the config's Matryoshka dimensions (True: any, a list, None: not one)
    # decoders: the paged KV cache and the generation engine's scheduler; None for encoders
    runner: ModelRunner | None = None
    pool: BlockPool | None = None
    scheduler: Scheduler | None = None


def build_pooling_parts(config: EngineConfig, hf_overrides: dict[str, Any] | None = None
                        ) -> PoolingParts:
    if config.tensor_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}: pooling "
                         "models (embed / classify / score) run on one device "
                         "(docs/parallel.md)")
    ck = open_checkpoint(config, hf_overrides)
    hf, device, dtype = ck.hf_config, ck.device, ck.dtype
    cls = resolve_pooling_architecture(hf)
    labels = getattr(hf, "classifier_from_token", None)
    if labels is not None:
        from batchgen_data.models.decoder_pooling import Qwen3ForReranking
        if not getattr(hf, "is_original_qwen3_reranker", False) or len(labels) != 2:
            raise ValueError("classifier_from_token is supported for Qwen3-Reranker only "
                             "(two tokens, no then yes, with is_original_qwen3_reranker)")
        cls = Qwen3ForReranking
    is_encoder = bool(getattr(cls, "is_encoder", False))
    head_dim = hf.hidden_size // hf.num_attention_heads
    backend = LayerBackend.choose(device, dtype, config.cpu_kernels,
                                  getattr(hf, "head_dim", None) or head_dim,
                                  config.cache.kv_cache_dtype)
    if backend.linear in ("panels", "rows"):
        # those layouts serve a decode step's few rows; a pooling step is thousands of
        # prefill rows, where oneDNN's blocked GEMM is several times faster
        # (benchmarks/embed_throughput.py)
        from batchgen_data.kernels.cpu import linear as cpu_linear
        fast = cpu_linear.onednn_available() and dtype in (torch.float32, torch.bfloat16)
        backend = dataclasses.replace(backend, linear="onednn" if fast else "plain")
    model = _build(cls, hf, dtype, device, backend)
    if is_encoder:
        from batchgen_data.models.encoder_weights import load_encoder_weights
        load_encoder_weights(model, ck.path)
    else:
        loader.load_weights(model, ck.path)
    if labels is not None:
        tok = ck.tokenizer
        ids = [tok.convert_tokens_to_ids(t) for t in labels]
        if any(i is None or i == tok.unk_token_id for i in ids):
            raise ValueError(f"classifier_from_token={labels!r}: not tokens of this "
                             "tokenizer")
        model.label_token_ids = (ids[0], ids[1])
    max_len = model.max_model_len
    if config.max_model_len is not None:
        if config.max_model_len > max_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"{max_len} positions")
        max_len = config.max_model_len
    pooler = read_pooler_config(ck.path, is_encoder)
    parts = PoolingParts(ck, model, is_encoder, pooler, max_len, matryoshka_dimensions(hf))
    if not is_encoder:
        cc, sc = config.cache, config.scheduler
        per_token = ModelRunner.kv_bytes_per_token(model, backend.kv_dtype)
        parts.max_model_len, num_blocks = kv_blocks(cc, device, per_token, max_len,
                                                    sc.max_num_seqs)
        # MEAN / CLS read every token's hidden state: a cached prefix would hide some
        caching = cc.enable_prefix_caching and pooler.pooling_type is PoolingType.LAST
        parts.pool = BlockPool(num_blocks, cc.block_size, caching)
        parts.runner = ModelRunner(model, num_blocks, cc.block_size, backend)
        # no held KV: a preempted request's KV is dropped and computed again
        parts.scheduler = Scheduler(sc, parts.pool, HeldKVStore(0, per_token))
    return parts


def _build(cls: Any, hf: Any, dtype: torch.dtype, device: torch.device,
           backend: LayerBackend) -> torch.nn.Module:
    with torch.device(device), building(backend):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(hf)
        finally:
            torch.set_default_dtype(prev)
    return model.eval().requires_grad_(False)
