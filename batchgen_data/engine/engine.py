"""The engine: owns the coroutines, the scheduler, the KV cache and the model runner.

`step()` runs one scheduling round: the scheduler picks suspended coroutines and token counts,
the runner computes them in one batch, the sampler draws next tokens, and each coroutine is
resumed with its result (engine/stepper.py). Requests that finish in the step are returned at
once (completion order). The suspension-point primitives — abort, hold, resume, export,
import_ — are public, and so is what a placement policy reads (`load`, `movable`); nothing
outside `engine/` needs the scheduler itself. It implements `GenerationEngine`
(engine/protocol.py); docs/ENGINE_API.md is the contract.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Container, Iterable
from typing import Any

from batchgen_data.config import EngineConfig, make_engine_config
from batchgen_data.core import queue_report
from batchgen_data.core.pins import PrefixPins
from batchgen_data.core.encoder_cache import EncoderCache
from batchgen_data.core.multimodal import MultiModalPrompt
from batchgen_data.core.request import Request
from batchgen_data.core.scheduler import Scheduler
from batchgen_data.core.sequence import Sequence
from batchgen_data.core.thinking import ThinkingBudget, check_budget, job_cap
from batchgen_data.engine import transfer
from batchgen_data.engine.limits import check_limits, seed_bits
from batchgen_data.engine.live import LiveWork
from batchgen_data.engine.overlap import OverlappedStepper
from batchgen_data.engine.setup import EngineParts, build_parts
from batchgen_data.engine.stats import EngineStats
from batchgen_data.engine.stepper import Stepper
from batchgen_data.inputs.prompt_checks import first_bad_token, too_long
from batchgen_data.lora_request import AdapterNames, LoRARequest
from batchgen_data.outputs import RequestOutput
from batchgen_data.placement import EngineId, EngineLoad, PrefixSummary, RequestSummary
from batchgen_data.reasoning.reader import OutputReader
from batchgen_data.sample.draw.draw_hash import sample_seed
from batchgen_data.sample.sampler import Sampler
from batchgen_data.sampling_params import SamplingParams
from batchgen_data.worker.lora_manager import adapter_names_for, check_adapter
from batchgen_data.worker.runner import Runner


class Engine:
    kind = "generation engine"

    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        """`parts`: what the engine runs (built from `config` when None): the seam for a
        runner of one's own (worker/runner.py), e.g. the lab's emulated one."""
        p = parts or build_parts(config)
        # the effective config: the scheduler caps the engine runs with (offload's module
        # batching raises those the user left unset), read by everyone from here
        if p.scheduler_config is not None and p.scheduler_config != config.scheduler:
            config = dataclasses.replace(config, scheduler=p.scheduler_config)
        self.config = config
        self.tokenizer = p.tokenizer
        self.device = p.device
        self.max_model_len = p.max_model_len
        self.vocab_size = p.model.shape.vocab
        self.pool = p.pool
        self.held_kv = p.held_kv
        moe = getattr(p.model, "moe", None)  # MoE models: their routing sizes the step budget
        self.scheduler = Scheduler(config.scheduler, p.pool, p.held_kv,
                                   (moe.num_experts, moe.top_k) if moe is not None else None)
        self.runner: Runner = p.runner
        if config.lora.enable_lora:  # adapters per request (worker/lora_manager.py)
            from batchgen_data.worker.lora_manager import attach

            self.runner.lora = attach(p.model, p.runner, config)
            self.scheduler.max_loras = config.lora.max_loras
        self.stopper = p.stopper
        self.sampler = p.sampler or Sampler(p.stopper.eos_token_ids, p.tokenizer)
        self.stats = EngineStats()
        if config.enable_expert_parallel and config.tensor_parallel_size > 1:
            self.stats.tokens_per_expert.ranks = config.tensor_parallel_size  # per-rank shares
        self.pins = PrefixPins(p.pool)  # prefixes kept for programs' next steps (core/pins.py)
        # a vision-language model: prompts may carry images (submit's mm_inputs), encoded in
        # the steps' encoder batches into this cache by content hash (core/encoder_step.py)
        self._images = p.model if getattr(p.model, "takes_images", False) else None
        self.encoder_cache: EncoderCache | None = None
        if self._images is not None:
            if config.tensor_parallel_size > 1:
                raise ValueError("a vision-language model runs with tensor_parallel_size=1")
            self.encoder_cache = EncoderCache(config.scheduler.encoder_cache_rows)
            self.scheduler.encoder_cache = self.encoder_cache
            self.runner.encoder_cache = self.encoder_cache  # type: ignore[attr-defined]
        # how outputs are read (config.reasoning_parser, tool_call_parser): reasoning and tool
        # calls apart; thinking budgets read the reasoning parser's tags (core/thinking.py)
        reader = OutputReader.of(p.tokenizer, config.reasoning_parser, config.reasoning_end_str,
                                 config.tool_call_parser)
        self.reasoning = None if reader is None else reader.reasoning
        self.thinking_cap = job_cap(config.thinking_cap_quantile, self.reasoning,
                                    config.async_scheduling)
        self.live = LiveWork(self.scheduler, p.held_kv, self.pins, self.runner, self.stopper,
                             self.stats, reader)
        self._seq_ids = itertools.count()
        self._req_ids = itertools.count()
        self._rng = random.Random(config.seed)
        self._stepper = self._make_stepper()

    def _make_stepper(self) -> Stepper:
        args = (self.live, self.runner, self.sampler, self.vocab_size, self.device)
        if not self.config.async_scheduling:
            return Stepper(*args)
        if not self.runner.can_overlap:
            raise ValueError("async_scheduling=True needs a runner that can overlap steps: not "
                             "with enable_lora, a KV host tier, tensor parallelism or a runner "
                             "given in the engine's parts that cannot (docs/step.md)")
        return OverlappedStepper(*args)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "Engine":
        return cls(make_engine_config(model, **kwargs))

    # ---- submitting work ------------------------------------------------------------------
    def check_request(self, prompt_token_ids: Any, params: Any) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        bad = first_bad_token(prompt_token_ids, self.vocab_size)  # same words as the connectors
        if bad is not None:
            raise ValueError(bad)
        prompt_token_ids = params.truncated_prompt(list(prompt_token_ids), self.max_model_len)
        long = too_long(len(prompt_token_ids), self.max_model_len)  # no room for an output
        if long is not None:
            raise ValueError(long)
        self.sampler.check(params, self.vocab_size)
        check_limits(params, self.vocab_size, self.config.max_logprobs)
        check_budget(params, self.reasoning, self.config.async_scheduling)

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """ValueError unless this engine can run `lora_request` (enable_lora, the adapter
        readable and fitting the model); its weights are then in host memory. Thread-safe:
        connectors call it on their row threads."""
        check_adapter(self.runner.lora, lora_request)

    def lora_names(self) -> AdapterNames | None:
        """How rows name adapters here (a `lora` column, a row's `model`), or None without
        enable_lora (batchgen_data/lora_request.py)."""
        return adapter_names_for(self.config)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
               request_id: str | None = None, prompt: str | None = None,
               lora_request: LoRARequest | None = None, pin: str | None = None,
               front: bool = False, alone: bool = False,
               mm_inputs: list[Any] | None = None) -> str:
        """`lora_request`: the adapter it runs under (None: the base model). `pin`: when the
        request finishes, keep its cached KV under that key until `unpin(pin)` (a program's
        next step extends this conversation: core/pins.py). `front`: queue it ahead of the
        waiting requests (a started program's next step goes before new programs, so it
        finishes while its KV is still there). `alone`: it runs in steps of its own, with no
        other request (a row suspected of killing an engine, run so that a failure names it
        alone: docs/row-errors.md). `mm_inputs`: the prompt's images, in prompt order, each
        with its placeholder tokens already in `prompt_token_ids` (`inputs/images.py`'s
        `ImageInput`: hash, pixel_values, grid_thw, num_tokens, offset; docs/multimodal.md)."""
        params = params or SamplingParams()
        self.check_request(prompt_token_ids, params)
        self.check_lora(lora_request)
        rid = request_id if request_id is not None else f"req-{next(self._req_ids)}"
        self._check_new(rid)
        ids = params.truncated_prompt(list(prompt_token_ids), self.max_model_len)
        mm = self._multimodal(ids, len(prompt_token_ids), mm_inputs)
        req = Request(rid, prompt, ids, params, pin=pin, lora=lora_request)
        room = self.max_model_len - len(ids)
        for i in range(params.n):
            seed = self._seed_for(params.seed, i)
            max_tokens = min(params.max_tokens or room, room)
            req.seqs.append(Sequence(next(self._seq_ids), rid, i, ids, params, seed, max_tokens,
                                     lora=lora_request, alone=alone, mm=mm))
            if self.reasoning is not None:  # a budget or the job cap may watch it
                ThinkingBudget.attach(req.seqs[-1], self.reasoning, self.thinking_cap)
        self.live.add(req, front=front)
        return rid

    def _multimodal(self, ids: list[int], given: int, mm_inputs: list[Any] | None
                    ) -> MultiModalPrompt | None:
        """The prompt's images as its sequences keep them (None: a text prompt)."""
        if not mm_inputs:
            return None
        if self._images is None:
            raise ValueError("mm_inputs: this model takes no images (a text-only model)")
        if len(ids) != given:
            raise ValueError("mm_inputs: a prompt with images cannot be truncated "
                             "(truncate_prompt_tokens)")
        return self._images.multimodal_prompt(ids, list(mm_inputs))

    def _check_new(self, rid: str) -> None:
        if rid in self.live.requests or rid in self.live.held:
            raise ValueError(f"request_id={rid!r} is already in this engine")

    def _seed_for(self, seed: int | None, index: int) -> int:
        if seed is None:
            return self._rng.getrandbits(62)
        return sample_seed(seed_bits(seed), index)

    def has_unfinished(self) -> bool:
        return bool(self.live.requests) or bool(self.live.outputs)

    def num_unfinished(self, exclude: Container[str] = ()) -> int:
        """Live requests (waiting, running, held for memory), those in `exclude` left out."""
        if not exclude:
            return len(self.live.requests)
        return sum(1 for rid in self.live.requests if rid not in exclude)

    def is_live(self, request_id: str) -> bool:
        """Submitted or imported here and not finished, aborted, exported or held by hold()."""
        return request_id in self.live.requests

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling round (engine/stepper.py; with `async_scheduling`, overlapped with the
        next one: engine/overlap.py, docs/step.md)."""
        return self._stepper.step()

    def close(self) -> None:
        """Finish the step in flight (its outputs come with the next `step()`), stop the
        device thread of overlapped steps and what the runner started (a tensor-parallel
        engine's ranks)."""
        try:
            self._stepper.close()
        finally:
            self.runner.close()

    # ---- suspension-point primitives ------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        self._stepper.drain()  # a step in flight (async_scheduling) finishes first
        return self.live.abort(request_id)

    def unpin(self, key: str) -> bool:
        """Release the KV kept under `key` by requests submitted with `pin=key`; False if none."""
        return self.pins.unpin(key)

    def kv_blocks_held(self, pin: str, request_ids: Iterable[str] = ()) -> int:
        """Distinct device blocks referenced now by the KV pinned under `pin` and by the live
        requests' sequences: what a program holds at and between its steps (programs/
        admission.py). Each read is one C-level copy, so a connector's program thread may ask
        while the engine steps: a read that races a step is off by that step's blocks."""
        blocks = set(self.pins.blocks_of(pin))
        for rid in request_ids:
            req = self.live.requests.get(rid)
            for seq in req.seqs if req is not None else ():
                blocks.update(seq.block_ids)
        return sum(1 for b in blocks if b >= 0 and not self.pool.is_host(b))  # -1: trimmed

    def hold(self, request_id: str, keep_kv: bool = True) -> None:
        """Suspend a request until `resume`: free its KV blocks; its KV stays in host memory if
        `keep_kv` and it fits (`decide_held_kv`), else it is recomputed on resume."""
        self._stepper.drain()
        self.live.hold(request_id, keep_kv)

    def resume(self, request_id: str, front: bool = True) -> None:
        self.live.resume(request_id, front)

    def export(self, request_id: str, include_kv: bool = False) -> dict[str, Any]:
        """Turn a request into plain data and remove it from this engine."""
        self._stepper.drain()
        live = self.live.requests.get(request_id) or self.live.held.get(request_id)
        if live is not None and any(s.mm is not None for s in live.seqs):
            raise ValueError(f"request {request_id!r} has images: it cannot be exported")
        if request_id in self.live.requests:
            self.live.hold(request_id, keep_kv=include_kv)
        req = self.live.held.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not in this engine")
        return transfer.export_request(req, self.held_kv, self.runner, include_kv)

    def import_(self, state: dict[str, Any], front: bool = True) -> str:
        """Continue an exported request here; tokens match an unmoved run (greedy or seeded)."""
        rid = state["request_id"]
        self._check_new(rid)
        params = SamplingParams.from_dict(state["params"])
        self.check_request(state["prompt_token_ids"], params)
        lora = None if state.get("lora") is None else LoRARequest.from_dict(state["lora"])
        self.check_lora(lora)
        req = transfer.import_request(state, params, lora, self._seq_ids, self.held_kv,
                                      self.runner)
        if self.reasoning is not None:
            for seq in req.unfinished():  # its budget's state, replayed from its tokens
                ThinkingBudget.attach(seq, self.reasoning, self.thinking_cap)
        self.live.add(req, front=front)
        return rid

    # ---- reports ---------------------------------------------------------------------------
    def load(self, engine_id: EngineId = None) -> EngineLoad:
        """This engine's load report for a placement policy (`batchgen_data.placement`)."""
        spt = self.stats.prefill_s_per_token
        base = queue_report.load(self.scheduler, engine_id)
        return dataclasses.replace(
            base, held=base.held + len(self.live.held),
            remaining_tokens_est=sum(s.remaining_tokens_estimate()
                                     for r in self.live.requests.values()
                                     for s in r.unfinished()),
            kv_bytes_per_token=self.held_kv.bytes_per_token,
            prefill_tokens_per_s=int(1.0 / spt) if spt else 0,
            decode_step_s=self.stats.decode_step_s())

    def movable(self, max_running: int | None = None,
                exclude: Container[str] = ()) -> list[RequestSummary]:
        """Sequences another engine could take over (`export`): waiting ones in queue order,
        those held for memory, then the `max_running` (None: all) running ones that have
        generated most. Requests held by the user and those in `exclude` are left out."""
        return queue_report.movable(self.scheduler, max_running, exclude)

    def prefix_summary(self, engine_id: EngineId = None) -> PrefixSummary:
        """The prefixes this engine's cache holds now, for placement by prefix
        (`batchgen_data.placement.affinity`): the cross-process keys of its cached leading
        blocks; `version` changes only when they may have."""
        return PrefixSummary(engine_id, self.pool.prefix_version, self.pool.block_size,
                             self.pool.prefix_keys())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's `LLM.reset_prefix_cache`): later prompts
        compute their prefixes again. Running requests keep their blocks; True: always done."""
        self._stepper.drain()
        self.pool.reset_prefix_cache()
        return True
