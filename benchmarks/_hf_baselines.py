"""Hugging Face baselines for the GPU benchmark: static `generate` and continuous batching.

Both are time-boxed: whatever finished when the clock ran out is what they are measured on.
The continuous-batching API has moved between transformers 5.x releases (the GPU machine has
5.17, CI has newer), so optional arguments are passed only when the installed signature has them.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int  # generated to exactly this length (no EOS in the model)


@dataclass
class Outcome:
    """Tokens each request got (possibly cut short by the time box) and the wall time."""

    outputs: list[list[int]]
    wall_s: float
    extra: dict[str, Any]


def _left_pad(prompts: list[list[int]], pad_id: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [batch, width]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def hf_static(model: Any, requests: list[Request], limit_s: float, pad_id: int = 0) -> Outcome:
    """All requests in one left-padded `generate` batch; it decodes until the longest is done
    (or `limit_s` runs out, checked by `max_time` after every step)."""
    ids, mask = _left_pad([r.prompt_token_ids for r in requests], pad_id, model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max(r.max_tokens for r in requests),
                             pad_token_id=pad_id, max_time=limit_s)
    wall = time.perf_counter() - start
    gen = out[:, ids.shape[1]:].tolist()  # [batch, steps]
    return Outcome([row[:r.max_tokens] for row, r in zip(gen, requests)], wall,
                   {"hf_batch_size": len(requests), "hf_steps": len(gen[0])})


def _finished(res: Any) -> bool:
    if hasattr(res, "is_finished"):
        return bool(res.is_finished())
    status = getattr(res, "status", None)
    return getattr(status, "name", str(status)).endswith("FINISHED")


def _cb_kwargs(model: Any, requests: list[Request], cb_config: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(model.init_continuous_batching).parameters
    kwargs: dict[str, Any] = {}
    if "continuous_batching_config" in params and cb_config:
        from transformers import ContinuousBatchingConfig

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**cb_config)
    if "workload_hints" in params:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        kwargs["workload_hints"] = WorkloadHints(
            max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
            max_generated_length=max(r.max_tokens for r in requests),
            num_requests=len(requests))
    return kwargs


def hf_continuous(model: Any, requests: list[Request], limit_s: float,
                  cb_config: dict[str, Any] | None = None) -> Outcome:
    """HF continuous batching through its manager, so each request keeps its own
    max_new_tokens; collects results until all are done or `limit_s` has passed."""
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in requests))
    manager = model.init_continuous_batching(generation_config=gen_cfg,
                                             **_cb_kwargs(model, requests, cb_config or {}))
    if hasattr(manager, "warmup"):
        manager.warmup()  # sizes the cache, captures graphs: set-up, not timed
    add_params = inspect.signature(manager.add_request).parameters
    done: dict[str, list[int]] = {}
    errors: list[str] = []
    start = time.perf_counter()
    manager.start()
    try:
        for i, r in enumerate(requests):
            kw: dict[str, Any] = {"request_id": f"r{i}", "max_new_tokens": r.max_tokens}
            if "eos_token_id" in add_params:
                kw["eos_token_id"] = -1  # no EOS: every request runs to its max_new_tokens
            manager.add_request(r.prompt_token_ids, **kw)
        while len(done) + len(errors) < len(requests) and time.perf_counter() - start < limit_s:
            res = manager.get_result(timeout=1)
            if res is None:
                if hasattr(manager, "is_running") and not manager.is_running():
                    raise RuntimeError("HF continuous batching thread died; see its log above")
                continue
            if _finished(res):
                if getattr(res, "error", None):
                    errors.append(f"{res.request_id}: {res.error}")
                else:
                    done[res.request_id] = list(res.generated_tokens)
        wall = time.perf_counter() - start
    finally:
        try:
            manager.stop(block=True, timeout=30)
        except TypeError:
            manager.stop()
    if errors:
        raise RuntimeError(f"HF continuous batching failed {len(errors)} request(s): {errors[:3]}")
    return Outcome([done.get(f"r{i}", []) for i in range(len(requests))], wall,
                   {"attn_implementation": getattr(model.config, "_attn_implementation", None)})
