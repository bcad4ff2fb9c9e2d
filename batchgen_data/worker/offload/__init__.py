"""Weights beyond device memory, streamed with overlap.

`offload_model` plans (`plan.py`: what stays resident, how many slots, how big a step) and
installs a `WeightStore` (`store.py`) on a loaded model: the streamed decoder layers' weights
move to (pinned) host memory and are copied into a small device workspace right before each
layer runs, the next layer's copy overlapping the current layer's compute (`copy.py`); an MoE
layer's experts stream one routed expert at a time (`experts.py`). The
engine's setup calls it when `cpu_offload_gb > 0` or `weight_memory_bytes` is set. Outputs are
the resident path's exactly: the same kernels read the same bytes, only from another buffer.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Container
from typing import Any

import torch
from torch import nn

from batchgen_data.config import SchedulerConfig
from batchgen_data.worker.offload.experts import expert_set_bytes
from batchgen_data.worker.offload.plan import OffloadPlan, Rates, make_plan, measure_rates
from batchgen_data.worker.offload.store import WeightStore, layer_bytes, streamed_moes, weight_bytes

__all__ = ["OffloadPlan", "Rates", "WeightStore", "device_budget", "offload_model",
           "scheduler_for", "measure_rates", "weight_bytes"]

GIB = 1 << 30
# the largest step the plan raises the scheduler's caps to (KV memory bounds it further)
_MAX_STEP_TOKENS = 16384


def active_fraction(hf_config: Any) -> float:
    """The share of a layer's parameters one token uses: k/E for a mixture of experts."""
    experts = (getattr(hf_config, "num_experts", None)
               or getattr(hf_config, "num_local_experts", None))  # Mixtral's name
    k = getattr(hf_config, "num_experts_per_tok", None)
    return k / experts if experts and k else 1.0


def device_budget(total_bytes: int, cpu_offload_gb: float, weight_memory_bytes: int | None
                  ) -> int:
    """Weight bytes the device may hold: the weights minus `cpu_offload_gb` GiB, capped by
    `weight_memory_bytes` when set."""
    budget = total_bytes - int(cpu_offload_gb * GIB)
    return budget if weight_memory_bytes is None else min(budget, weight_memory_bytes)


def offload_model(model: nn.Module, cpu_offload_gb: float, device: torch.device,
                  hf_config: Any = None, weight_memory_bytes: int | None = None,
                  rates: Rates | None = None, stream_experts: bool = True
                  ) -> tuple[WeightStore, OffloadPlan] | None:
    """Streams enough of `model`'s decoder layers (built and loaded on the CPU) that its device
    weights, workspace included, stay within `device_budget`, and moves the rest of the model to
    `device`. None (the whole model moved) when the weights fit the budget. With
    `stream_experts`, a streamed MoE layer copies in only the experts its tokens are routed to
    (`experts.py`) when that workspace fits the budget; else whole layers stream."""
    total = weight_bytes(model)
    budget = device_budget(total, cpu_offload_gb, weight_memory_bytes)
    if budget >= total:
        model.to(device)
        return None
    exact = layer_bytes(model, aligned=False)
    other = total - sum(exact)
    dtype = next(model.parameters()).dtype
    rates = rates or measure_rates(device, dtype)
    largest = max(range(len(exact)), key=exact.__getitem__)
    params = exact[largest] // dtype.itemsize
    plan = make_plan(layer_bytes(model), other, budget, rates, params,
                     active_fraction(hf_config))
    granular = stream_experts and experts_fit(model, plan)
    store = WeightStore(model, list(plan.offloaded), plan.num_slots, device, granular)
    model.to(device)
    store.finish(model)
    return store, plan


def experts_fit(model: nn.Module, plan: OffloadPlan) -> bool:
    """Whether the streamed layers hold MoE experts that can stream apart within the plan's
    budget: per layer slot, the largest layer without its experts plus one expert set as large
    as the largest streamed MoE layer's experts (a model mixing dense and MoE layers may need
    more than its largest whole layer)."""
    moes = streamed_moes(model, list(plan.offloaded))
    if not moes:
        return False
    dense = layer_bytes(model, experts=False)
    slot = max(dense[i] for i in plan.offloaded) + max(expert_set_bytes(m.w13, m.w2)
                                                         for m in moes)
    return plan.resident_bytes + plan.num_slots * slot <= plan.budget_bytes


def scheduler_for(sc: SchedulerConfig, plan: OffloadPlan, given: Container[str] = ()
                  ) -> SchedulerConfig:
    """Module-based batching: a step of at least `plan.target_tokens` tokens so each streamed
    layer serves enough tokens to hide its copy. The caps named in `given` (the user set them:
    `EngineConfig.given`) are kept whatever their value; only the others are raised."""
    want = min(plan.target_tokens, _MAX_STEP_TOKENS)
    changes = {name: max(getattr(sc, name), want)
               for name in ("max_num_batched_tokens", "max_num_seqs") if name not in given}
    return dataclasses.replace(sc, **changes)
