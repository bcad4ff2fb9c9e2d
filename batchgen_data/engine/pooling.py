"""The pooling run mode: embed, classify and score requests (no sampling, no decode).

`PoolingEngine.step()` packs waiting requests into one varlen batch under the token budget
(`max_num_batched_tokens`, no padding), runs the model once, reduces each request's rows
(`layers/pooler.py`) and returns the requests that finished, in completion order:
  * decoders (causal) go through the generation engine's scheduler and paged KV cache, so a
    long input prefills in chunks across steps and shared prefixes come from the prefix cache;
    a request's blocks are released the step it is pooled (they stay in the prefix cache);
  * encoders (BERT, XLM-RoBERTa: bidirectional attention) need all of a request's tokens in one
    pass, so each request runs whole in one step and keeps no KV at all. A request longer than
    the budget runs alone in its step.
What a request asks (`PoolingParams`) is checked at `submit`; a bad one raises ValueError
with the row-error words the connectors use (docs/row-errors.md).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from batchgen_data.config import EngineConfig, make_engine_config
from batchgen_data.worker.devices import device_scope, pick_device, resolve_device
from batchgen_data.worker.model_runner import ModelRunner
from batchgen_data.core.scheduler import Scheduler
from batchgen_data.core.sequence import Sequence
from batchgen_data.engine.setup import _num_blocks, pick_dtype
from batchgen_data.core.kv.block_pool import BlockPool
from batchgen_data.core.kv.held_kv import HeldKVStore
from batchgen_data.layers.backend import LayerBackend, building
from batchgen_data.layers.pooler import (PoolerConfig, PoolingType, chunk_pools, finish_pool,
                                         matryoshka)
from batchgen_data.models import loader
from batchgen_data.models.pooling_config import matryoshka_dimensions, read_pooler_config
from batchgen_data.models.registry import resolve_pooling_architecture
from batchgen_data.pooling_params import (TASKS, ClassificationOutput, EmbeddingOutput,
                                          PoolingParams, PoolingRequestOutput, ScoringOutput)
from batchgen_data.inputs.prompt_checks import first_bad_token
from batchgen_data.sampling_params import SamplingParams


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: str | None
    token_ids: list[int]
    token_type_ids: list[int] | None
    params: PoolingParams
    task: str
    seq: Sequence | None = None  # decoders: the scheduler's view of the request
    # running values over the request's chunks (float32 [hidden])
    total: torch.Tensor | None = None
    count: int = 0
    first: torch.Tensor | None = None
    last: torch.Tensor | None = None
    num_cached_tokens: int = 0


@dataclass
class PoolingStats:
    num_steps: int = 0
    num_tokens: int = 0
    num_finished: int = 0
    step_s: float = 0.0
    max_step_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class PoolingEngine:
    """One model run as a pooling model. `submit` requests, call `step` until
    `has_unfinished()` is False; each step returns the requests it finished."""

    def __init__(self, config: EngineConfig, hf_overrides: dict[str, Any] | None = None) -> None:
        """`hf_overrides` (vLLM's): HF config fields to replace, e.g. Qwen3-Reranker's
        `{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token":
        ["no", "yes"], "is_original_qwen3_reranker": True}`."""
        self.config = config
        if config.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}: pooling "
                             "models (embed / classify / score) run on one device "
                             "(docs/parallel.md)")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = device = resolve_device(pick_device(config.device))
        path = loader.resolve_model_path(config.model)
        self.hf_config = hf = loader.load_config(path, config.trust_remote_code)
        for key, value in (hf_overrides or {}).items():
            setattr(hf, key, value)
        tok_path = loader.resolve_model_path(config.tokenizer) if config.tokenizer else path
        self.tokenizer = loader.load_tokenizer(tok_path, config.trust_remote_code)
        self.dtype = dtype = pick_dtype(config.dtype, device, hf)
        cls = resolve_pooling_architecture(hf)
        labels = getattr(hf, "classifier_from_token", None)
        if labels is not None:
            from batchgen_data.models.decoder_pooling import Qwen3ForReranking
            if not getattr(hf, "is_original_qwen3_reranker", False) or len(labels) != 2:
                raise ValueError("classifier_from_token is supported for Qwen3-Reranker only "
                                 "(two tokens, no then yes, with is_original_qwen3_reranker)")
            cls = Qwen3ForReranking
        self.is_encoder = bool(getattr(cls, "is_encoder", False))
        head_dim = hf.hidden_size // hf.num_attention_heads
        backend = LayerBackend.choose(device, dtype, config.cpu_kernels,
                                      getattr(hf, "head_dim", None) or head_dim,
                                      config.cache.kv_cache_dtype)
        if backend.linear in ("panels", "rows"):
            # those layouts serve a decode step's few rows; a pooling step is thousands of
            # prefill rows, where oneDNN's blocked GEMM ran 2.5x the panels' (4096 x 768 x 3072
            # fp32 on the AVX-512 dev box: 43 vs 16 GFLOPS, plain F.linear 34)
            from batchgen_data.kernels.cpu import linear as cpu_linear
            fast = cpu_linear.onednn_available() and dtype in (torch.float32, torch.bfloat16)
            backend = dataclasses.replace(backend, linear="onednn" if fast else "plain")
        with torch.device(device), building(backend):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                model = cls(hf)
            finally:
                torch.set_default_dtype(prev)
        self.model = model = model.eval().requires_grad_(False)
        if self.is_encoder:
            from batchgen_data.models.encoder_weights import load_encoder_weights
            load_encoder_weights(model, path)
        else:
            loader.load_weights(model, path)
        if labels is not None:
            ids = [self.tokenizer.convert_tokens_to_ids(t) for t in labels]
            if any(i is None or i == self.tokenizer.unk_token_id for i in ids):
                raise ValueError(f"classifier_from_token={labels!r}: not tokens of this "
                                 "tokenizer")
            model.label_token_ids = (ids[0], ids[1])
        self.pooler: PoolerConfig = read_pooler_config(path, self.is_encoder)
        self.hidden_size = hf.hidden_size
        self.vocab_size = hf.vocab_size
        self.num_labels = getattr(model, "num_labels", None)
        self.matryoshka = matryoshka_dimensions(hf)
        max_len = model.max_model_len
        if config.max_model_len is not None:
            if config.max_model_len > max_len:
                raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                                 f"{max_len} positions")
            max_len = config.max_model_len
        self.max_model_len = max_len
        sc = config.scheduler
        self.token_budget = sc.max_num_batched_tokens
        self.max_num_seqs = sc.max_num_seqs
        self.stats = PoolingStats()
        self._waiting: deque[_Request] = deque()  # encoders
        self._live: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._ids = itertools.count()
        self.scheduler: Scheduler | None = None
        if not self.is_encoder:
            cc = config.cache
            per_token = ModelRunner.kv_bytes_per_token(model, backend.kv_dtype)
            num_blocks = cc.num_kv_blocks or _num_blocks(cc, device, per_token, max_len,
                                                         sc.max_num_seqs)
            # MEAN / CLS read every token's hidden state: a cached prefix would hide some
            caching = cc.enable_prefix_caching and self.pooler.pooling_type is PoolingType.LAST
            self.pool = BlockPool(num_blocks, cc.block_size, caching)
            self.runner = ModelRunner(model, num_blocks, cc.block_size, backend)
            self.scheduler = Scheduler(sc, self.pool, HeldKVStore(0, per_token))
            self._seq_params = SamplingParams(max_tokens=1)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "PoolingEngine":
        kwargs.pop("runner", None)
        overrides = kwargs.pop("hf_overrides", None)
        return cls(make_engine_config(model, **kwargs), overrides)

    # ---- what the model can do ------------------------------------------------------------
    @property
    def can_classify(self) -> bool:
        return self.num_labels is not None

    @property
    def cross_encoder(self) -> bool:
        """Scores a pair in one pass (a classifier with one label); otherwise `score` is the
        cosine of the two embeddings."""
        return self.num_labels == 1

    def embed_size(self) -> int:
        return self.hidden_size

    # ---- submitting -----------------------------------------------------------------------
    def prepare(self, token_ids: Any, params: PoolingParams, task: str,
                token_type_ids: list[int] | None = None) -> tuple[list[int], list[int] | None]:
        """The request's tokens after truncation; ValueError/TypeError for one the engine
        cannot run, in the words of docs/row-errors.md."""
        if task not in TASKS:
            raise ValueError(f"task={task!r}: must be one of {TASKS}")
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
        bad = first_bad_token(token_ids, self.vocab_size)
        if bad is not None:
            raise ValueError(bad.replace("prompt_token_ids is empty", "input is empty"))
        ids = params.truncated(list(token_ids), self.max_model_len)
        types = None if token_type_ids is None else list(token_type_ids)[:len(ids)]
        if len(ids) > self.max_model_len:
            raise ValueError(f"input has {len(ids)} tokens; the model takes at most "
                             f"{self.max_model_len} (max_model_len): set truncate_prompt_tokens "
                             "to cut it")
        if task == "embed" and params.dimensions is not None:
            d = params.dimensions
            if self.matryoshka is None:
                raise ValueError(f"dimensions={d}: this model does not support Matryoshka "
                                 "embeddings (its config has no is_matryoshka / "
                                 "matryoshka_dimensions)")
            if d > self.hidden_size:
                raise ValueError(f"dimensions={d} is more than the model's embedding size "
                                 f"{self.hidden_size}")
            if isinstance(self.matryoshka, list) and d not in self.matryoshka:
                raise ValueError(f"dimensions={d}: this model supports {self.matryoshka}")
        if task == "classify" and not self.can_classify:
            raise ValueError("this model has no classification head (classify needs a "
                             "*ForSequenceClassification checkpoint)")
        if task == "score" and not self.cross_encoder:
            raise ValueError("this model cannot score a pair in one pass (a cross-encoder is a "
                             "*ForSequenceClassification with num_labels=1); score embeds "
                             "both texts instead")
        return ids, types

    def submit(self, token_ids: list[int], params: PoolingParams | None = None,
               task: str = "embed", request_id: str | None = None, prompt: str | None = None,
               token_type_ids: list[int] | None = None) -> str:
        params = params or PoolingParams()
        ids, types = self.prepare(token_ids, params, task, token_type_ids)
        rid = request_id if request_id is not None else f"pool-{next(self._ids)}"
        if rid in self._live:
            raise ValueError(f"request_id={rid!r} is already in this engine")
        req = _Request(rid, prompt, ids, types, params, task)
        self._live[rid] = req
        if self.scheduler is None:
            self._waiting.append(req)
        else:
            seq = Sequence(next(self._ids), rid, 0, ids, self._seq_params, 0, 1)
            req.seq = seq
            self._by_seq[seq.seq_id] = req
            self.scheduler.add(seq)
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def num_unfinished(self) -> int:
        return len(self._live)

    def abort(self, request_id: str) -> bool:
        req = self._live.pop(request_id, None)
        if req is None:
            return False
        if req.seq is not None:
            assert self.scheduler is not None
            self.scheduler.remove(req.seq)
            del self._by_seq[req.seq.seq_id]
        else:
            self._waiting.remove(req)
        return True

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[PoolingRequestOutput]:
        t0 = time.perf_counter()
        with device_scope(self.device):
            chunks = self._step_encoder() if self.scheduler is None else self._step_decoder()
        done = [r for r, _, end in chunks if end]
        outs = self._finish(done)
        ntok = sum(n for _, n, _ in chunks)
        s = self.stats
        s.num_steps += bool(chunks)
        s.num_tokens += ntok
        s.max_step_tokens = max(s.max_step_tokens, ntok)
        s.num_finished += len(outs)
        s.step_s += time.perf_counter() - t0
        return outs

    def _accumulate(self, reqs: list[tuple[_Request, int, int]], hidden: torch.Tensor) -> None:
        """Fold each chunk (request, start, length) of the packed `hidden` into its request."""
        pools = chunk_pools(hidden, [n for _, _, n in reqs],
                            want_sums=self.pooler.pooling_type is PoolingType.MEAN)
        for j, (req, start, n) in enumerate(reqs):
            if start == 0:
                req.first = pools.firsts[j]
                req.total, req.count = None, 0
            if pools.sums.numel():
                req.total = pools.sums[j] if req.total is None else req.total + pools.sums[j]
                req.count += n
            req.last = pools.lasts[j]

    def _step_encoder(self) -> list[tuple[_Request, int, bool]]:
        batch: list[_Request] = []
        used = 0
        while self._waiting and len(batch) < self.max_num_seqs:
            n = len(self._waiting[0].token_ids)
            if batch and used + n > self.token_budget:
                break
            batch.append(self._waiting.popleft())
            used += n
        if not batch:
            return []
        lens = [len(r.token_ids) for r in batch]
        dev = self.device
        ids = torch.tensor([t for r in batch for t in r.token_ids], dtype=torch.long)
        pos = torch.cat([torch.arange(n) for n in lens])
        types = torch.tensor([t for r in batch for t in (r.token_type_ids or [0] * len(r.token_ids))],
                             dtype=torch.long)
        hidden = self.model(ids.to(dev), pos.to(dev), types.to(dev), lens)
        self._accumulate([(r, 0, n) for r, n in zip(batch, lens)], hidden)
        return [(r, n, True) for r, n in zip(batch, lens)]

    def _step_decoder(self) -> list[tuple[_Request, int, bool]]:
        sched = self.scheduler
        assert sched is not None
        out = sched.schedule()
        for seq in out.held:  # preempted: its KV is dropped and recomputed from the start
            self._by_seq[seq.seq_id].total = None
        if not out.seqs:
            return []
        inp = self.runner.prepare(out)
        hidden = self.model(inp.input_ids, inp.positions, self.runner.kv_caches, inp.meta)
        chunks = []
        for i in inp.order:  # the runner's row order
            seq, n = out.seqs[i], out.num_new_tokens[i]
            chunks.append((self._by_seq[seq.seq_id], seq.num_computed_tokens, n))
        self._accumulate(chunks, hidden)
        result = []
        for req, _, n in chunks:
            seq = req.seq
            assert seq is not None
            seq.num_computed_tokens += n
            result.append((req, n, seq.num_computed_tokens >= seq.num_tokens))
        sched.after_step(out)
        for req, _, end in result:
            if end:
                assert req.seq is not None
                req.num_cached_tokens = req.seq.num_cached_tokens
                sched.remove(req.seq)  # its full blocks stay in the prefix cache
                del self._by_seq[req.seq.seq_id]
        return result

    def _finish(self, done: list[_Request]) -> list[PoolingRequestOutput]:
        if not done:
            return []
        outs: dict[str, PoolingRequestOutput] = {}
        embeds = [r for r in done if r.task == "embed"]
        if embeds:
            kind = self.pooler.pooling_type
            vecs = torch.stack([finish_pool(kind, r.total, r.count, r.first, r.last)
                                for r in embeds])
            for r, v in zip(embeds, vecs):
                norm = self.pooler.normalize if r.params.normalize is None else r.params.normalize
                vec = matryoshka(v, r.params.dimensions, norm)
                outs[r.request_id] = self._output(r, EmbeddingOutput(vec.tolist()))
        heads = [r for r in done if r.task != "embed"]
        if heads:
            rows = torch.stack([(r.first if self.is_encoder else r.last) for r in heads])
            logits = self.model.classify(rows.to(self.dtype))  # [N, num_labels] float32
            probs = torch.sigmoid(logits) if logits.shape[1] == 1 else logits.softmax(-1)
            for r, lg, p in zip(heads, logits, probs):
                vals = (p if r.params.activation else lg).tolist()
                result = ScoringOutput(vals[0]) if r.task == "score" else \
                    ClassificationOutput(vals)
                outs[r.request_id] = self._output(r, result)
        return [outs[r.request_id] for r in done]

    def _output(self, r: _Request, result: Any) -> PoolingRequestOutput:
        del self._live[r.request_id]
        return PoolingRequestOutput(r.request_id, r.prompt, r.token_ids, result,
                                    num_cached_tokens=r.num_cached_tokens)
