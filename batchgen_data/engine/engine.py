"""The engine: owns the coroutines, the scheduler, the KV cache and the model runner.

`step()` runs one scheduling round: the scheduler picks suspended coroutines and token counts,
the runner computes them in one batch, the sampler draws next tokens, and each coroutine is
resumed with its result. Requests that finish in the step are returned at once (completion
order). The suspension-point primitives — abort, hold, resume, export, import_ — are public, and
so is what a placement policy reads (`load`, `movable`); nothing outside `engine/` needs the
scheduler itself. docs/ENGINE_API.md is the contract.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Container, Iterable
from typing import Any

import torch

from batchgen_data.config import EngineConfig, make_engine_config
from batchgen_data.worker.model_runner import ModelRunner
from batchgen_data.core.pins import PrefixPins
from batchgen_data.core.request import Request
from batchgen_data.sample.sampler import Sampler
from batchgen_data.core.scheduler import Scheduler, SchedulerOutput, decide_held_kv
from batchgen_data.core.sequence import Sequence, SequenceStatus
from batchgen_data.engine.setup import EngineParts, build_parts
from batchgen_data.engine.stats import EngineStats, StepShape
from batchgen_data.engine.stepper import Stepper
from batchgen_data.engine.step_failure import reason
from batchgen_data.sample.draw.draw_hash import sample_seed
from batchgen_data.engine.limits import check_limits, seed_bits
from batchgen_data.worker.lora_manager import adapter_names_for, check_adapter
from batchgen_data.worker import kv_format
from batchgen_data.lora_request import AdapterNames, LoRARequest
from batchgen_data.outputs import RequestOutput
from batchgen_data.inputs.prompt_checks import first_bad_token, too_long
from batchgen_data.placement import EngineId, EngineLoad, RequestSummary
from batchgen_data.sampling_params import SamplingParams


class Engine:
    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        self.config = config
        p = parts or build_parts(config)
        self.tokenizer = p.tokenizer
        self.device = p.device
        self.max_model_len = p.max_model_len
        self.vocab_size = p.model.shape.vocab
        self.pool = p.pool
        self.held_kv = p.held_kv
        moe = getattr(p.model, "moe", None)  # MoE models: their routing sizes the step budget
        self.scheduler = Scheduler(p.scheduler_config or config.scheduler, p.pool, p.held_kv,
                                   (moe.num_experts, moe.top_k) if moe is not None else None)
        self.runner: ModelRunner = p.runner
        if config.lora.enable_lora:  # adapters per request (worker/lora_manager.py)
            from batchgen_data.worker.lora_manager import attach

            self.runner.lora = attach(p.model, p.runner, config)
            self.scheduler.max_loras = config.lora.max_loras
        self.stopper = p.stopper
        self.sampler = Sampler(p.stopper.eos_token_ids, p.tokenizer)
        self.stats = EngineStats()
        if config.enable_expert_parallel and config.tensor_parallel_size > 1:
            self.stats.tokens_per_expert.ranks = config.tensor_parallel_size  # per-rank shares
        self.pins = PrefixPins(p.pool)  # prefixes kept for programs' next steps (core/pins.py)
        self.scheduler.reclaim = self._reclaim_pins
        self.requests: dict[str, Request] = {}  # live: waiting, running or held for memory
        self.held: dict[str, Request] = {}  # held by the user: not scheduled until resume()
        # called with every step's shape before the model runs (sim/calibrate.py times steps)
        self.on_step: Callable[[StepShape], None] | None = None
        # the live sequence coroutines by seq_id: a suspended coroutine is its Sequence, resumed
        # a step at a time by `coroutine.resume_step` (core/coroutine.py)
        self._coros: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        self._req_ids = itertools.count()
        self._rng = random.Random(config.seed)
        self._pending_out: list[RequestOutput] = []
        self._stepper = Stepper(self)

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

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """ValueError unless this engine can run `lora_request` (enable_lora, the adapter
        readable and fitting the model); its weights are then in host memory. Thread-safe:
        connectors call it on their row threads."""
        check_adapter(getattr(self.runner, "lora", None), lora_request)

    def lora_names(self) -> AdapterNames | None:
        """How rows name adapters here (a `lora` column, a row's `model`), or None without
        enable_lora (batchgen_data/lora_request.py)."""
        return adapter_names_for(self.config)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
               request_id: str | None = None, prompt: str | None = None,
               pin: str | None = None, front: bool = False,
               lora_request: LoRARequest | None = None, alone: bool = False) -> str:
        """`pin`: when the request finishes, keep its cached KV under that key until
        `unpin(pin)` (a program's next step extends this conversation: core/pins.py).
        `front`: queue it ahead of the waiting requests (a started program's next step goes
        before new programs, so it finishes while its KV is still there). `lora_request`: the
        adapter it runs under (None: the base model). `alone`: it runs in steps of its own,
        with no other request (a row suspected of killing an engine, run so that a failure
        names it alone: docs/row-errors.md)."""
        params = params or SamplingParams()
        self.check_request(prompt_token_ids, params)
        self.check_lora(lora_request)
        rid = request_id if request_id is not None else f"req-{next(self._req_ids)}"
        if rid in self.requests or rid in self.held:
            raise ValueError(f"request_id={rid!r} is already in this engine")
        ids = params.truncated_prompt(list(prompt_token_ids), self.max_model_len)
        req = Request(rid, prompt, ids, params, pin=pin, lora=lora_request)
        room = self.max_model_len - len(ids)
        for i in range(params.n):
            seed = self._seed_for(params.seed, i)
            max_tokens = min(params.max_tokens or room, room)
            req.seqs.append(Sequence(next(self._seq_ids), rid, i, ids, params, seed, max_tokens,
                                     lora=lora_request, alone=alone))
        self._add(req, front=front)
        return rid

    def _seed_for(self, seed: int | None, index: int) -> int:
        if seed is None:
            return self._rng.getrandbits(62)
        return sample_seed(seed_bits(seed), index)

    def _add(self, req: Request, front: bool = False) -> None:
        self.requests[req.request_id] = req
        for seq in req.unfinished():
            self._coros[seq.seq_id] = seq
            self.scheduler.add(seq, front=front)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending_out)

    def num_unfinished(self, exclude: Container[str] = ()) -> int:
        """Live requests (waiting, running, held for memory), those in `exclude` left out."""
        if not exclude:
            return len(self.requests)
        return sum(1 for rid in self.requests if rid not in exclude)

    def is_live(self, request_id: str) -> bool:
        """Submitted or imported here and not finished, aborted, exported or held by hold()."""
        return request_id in self.requests

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling round (engine/stepper.py; with `async_scheduling`, overlapped with the
        next one: docs/step.md)."""
        return self._stepper.step()

    def _move_kv(self, out: SchedulerOutput) -> None:
        # order matters: read the KV of sequences just held before new owners of their blocks
        # write them
        for seq, blocks in out.swap_out:
            if decide_held_kv(seq, self.held_kv, keep=True):
                self.held_kv.put(seq, self.runner.read_kv(blocks, seq.num_computed_tokens))
        for seq in out.swap_in:
            self.runner.write_kv(seq.block_ids, self.held_kv.take(seq))

    def _retire(self, *seqs: Sequence) -> None:
        self.scheduler.remove(*seqs)
        for seq in seqs:
            self.held_kv.drop(seq)
            del self._coros[seq.seq_id]

    def _collect_finished(self, done: list[Sequence]) -> list[RequestOutput]:
        outs = []
        for rid in dict.fromkeys(s.request_id for s in done):
            req = self.requests.get(rid)
            if req is not None and req.finished:
                del self.requests[rid]
                self.stats.num_finished += 1
                if req.pin is not None:
                    for seq in req.seqs:
                        self.pins.pin(req.pin, seq.token_ids, seq.cache_root)
                outs.append(req.output(self.stopper))
        return outs

    # ---- suspension-point primitives ------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        self._stepper.drain()  # a step in flight (async_scheduling) finishes first
        req = self.requests.pop(request_id, None) or self.held.pop(request_id, None)
        if req is None:
            return False
        for seq in req.unfinished():
            if seq.seq_id in self._coros:
                self._retire(seq)
            else:
                self.held_kv.drop(seq)
            seq.status = SequenceStatus.FINISHED_ABORTED
        self._pending_out.append(req.output(self.stopper))
        return True

    def _fail(self, errors: dict[str, Exception]) -> list[RequestOutput]:
        """Finish these requests with finish_reason "error" and why as their stop_reason (a
        step failed for each of them alone: engine/step_failure.py); their KV is freed."""
        outs = []
        for rid, exc in errors.items():
            req = self.requests.pop(rid)
            why = reason(exc)
            for seq in req.unfinished():
                self._retire(seq)
                seq.status = SequenceStatus.FINISHED_ERROR
                seq.stop_reason = why
            self.stats.num_failed += 1
            outs.append(req.output(self.stopper))
        return outs

    def _reclaim_pins(self, need: int, asking: Sequence | None) -> int:
        """The scheduler is `need` blocks short: drop pins, least valuable first. A pin is worth
        more the nearer its program's next step is to running, so the order is the queue read
        from its back (held for memory, then waiting, is the order steps resume in); for a
        running sequence (`asking` None) then also programs between steps and, last, running
        ones (their step holds its own blocks, so their pins free little). A waiting sequence
        (`asking`) may only take pins from the steps queued behind it."""
        if not len(self.pins):
            return 0
        queued = [s.request_id for s in (*self.scheduler.held, *self.scheduler.waiting)]
        if asking is not None:
            queued = queued[queued.index(asking.request_id) + 1:] if asking.request_id in \
                queued else []
        keys = [self.requests[rid].pin for rid in reversed(queued) if rid in self.requests]
        if asking is None:
            active = {r.pin for r in self.requests.values()}
            running = {self.requests[s.request_id].pin for s in self.scheduler.running}
            keys += [k for k in self.pins.keys() if k not in active]
            keys += [k for k in self.pins.keys() if k in running]
        return self.pins.reclaim(need, [k for k in dict.fromkeys(keys) if k is not None])

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
            req = self.requests.get(rid)
            for seq in req.seqs if req is not None else ():
                blocks.update(seq.block_ids)
        return sum(1 for b in blocks if not self.pool.is_host(b))

    def hold(self, request_id: str, keep_kv: bool = True) -> None:
        """Suspend a request until `resume`: free its KV blocks; its KV stays in host memory if
        `keep_kv` and it fits (`decide_held_kv`), else it is recomputed on resume."""
        self._stepper.drain()
        req = self._live(request_id)
        for seq in req.unfinished():
            self._hold_seq(seq, keep_kv)
        del self.requests[request_id]
        self.held[request_id] = req

    def _hold_seq(self, seq: Sequence, keep_kv: bool) -> None:
        on_device = seq.held_kv is None and bool(seq.block_ids)
        if decide_held_kv(seq, self.held_kv, keep_kv) and on_device:
            self.held_kv.put(seq, self.runner.read_kv(seq.block_ids, seq.num_computed_tokens))
        self.scheduler.remove(seq)
        self._coros.pop(seq.seq_id, None)
        seq.status = SequenceStatus.HELD

    def resume(self, request_id: str, front: bool = True) -> None:
        req = self.held.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not held")
        self._add(req, front=front)

    def export(self, request_id: str, include_kv: bool = False) -> dict[str, Any]:
        """Turn a request into plain data and remove it from this engine."""
        self._stepper.drain()
        if request_id in self.requests:
            self.hold(request_id, keep_kv=include_kv)
        req = self.held.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not in this engine")
        seqs = []
        for seq in req.seqs:
            state = seq.to_state()
            state["finish"] = int(seq.status) if seq.status.finished else None
            state["stop_reason"] = seq.stop_reason
            if include_kv and seq.held_kv is not None:
                state["kv"] = [(c := k.clone(), c if v is k else v.clone())  # one plane: once
                               for k, v in seq.held_kv]
                state["kv_format"] = kv_format.state_of(self.runner)  # dtype, FP8 scales
            self.held_kv.drop(seq)
            seqs.append(state)
        return {"request_id": req.request_id, "prompt": req.prompt,
                "prompt_token_ids": list(req.prompt_token_ids), "params": req.params.to_dict(),
                "seqs": seqs, "lora": None if req.lora is None else req.lora.to_dict(),
                "alone": any(s.alone for s in req.seqs)}

    def import_(self, state: dict[str, Any], front: bool = True) -> str:
        """Continue an exported request here; tokens match an unmoved run (greedy or seeded)."""
        rid = state["request_id"]
        if rid in self.requests or rid in self.held:
            raise ValueError(f"request_id={rid!r} is already in this engine")
        params = SamplingParams.from_dict(state["params"])
        self.check_request(state["prompt_token_ids"], params)
        lora = None if state.get("lora") is None else LoRARequest.from_dict(state["lora"])
        self.check_lora(lora)
        req = Request(rid, state.get("prompt"), list(state["prompt_token_ids"]), params,
                      lora=lora)
        for st in state["seqs"]:
            seq = Sequence(next(self._seq_ids), rid, st["index"], req.prompt_token_ids, params,
                           st["seed"], st["max_tokens"],
                           token_ids=req.prompt_token_ids + list(st["output_token_ids"]),
                           num_cached_tokens=st.get("num_cached_tokens", 0),
                           logprobs=st.get("logprobs"), stop_reason=st.get("stop_reason"),
                           prompt_logprobs=st.get("prompt_logprobs"), lora=lora,
                           alone=bool(state.get("alone", False)))
            if st.get("finish") is not None:
                seq.status = SequenceStatus(st["finish"])
            elif st.get("kv") is not None:
                kv = kv_format.adopt(st["kv"], st.get("kv_format"), self.runner)
                seq.num_computed_tokens = kv[0][0].shape[0]
                if decide_held_kv(seq, self.held_kv, keep=True):
                    self.held_kv.put(seq, kv)
            req.seqs.append(seq)
        self._add(req, front=front)
        return rid

    def _live(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not running in this engine")
        return req

    # ---- reports ---------------------------------------------------------------------------
    def load(self, engine_id: EngineId = None) -> EngineLoad:
        """This engine's load report for a placement policy (`batchgen_data.placement`)."""
        spt = self.stats.prefill_s_per_token
        base = self.scheduler.load(engine_id)
        return dataclasses.replace(
            base, held=base.held + len(self.held),
            remaining_tokens_est=sum(s.remaining_tokens_estimate()
                                     for r in self.requests.values() for s in r.unfinished()),
            kv_bytes_per_token=self.held_kv.bytes_per_token,
            prefill_tokens_per_s=int(1.0 / spt) if spt else 0,
            decode_step_s=self.stats.decode_step_s())

    def movable(self, max_running: int | None = None,
                exclude: Container[str] = ()) -> list[RequestSummary]:
        """Sequences another engine could take over (`export`): waiting ones in queue order,
        those held for memory, then the `max_running` (None: all) running ones that have
        generated most. Requests held by the user and those in `exclude` are left out."""
        return self.scheduler.movable(max_running, exclude)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (benchmarks that repeat the same prompts)."""
        self.pool.reset_prefix_cache()

    def step_until_decode(self) -> None:
        """Step until sequences run and each has exactly one token pending: the next step is a
        pure decode (where runner benchmarks and fast-path tests start)."""
        self._stepper.drain()
        while not self.scheduler.running or any(
                s.num_pending_tokens != 1 for s in self.scheduler.running):
            if not self.has_unfinished():
                raise RuntimeError("step_until_decode: no unfinished request to decode")
            self.step()

    def schedule_decode(self) -> SchedulerOutput:
        """`step_until_decode`, then schedule the next step without running it, for a caller
        that drives the model runner itself. A later `step()` schedules the same batch again."""
        self.step_until_decode()
        return self.scheduler.schedule()
