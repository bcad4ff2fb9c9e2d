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

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from batchgen_data.config import EngineConfig, make_engine_config
from batchgen_data.core.scheduler import Scheduler
from batchgen_data.core.sequence import Sequence
from batchgen_data.engine.pooling_parts import build_pooling_parts
from batchgen_data.layers.pooler import PoolingType, chunk_pools, finish_pool, matryoshka
from batchgen_data.pooling_params import (TASKS, ClassificationOutput, EmbeddingOutput,
                                          PoolingParams, PoolingRequestOutput, ScoringOutput)
from batchgen_data.inputs.prompt_checks import first_bad_token
from batchgen_data.worker.devices import device_scope
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
    `has_unfinished()` is False; each step returns the requests it finished. It implements
    `EngineBase` (engine/protocol.py)."""

    kind = "pooling engine"

    def __init__(self, config: EngineConfig, hf_overrides: dict[str, Any] | None = None) -> None:
        """`hf_overrides` (vLLM's): HF config fields to replace, e.g. Qwen3-Reranker's
        `{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token":
        ["no", "yes"], "is_original_qwen3_reranker": True}`."""
        self.config = config
        p = build_pooling_parts(config, hf_overrides)  # engine/pooling_parts.py
        ck = p.checkpoint
        self.device, self.hf_config, self.tokenizer, self.dtype = (
            ck.device, ck.hf_config, ck.tokenizer, ck.dtype)
        self.model, self.is_encoder, self.pooler = p.model, p.is_encoder, p.pooler
        self.hidden_size = ck.hf_config.hidden_size
        self.vocab_size = ck.hf_config.vocab_size
        self.num_labels = getattr(p.model, "num_labels", None)
        self.matryoshka = p.matryoshka
        self.max_model_len = p.max_model_len
        sc = config.scheduler
        self.token_budget = sc.max_num_batched_tokens
        self.max_num_seqs = sc.max_num_seqs
        self.stats = PoolingStats()
        self._waiting: deque[_Request] = deque()  # encoders
        self._live: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._ids = itertools.count()
        self.scheduler: Scheduler | None = p.scheduler  # decoders (None: encoders)
        if p.runner is not None:
            self.pool, self.runner = p.pool, p.runner
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

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block of a decoder's KV cache (encoders keep none)."""
        if self.scheduler is not None:
            self.pool.reset_prefix_cache()
        return True

    def close(self) -> None:
        """Nothing to stop: one device, in this process, stepped by its caller."""

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
